"""The online selector in fixed-capacity mode: the reduced timing pair, filing under an explicit
decision, the epoch protocol (``selector.capacity_epochs``) driven for several ranks in one
process with a simulated all-reduce, and the config knob."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave.config import OnlineSettings, RailWaveConfig
from megatron_railwave.names import Candidate, Route
from megatron_railwave.selector import OnlineSelector, selector_from_config
from megatron_railwave.selector.capacity_epochs import CapacityEpochs
from megatron_railwave.selector.online import (
    TIMING_MISSING,
    TIMING_NAN,
    TIMING_NONE,
    TIMING_STALLED,
    SharedNeighbourhoods,
    slowest_reduced_timing,
    slowest_timing,
)
from tests.helpers.online_cases import SCALES, TOPO, TRUE_S, stats


# ---------------------------------------------------------------------- the reduced pair
def test_reduced_pair_cases_worked_by_hand():
    # every rank measured: the largest word, in seconds
    assert slowest_reduced_timing(3000, 1000) == (3e-6, None)
    # no rank had a measurement: words all 0
    assert slowest_reduced_timing(TIMING_NONE, TIMING_NONE) == (None, None)
    # one rank's NaN (-2) under others' times: the min names the kind, no rank list
    seconds, problem = slowest_reduced_timing(5000, TIMING_NAN)
    assert seconds is None and "NaN" in problem and "EP rank(s) [" not in problem
    assert "missing" in slowest_reduced_timing(5000, TIMING_MISSING)[1]
    assert "zero (stalled clock)" in slowest_reduced_timing(TIMING_STALLED, TIMING_STALLED)[1]
    # a rank without a time where others have one: min 0, max > 0
    assert "no timing where the others did" in slowest_reduced_timing(5000, TIMING_NONE)[1]


word = st.one_of(
    st.integers(1, 1 << 40),
    st.sampled_from([TIMING_NONE, TIMING_MISSING, TIMING_NAN, -3, TIMING_STALLED]),
)


@settings(max_examples=200, deadline=None)
@given(words=st.lists(word, min_size=1, max_size=16))
def test_reduced_pair_agrees_with_every_rank_words(words):
    """What the all-reduce (max, min) gives is what the gathered words give: the same seconds,
    and a problem exactly when ``slowest_timing`` reports one."""
    full_s, full_problem = slowest_timing(words)
    pair_s, pair_problem = slowest_reduced_timing(max(words), min(words))
    assert pair_s == full_s
    assert (pair_problem is None) == (full_problem is None)


# ---------------------------------------------------------------------- filing under a decision
def test_observe_files_under_the_given_decision_not_the_last_one():
    shared = SharedNeighbourhoods()
    sel = OnlineSelector(OnlineSettings(probes=1), scales=SCALES, shared=shared)
    train = sel.decide("train", stats(64))  # probe JOINT (train table)
    evalp = sel.decide("forward_only", stats(64))  # probe JOINT (forward-only table); now _last
    assert (train.path, train.mode, evalp.mode) == (Route.JOINT, "probe", "probe")
    assert (
        shared.pending[("train", Candidate(Route.JOINT))] == 1
        and shared.pending[("forward_only", Candidate(Route.JOINT))] == 1
    )
    assert sel.observe_reduced(7000, 5000, decision=train) is None
    (nb,) = sel._tables["train"]
    (nb_eval,) = sel._tables["forward_only"]
    assert (
        list(nb.times[Candidate(Route.JOINT)].recent) == [7000 * 1e-9]
        and not nb_eval.times[Candidate(Route.JOINT)].recent
    )
    assert (
        shared.pending[("train", Candidate(Route.JOINT))] == 0
        and shared.pending[("forward_only", Candidate(Route.JOINT))] == 1
    )
    assert sel.expects_timing()  # the forward-only decision is still the previous call's
    # The words form with an explicit decision files there too (and leaves _last alone).
    assert sel.observe([4000, 9000], decision=evalp) is None
    assert (
        list(nb_eval.times[Candidate(Route.JOINT)].recent) == [9000 * 1e-9] and sel.expects_timing()
    )
    assert shared.pending[("forward_only", Candidate(Route.JOINT))] == 0
    # Without a decision: the previous call's, as before.
    sel.observe([1000])
    assert (
        list(nb_eval.times[Candidate(Route.JOINT)].recent) == [9000 * 1e-9, 1000 * 1e-9]
        and not sel.expects_timing()
    )


def test_observe_reduced_counts_bad_pairs_and_falls_back():
    sel = OnlineSelector(OnlineSettings(max_bad=2), scales=SCALES, layer=7)
    d = sel.decide("train", stats(64))
    assert sel.observe_reduced(5000, TIMING_NAN, decision=d) is None
    message = sel.observe_reduced(5000, TIMING_MISSING, decision=d)
    assert message is not None and "layer 7" in message and "JOINT" in message
    assert sel.decide("train", stats(64)).mode == "fallback"


# ---------------------------------------------------------------------- the epoch protocol
class _Timer:
    def __init__(self, ms: float, ready: bool = True) -> None:
        self.ms, self._ready = ms, ready

    def ready(self) -> bool:
        return self._ready

    def elapsed_ms(self) -> float:
        return self.ms


class _Reduce:
    """All ranks' n-th posts form one all-reduce; ``result`` gives (max, min) of their words."""

    def __init__(self, ranks: int) -> None:
        self.words: list[list[int]] = []
        self.ranks = ranks
        self.read = 0

    def post_for(self, rank: int, posts_seen: list[int]):
        def post(word: int):
            n = posts_seen[rank]
            posts_seen[rank] += 1
            if n == len(self.words):
                self.words.append([])
            self.words[n].append(word)
            reduce = self

            class _Posted:
                def result(self_inner) -> tuple[int, int]:
                    words = reduce.words[n]
                    assert len(words) == reduce.ranks, "read before every rank posted"
                    reduce.read += 1
                    return max(words), min(words)

            return _Posted()

        return post


