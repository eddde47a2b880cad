"""Online selection in fixed-capacity mode: epochs of calls, one timing reduce per epoch.

Fixed-capacity mode (``max_tokens_per_rank``) has no count exchange to carry the timing word and
no host sync to read it (``selector.online``'s normal protocol), and its demand, hence its
descriptors, is the same at every call. So a layer's calls of one pass kind ('train',
'forward_only') are cut into epochs of E = ``online.capacity_sync_every`` calls (>= 2):

  * call k E (an epoch's first): read the reduce posted in the previous epoch, if any (the mode's
    one host wait, on something posted E - 1 calls ago) and file it under the previous epoch's
    decision (``OnlineSelector.observe_reduced``); then ``decide`` this epoch's path from the
    capacity demand's descriptors. This call's dispatch and combine are timed (the caller starts
    the stopwatch after the prepare, whose first call per path builds a cached schedule);
  * call k E + 1: read that timer without waiting (``ready()``, a query; not ready: the word
    says "missing", a bad timing) and post one asynchronous all-reduce of the word (the caller's
    ``post``: ``exchange.timing_reduce``): every rank gets the slowest rank's time and any bad
    code, so every rank files the same number and takes the same decision at the same call;
  * the other calls of the epoch run its path and are not timed.

A time reaches the selector E calls after the call it measures (in the normal mode: one call);
an epoch that falls back to JOINT (``max_bad``) or runs idle (no remote payload) posts nothing.
Recomputes replay their forward's path (``OnlineSelector.replay``, in the dispatcher's mode,
``dispatch_modes.capacity``) and are not timed here. Pure host logic apart from ``post``'s
collective and ``result``'s wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_railwave.selector.online import OnlineDecision, OnlineSelector, encode_timing
from megatron_railwave.traffic import TrafficStats

__all__ = ["CapacityEpochs", "PostedPair", "Timer"]


class Timer(Protocol):
    """A stopwatch of one exchange region (``telemetry.stats.Stopwatch``)."""

    def ready(self) -> bool: ...

    def elapsed_ms(self) -> float: ...


class PostedPair(Protocol):
    """A posted all-reduce of the timing word (``exchange.timing_reduce.PostedTimingReduce``)."""

    def result(self) -> tuple[int, int]: ...


@dataclass(kw_only=True, slots=True)
class _Epoch:
    """The current epoch of one pass kind."""

    calls: int = 0
    """Calls of this pass kind so far (the position in the epoch is calls mod E)."""
    decision: OnlineDecision | None = None
    timers: list[Timer] = field(default_factory=list)
    """The epoch's first call's stopwatches (the dispatcher's mode fills the list), until
    posted."""
    posted: PostedPair | None = None
    """The reduce of this epoch's time, read at the next epoch's first call."""


class CapacityEpochs:
    """One layer's online selection in fixed-capacity mode (module docstring).

    Args:
        selector: the layer's online selector (its ``settings.capacity_sync_every`` is E).
        descriptors: the capacity demand's descriptors in the selector's coordinates
            (``online.fast_descriptors`` with ``selector.scales``), global and constant.
    """

    def __init__(self, selector: OnlineSelector, descriptors: TrafficStats) -> None:
        self.selector = selector
        self.descriptors = descriptors
        self.every = selector.settings.capacity_sync_every
        self._epochs: dict[str, _Epoch] = {}

    def begin_call(
        self, kind: str, post: Callable[[int], PostedPair]
    ) -> tuple[OnlineDecision, list[Any] | None, str | None]:
        """This call's decision, in pass ``kind`` ('train' or 'forward_only').

        Args:
            post: posts the all-reduce of this rank's timing word (called at an epoch's second
                call, on every rank alike).

        Returns:
            (decision, timers, message): ``timers`` is a list the caller fills with this call's
            exchange stopwatches (an epoch's first call), else None; ``message`` is the
            selector's fallback message when this call switched the layer to JOINT (log once).

        Host sync: at an epoch's first call after the first epoch (``result``: the reduce posted
        E - 1 calls ago). Collective: at an epoch's second call (``post``).
        """
        epoch = self._epochs.setdefault(kind, _Epoch())
        position = epoch.calls % self.every
        epoch.calls += 1
        if position == 0:
            message = None
            if epoch.posted is not None:
                max_word, min_word = epoch.posted.result()
                epoch.posted = None
                message = self.selector.observe_reduced(max_word, min_word, decision=epoch.decision)
            epoch.decision = self.selector.decide(kind, self.descriptors)
            epoch.timers = []
            return epoch.decision, epoch.timers, message
        decision = epoch.decision
        assert decision is not None  # position > 0 follows a position-0 call of the same kind
        if position == 1 and decision.mode not in ("idle", "fallback"):
            timers = epoch.timers
            seconds = None
            if timers and all(t.ready() for t in timers):  # no wait: query() only
                seconds = sum(t.elapsed_ms() for t in timers) * 1e-3
            epoch.posted = post(encode_timing(seconds, expected=True))
            epoch.timers = []
        return decision, None, None
