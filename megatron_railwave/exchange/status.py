"""A failure on one rank reaches every rank within ``timeout_s``, named.

Two pieces:

* **The status word of a fixed-capacity call.** Fixed-capacity mode (``max_tokens_per_rank``)
  has no count exchange for an input problem to ride on, so before the payload every rank
  all-gathers one int64 over the EP group: 0 (ready), or a code above bit 56 and, below it, the
  rank's T (``encode_status``). A rank that overflows the capacity (or has malformed input)
  still takes part in this all-gather, then raises its own error; every peer decodes the words
  and raises ``CapacityOverflowError`` / ``InputError`` naming that rank, its T, the capacity
  and the fix (``status_error``), even when the failing rank's process then exits.

  - gloo: the all-gather runs on the host before the payload (``TorchDistTransport``'s bounded
    wait; no device exists to sync with). Cost measured in docs/exchange.md.
  - NCCL: the all-gather is posted on the device and read off the host's path by a daemon thread
    (``StatusWatch``): a side stream copies the words into pinned memory and records an event
    that the thread polls (``Event.query``: no host sync on the training thread). A nonzero
    word, or words not complete within ``timeout_s`` (a peer never reached the call), make the
    thread log the cause and abort the process groups (``abort_groups``), which ends the peers'
    NCCL work at once instead of after the watchdog's timeout; the training thread raises the
    cause at its next exchange call (``StatusWatch.check``). Not yet run on hardware.

* **Bounded device waits** (``transport.wait_event``, re-exported here): poll a CUDA event up to
  ``timeout_s``, then abort the groups and raise ``ExchangeTimeoutError`` naming what was
  awaited (the timing reduce's read, ``exchange.timing_reduce``; the normal mode's count
  exchange, ``Collective.host_read``), instead of ``Event.synchronize()`` or a blocking copy,
  which wait for the NCCL watchdog. Not yet run on hardware (the logic runs on CPU with fake
  events in tests/unit/exchange/test_status.py and test_transport_waits.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave.exchange.groups import RankGroups, reported_failures
from megatron_railwave.exchange.layer import CapacityOverflowError, InputError
from megatron_railwave.exchange.pending import copy_to_host_after
from megatron_railwave.exchange.transport import (
    Collective,
    ExchangeTimeoutError,
    GroupRef,
    TorchDistTransport,
    wait_event,
)

__all__ = [
    "STATUS_OVERFLOW",
    "STATUS_BAD_INPUT",
    "encode_status",
    "decode_status",
    "status_error",
    "abort_groups",
    "wait_event",
    "PostedStatus",
    "StatusWatch",
    "exchange_status",
]

_LOG = logging.getLogger(__name__)

STATUS_OVERFLOW = 1
"""Code of a rank whose T exceeds the capacity."""
STATUS_BAD_INPUT = 2
"""Code of a rank whose input is malformed (``exchange.layer.input_status``)."""
_CODE_SHIFT = 56
_TOKENS_MASK = (1 << _CODE_SHIFT) - 1


def encode_status(code: int, num_tokens: int) -> int:
    """The status word: ``code`` (0 ready, ``STATUS_*``) above bit 56, T below it."""
    return (code << _CODE_SHIFT) | min(max(num_tokens, 0), _TOKENS_MASK) if code else 0


def decode_status(word: int) -> tuple[int, int]:
    """(code, T) of a status word."""
    return word >> _CODE_SHIFT, word & _TOKENS_MASK


def status_error(
    words: Sequence[int],
    *,
    ep_ranks: Sequence[int],
    me: int,
    capacity: int,
    call: int,
    reports: dict[int, str] | None = None,
) -> Exception | None:
    """The error every rank raises for the status words of one fixed-capacity call (None when
    every word is 0).

    Args:
        words: the EP group's status words, member order.
        ep_ranks: Megatron EP rank of each member (names them).
        me: this rank's member index (named as the one reporting).
        capacity: C, ``max_tokens_per_rank``.
        call: the exchange's call number (names the layer call).
        reports: {member: message} the failing ranks left in the job's store (quoted when there).
    """
    reports = reports or {}
    overflow, bad = [], []
    for member, word in enumerate(words):
        code, t = decode_status(int(word))
        if code == STATUS_OVERFLOW:
            overflow.append((ep_ranks[member], t))
        elif code:
            bad.append((ep_ranks[member], reports.get(member, "")))
    if not overflow and not bad:
        return None
    head = f"RailWave fixed-capacity mode, EP rank {ep_ranks[me]}, layer call {call}: "
    if bad:
        named = "; ".join(
            f"EP rank {r} has malformed dispatcher input" + (f" ({msg})" if msg else "")
            for r, msg in bad
        )
        return InputError(f"{head}{named}; see that rank's own error for the fix")
    worst = max(t for _, t in overflow)
    named = ", ".join(f"EP rank {r}: {t} tokens" for r, t in overflow)
    return CapacityOverflowError(
        f"{head}CapacityOverflowError on {named} > max_tokens_per_rank={capacity} (the fixed "
        f"capacity every buffer is sized for); raise max_tokens_per_rank to at least {worst} "
        "(micro-batch size x sequence length / tensor-parallel size for Megatron), or set it to "
        "None for the normal mode"
    )


def abort_groups(groups: Iterable[GroupRef]) -> None:
    """Abort the process groups' communicators (NCCL: ends their work in flight on every rank
    that waits on this one, instead of after the watchdog's timeout). Best effort: a group
    without a handle, or one torch cannot abort, is skipped."""
    seen = set()
    for group in groups:
        handle = group.handle
        if handle is None or id(handle) in seen:
            continue
        seen.add(id(handle))
        try:
            dist.distributed_c10d._abort_process_group(handle)
        except Exception:  # noqa: BLE001 - aborting is best effort (gloo, destroyed group)
            try:
                handle.abort()
            except Exception:  # noqa: BLE001
                _LOG.debug("could not abort %s", group.describe())


@dataclass(kw_only=True, slots=True)
class PostedStatus:
    call: int
    event: Any
    host: Any
    """[P] int64 (pinned host memory) the side stream fills: the words in torch group-rank
    order."""
    posted: float
    decode: Callable[[list[int]], Exception | None]
    """Words (group-rank order) -> the error to raise, or None."""
    late: Callable[[], Exception]
    """The error of words not complete within ``timeout_s``."""


class StatusWatch:
    """NCCL: the posted status words of fixed-capacity calls, checked by a daemon thread.

    Args:
        timeout_s: how long a call's words may take (None: no limit; only nonzero words fail).
        abort: aborts the exchange's process groups (``abort_groups``).
        poll_s: the thread's polling interval.
    """

    def __init__(
        self,
        *,
        timeout_s: float | None,
        abort: Callable[[], None],
        poll_s: float = 0.002,
    ) -> None:
        self.timeout_s = timeout_s
        self.abort = abort
        self.poll_s = poll_s
        self._posted: list[PostedStatus] = []
        self._lock = threading.Lock()
        self._failure: Exception | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(self, posted: PostedStatus) -> None:
        """Watch one call's words (starts the thread on first use)."""
        with self._lock:
            self._posted.append(posted)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="railwave-status-watch", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def pending(self) -> int:
        """Calls whose words the thread has not read yet."""
        with self._lock:
            return len(self._posted)

    def check(self) -> None:
        """Raise the failure the thread found, if any (the training thread, at each call)."""
        failure = self._failure
        if failure is not None:
            raise failure

    def poll_once(self) -> None:
        """One pass of the thread: read the complete words, fail on a nonzero or late one."""
        with self._lock:
            posted = list(self._posted)
        done = []
        for p in posted:
            if p.event.query():
                done.append(p)
                failure = p.decode([int(w) for w in p.host.tolist()])
            elif self.timeout_s is not None and time.monotonic() - p.posted >= self.timeout_s:
                failure = p.late()
            else:
                continue
            if failure is not None:
                self._fail(failure)
                return
        with self._lock:
            self._posted = [p for p in self._posted if p not in done]

    def _fail(self, failure: Exception) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        with self._lock:
            self._posted = []
        _LOG.error("%s", failure)
        self.abort()

    def _loop(self) -> None:
        while self._failure is None:
            if not self.pending():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self.poll_once()
            time.sleep(self.poll_s)