def drive(
    kinds: list[str], *, ranks: int = 4, every: int = 2, skew=None, clock=None, max_bad: int = 3
):
    """Run ``kinds[c]`` at call c on every rank (lockstep, like a collective); rank r's timer reads
    ``clock(r, call, path)`` ms (default: the true time x ``skew[r]``). Returns per rank the list of
    (kind, path, mode) and the positions of posts."""
    sels = [
        OnlineSelector(
            OnlineSettings(
                probes=1, reprobe_every=1000, capacity_sync_every=every, max_bad=max_bad
            ),
            scales=SCALES,
            layer=3,
        )
        for _ in range(ranks)
    ]
    epochs = [CapacityEpochs(sel, stats(64)) for sel in sels]
    reduce, seen = _Reduce(ranks), [0] * ranks
    out: list[list[tuple[str, Route, str]]] = [[] for _ in range(ranks)]
    posts: list[list[int]] = [[] for _ in range(ranks)]
    messages: list[list[str]] = [[] for _ in range(ranks)]
    for call, kind in enumerate(kinds):
        for r in range(ranks):
            before = seen[r]
            decision, timers, message = epochs[r].begin_call(kind, reduce.post_for(r, seen))
            if seen[r] > before:
                posts[r].append(call)
            if message:
                messages[r].append(message)
            if timers is not None:
                ms = (
                    clock(r, call, decision.path)
                    if clock
                    else TRUE_S[decision.path] * 1e3 * (skew[r] if skew else 1.0)
                )
                timers.append(_Timer(ms * 0.25))  # the dispatch half
                timers.append(_Timer(ms * 0.75))  # the combine half
            out[r].append((kind, decision.path, decision.mode))
    return out, posts, messages, sels


def test_epochs_probe_each_path_for_one_epoch_then_exploit_and_ranks_agree():
    """E = 2, probes 1: calls 0-1 JOINT, 2-3 RAIL, 4-5 PERM, 6-7 NATIVE (one path per epoch),
    then the fastest (JOINT); a reduce is posted at each epoch's second call; clocks skewed per
    rank give the same decisions everywhere."""
    out, posts, messages, sels = drive(["train"] * 12, skew=[1.0, 1.7, 0.6, 2.4])
    assert all(o == out[0] for o in out)
    paths = [p for _, p, _ in out[0]]
    assert (
        paths
        == [Route.JOINT] * 2
        + [Route.RAIL] * 2
        + [Route.PERM] * 2
        + [Route.NATIVE] * 2
        + [Route.JOINT] * 4
    )
    assert [m for _, _, m in out[0]] == ["probe"] * 8 + ["exploit"] * 4
    assert all(p == [1, 3, 5, 7, 9, 11] for p in posts)
    assert not any(messages)
    # What was filed is the slowest rank's time (skew 2.4), the same number on every rank.
    for sel in sels:
        (nb,) = sel._tables["train"]
        assert nb.times[Candidate(Route.RAIL)].recent[0] == pytest.approx(TRUE_S[Route.RAIL] * 2.4)
        assert sel.last_seconds == sels[0].last_seconds


