"""exchange.status on CPU: the status words, the watcher thread's decisions and the bounded
event wait, with fake events and a fake abort (the NCCL half is not yet run on hardware)."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_railwave.exchange import CapacityOverflowError, ExchangeTimeoutError, InputError
from megatron_railwave.exchange.status import (
    STATUS_BAD_INPUT,
    STATUS_OVERFLOW,
    PostedStatus,
    StatusWatch,
    decode_status,
    encode_status,
    status_error,
    wait_event,
)


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_status_word_round_trips_code_and_tokens():
    assert encode_status(0, 99) == 0
    word = encode_status(STATUS_OVERFLOW, 13)
    assert word == (1 << 56) + 13 and decode_status(word) == (STATUS_OVERFLOW, 13)
    assert decode_status(encode_status(STATUS_BAD_INPUT, 0)) == (STATUS_BAD_INPUT, 0)


def test_status_error_names_every_overflowing_rank_and_the_largest_t():
    # Members 0..3 are EP ranks 4..7; members 1 and 3 overflow C = 12 with 13 and 20 tokens.
    words = [0, encode_status(STATUS_OVERFLOW, 13), 0, encode_status(STATUS_OVERFLOW, 20)]
    err = status_error(words, ep_ranks=[4, 5, 6, 7], me=0, capacity=12, call=3)
    assert isinstance(err, CapacityOverflowError)
    msg = str(err)
    assert "EP rank 4, layer call 3" in msg
    assert "EP rank 5: 13 tokens, EP rank 7: 20 tokens > max_tokens_per_rank=12" in msg
    assert "raise max_tokens_per_rank to at least 20" in msg
    assert status_error([0, 0], ep_ranks=[0, 1], me=1, capacity=12, call=1) is None


def test_status_error_quotes_a_bad_input_report():
    words = [encode_status(STATUS_BAD_INPUT, 5), 0]
    err = status_error(
        words, ep_ranks=[0, 1], me=1, capacity=8, call=1, reports={0: "routing_map is float"}
    )
    assert isinstance(err, InputError) and not isinstance(err, CapacityOverflowError)
    assert "EP rank 0 has malformed dispatcher input (routing_map is float)" in str(err)


def _posted(event, words, *, decode=None, late=None, posted=None) -> PostedStatus:
    return PostedStatus(
        call=1,
        event=event,
        host=torch.tensor(words, dtype=torch.int64),
        posted=time.monotonic() if posted is None else posted,
        decode=decode or (lambda w: status_error(w, ep_ranks=[0, 1], me=0, capacity=12, call=1)),
        late=late or (lambda: ExchangeTimeoutError("call 1: the status words were late")),
    )


def test_watch_aborts_and_raises_on_a_peers_overflow_word():
    aborted = []
    watch = StatusWatch(timeout_s=5.0, abort=lambda: aborted.append(1))
    event = FakeEvent(done=False)
    watch._posted.append(_posted(event, [0, encode_status(STATUS_OVERFLOW, 13)]))
    watch.poll_once()  # not complete yet, not late: nothing happens
    assert not aborted and watch.pending() == 1
    watch.check()
    event.done = True
    watch.poll_once()
    assert aborted == [1] and watch.pending() == 0
    with pytest.raises(CapacityOverflowError, match="EP rank 1: 13 tokens > max_tokens_per_rank"):
        watch.check()


def test_watch_drops_ready_words_without_aborting():
    aborted = []
    watch = StatusWatch(timeout_s=5.0, abort=lambda: aborted.append(1))
    watch._posted.append(_posted(FakeEvent(done=True), [0, 0]))
    watch.poll_once()
    assert not aborted and watch.pending() == 0
    watch.check()


def test_watch_fails_late_words_after_timeout_s():
    aborted = []
    watch = StatusWatch(timeout_s=0.5, abort=lambda: aborted.append(1))
    watch._posted.append(_posted(FakeEvent(done=False), [0, 0], posted=time.monotonic() - 0.6))
    watch.poll_once()
    assert aborted == [1]
    with pytest.raises(ExchangeTimeoutError, match="late"):
        watch.check()


def test_watch_thread_finds_the_failure_within_timeout_s():
    """The daemon thread (no caller polling): a word completing later is seen within ms."""
    aborted = []
    watch = StatusWatch(timeout_s=5.0, abort=lambda: aborted.append(time.monotonic()))
    event = FakeEvent(done=False)
    watch.add(_posted(event, [encode_status(STATUS_OVERFLOW, 40), 0]))
    time.sleep(0.05)
    assert not aborted
    t0 = time.monotonic()
    event.done = True
    deadline = t0 + 2.0
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert aborted and aborted[0] - t0 < 1.0
    with pytest.raises(CapacityOverflowError, match="EP rank 0: 40 tokens"):
        watch.check()


def test_wait_event_returns_when_done_and_aborts_past_timeout_s():
    wait_event(FakeEvent(done=True), timeout_s=0.1, what="x")
    aborted = []
    t0 = time.monotonic()
    with pytest.raises(ExchangeTimeoutError, match=r"the timing reduce did not complete within"):
        wait_event(
            FakeEvent(done=False),
            timeout_s=0.2,
            what="the timing reduce",
            abort=lambda: aborted.append(1),
        )
    assert aborted == [1] and 0.2 <= time.monotonic() - t0 < 2.0