def exchange_status(
    groups: RankGroups,
    transport: TorchDistTransport,
    watch: StatusWatch,
    *,
    failure: InputError | None,
    num_tokens: int,
    device: torch.device,
    call: int,
    capacity: int,
    timeout_s: float | None,
) -> None:
    """All-gather this rank's status word over the EP group before a fixed-capacity payload
    (``Exchange.prepare_capacity``).

    gloo (or host tensors): a host collective through ``transport`` (bounded by ``timeout_s``,
    failures named); a peer's failure raises here, on every rank but the failing one (which
    raises its own error after this returns). NCCL: posted on the device, a side stream copies
    the words into pinned memory and records an event; ``watch`` reads them off the host's path.

    Collective: yes (EP group, W int64). Host sync: no.
    """
    ep = groups.ep
    if ep.handle is None:  # one process, no torch.distributed
        return
    if failure is None:
        code = 0
    elif isinstance(failure, CapacityOverflowError):
        code = STATUS_OVERFLOW
    else:
        code = STATUS_BAD_INPUT
    word = torch.tensor([encode_status(code, num_tokens)], dtype=torch.int64)
    members = len(ep.ranks)
    me = ep.ranks.index(groups.railwave_rank)
    ep_ranks = groups.ep_ranks(list(ep.ranks))

    def decode(words: list[int]) -> Exception | None:
        reports = {ep.ranks.index(r): m for r, m in reported_failures(groups, call).items()}
        return status_error(
            words, ep_ranks=ep_ranks, me=me, capacity=capacity, call=call, reports=reports
        )

    if device.type != "cuda" or dist.get_backend(ep.handle) == "gloo":
        recv = torch.empty(members, dtype=torch.int64)
        transport.collective(
            Collective(kind="all_gather", stage="capacity.status", group=ep, send=word, recv=recv)
        )
        error = decode(recv.tolist()) if failure is None else None
        if error is not None:
            raise error
        return
    send = word.pin_memory().to(device, non_blocking=True)
    recv = torch.empty(members, dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(recv, send, group=ep.handle, async_op=True)
    host, event = copy_to_host_after(work, recv, "status word")
    order = [ep.peer(m) for m in range(members)]  # member -> torch group rank

    def late() -> Exception:
        quoted = "; ".join(
            f"EP rank {groups.ep_ranks([r])[0]} reported: {m}"
            for r, m in sorted(reported_failures(groups, call).items())
        )
        return ExchangeTimeoutError(
            f"RailWave fixed-capacity mode, EP rank {ep_ranks[me]}, layer call {call}: the "
            f"status words of {ep.describe()} did not arrive within timeout_s={timeout_s} s: a "
            "peer never reached this layer call"
            + (f"; {quoted}" if quoted else "; see the peers' own errors")
        )

    watch.add(
        PostedStatus(
            call=call,
            event=event,
            host=host,
            posted=time.monotonic(),
            decode=lambda by_group: decode([by_group[g] for g in order]),
            late=late,
        )
    )