def test_epochs_of_each_pass_kind_count_their_own_calls():
    """Forward-only calls between training calls open their own epochs and file their own times:
    the training epochs see only training calls."""
    kinds = [
        "train",
        "forward_only",
        "train",
        "train",
        "forward_only",
        "train",
        "forward_only",
        "forward_only",
        "train",
    ]
    out, posts, _, sels = drive(kinds, every=2)
    train = [p for k, p, _ in out[0] if k == "train"]
    evalp = [p for k, p, _ in out[0] if k == "forward_only"]
    assert train == [Route.JOINT, Route.JOINT, Route.RAIL, Route.RAIL, Route.PERM]
    assert evalp == [Route.JOINT, Route.JOINT, Route.RAIL, Route.RAIL]
    # posts: at the second call of each kind's epochs (train calls 2 and 5; forward-only 4 and 7)
    assert posts[0] == [2, 4, 5, 7]
    times = {
        k: {p: list(t.recent) for p, t in sels[0]._tables[k][0].times.items() if t.recent}
        for k in ("train", "forward_only")
    }
    assert {str(p) for p in times["train"]} == {"joint", "rail"}
    assert {str(p) for p in times["forward_only"]} == {"joint"}


def test_one_rank_nan_clock_sends_every_rank_to_joint_at_the_same_call():
    def clock(r, call, path):
        return math.nan if r == 2 and call >= 4 else TRUE_S[path] * 1e3

    out, posts, messages, _ = drive(["train"] * 14, clock=clock, max_bad=2)
    assert all(o == out[0] for o in out)
    modes = [m for _, _, m in out[0]]
    # epoch 2 (calls 4-5) and 3 (6-7) time NaN on rank 2; the second bad pair is read at call 8
    assert modes[:8] == ["probe"] * 8 and modes[8:] == ["fallback"] * 6
    assert all(p == Route.JOINT for _, p, m in out[0] if m == "fallback")
    assert all(len(m) == 1 and "layer 3" in m[0] for m in messages)
    assert all(p == [1, 3, 5, 7] for p in posts)  # a fallen-back layer posts nothing


def test_a_timer_not_ready_is_a_missing_time_not_a_wait():
    sel = OnlineSelector(OnlineSettings(probes=1, capacity_sync_every=3, max_bad=5), scales=SCALES)
    epochs = CapacityEpochs(sel, stats(64))
    posted = []

    class _Posted:
        def __init__(self, word):
            self.word = word

        def result(self):
            return self.word, self.word

    def post(word):
        posted.append(word)
        return _Posted(word)

    _, timers, _ = epochs.begin_call("train", post)
    timers.append(_Timer(1.0, ready=False))
    epochs.begin_call("train", post)
    epochs.begin_call("train", post)
    assert posted == [TIMING_MISSING]
    epochs.begin_call("train", post)  # next epoch: reads the missing word, counts it bad
    assert sel.bad_total == 1 and "missing" in sel.last_problem


def test_idle_layers_post_nothing():
    """No remote payload (one node): every path moves the same; no timing reduce is posted."""
    sel = OnlineSelector(OnlineSettings(capacity_sync_every=2), scales=SCALES)
    epochs = CapacityEpochs(sel, stats(0))
    posted = []
    for _ in range(5):
        decision, _, _ = epochs.begin_call("train", posted.append)
        assert decision.mode == "idle"
    assert posted == []


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("value", [1, 0, 2.5, True, "4"])
def test_config_capacity_sync_every_must_be_an_integer_of_at_least_2(value):
    with pytest.raises(
        ValueError, match=rf"online.capacity_sync_every={value!r} must be an integer >= 2"
    ):
        RailWaveConfig.from_dict({"online": {"capacity_sync_every": value}})


def test_config_fixed_capacity_with_path_auto_runs_the_online_epochs():
    config = RailWaveConfig.from_dict(
        {"max_tokens_per_rank": 64, "online": {"capacity_sync_every": 3}}
    )
    assert config.selector_kind() == "online" and config.online.capacity_sync_every == 3
    assert config.to_dict()["online"]["capacity_sync_every"] == 3
    assert "'capacity_sync_every': 3" in config.fingerprint()["selector"]  # ranks must agree on it
    assert isinstance(selector_from_config(config, TOPO), OnlineSelector)
    # Naming it is the same; a fixed path is the way to no selection (no reduce, no host wait).
    named = RailWaveConfig.from_dict({"selector": "online", "max_tokens_per_rank": 64})
    assert named.selector_kind() == "online"
    assert RailWaveConfig(path="joint", max_tokens_per_rank=64).selector_kind() == "fixed"
    assert OnlineSettings().to_dict()["capacity_sync_every"] == 4


def test_online_capacity_mode_refuses_streamed_candidates():
    """Fixed capacity plans each path once for every call: a '+streamed' candidate would run
    unstreamed, so the mode refuses it (a config refuses it at load)."""
    from megatron_railwave.dispatch_modes.capacity import OnlineCapacityMode

    settings = OnlineSettings(candidates=("joint", "joint+streamed"))
    selector = OnlineSelector(settings, scales=SCALES)
    with pytest.raises(ValueError, match="fixed-capacity mode.*streamed: true"):
        OnlineCapacityMode(selector, TOPO, capacity=16, num_local_experts=2)
