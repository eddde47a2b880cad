"""What every dispatch mode shares: the per-call records and the mode interface.

Letters: T tokens of this rank, E experts, E_loc local experts, H hidden, n_ent received
(token, local expert) entries.

``RailWaveTokenDispatcher`` keeps one ``LayerState`` between Megatron's six hooks (its
``_state``) and hands each ``token_dispatch`` to its mode as a ``DispatchInputs``. The mode
chooses the call's path and prepares the layer, then calls the dispatcher's shared tail
(``MoveTail``: replay memory, capture, the dispatch with the shared expert's overlap, statistics)
and returns what it returns.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_railwave.names import Route, parse_route
from megatron_railwave.process import global_rank
from megatron_railwave.selector import FixedSelector, OnlineSelector
from megatron_railwave.steps import PassKind
from megatron_railwave.telemetry.stats import LayerCommStats, Stopwatch

if TYPE_CHECKING:
    from megatron_railwave.exchange import DispatchOutput, Exchange, LayerHandle
    from megatron_railwave.selector import PathSelector
    from megatron_railwave.traffic import DemandCounts, TrafficStats

__all__ = [
    "DispatchInputs",
    "DispatchMode",
    "LayerCall",
    "LayerState",
    "MoveTail",
    "log_once_per_job",
    "plans_min_max",
]

# The dispatcher's logger: the modes' notices keep the name they were logged under before the
# modes left dispatcher.py (what a user's log filter names).
_LOG = logging.getLogger("megatron_railwave.dispatcher")


def log_once_per_job(message: str | None) -> None:
    """Log the online selector's fallback ``message`` (None: nothing) on global rank 0 only: every
    rank takes the same decision, so one line per job says it."""
    if message is not None and global_rank() == 0:
        _LOG.warning(message)


def plans_min_max(selector: PathSelector | OnlineSelector, path: Route | str | None) -> bool:
    """Whether this layer call's plan may be a min-max one (FLOW / FLOW_WAVES), whose planner
    reads every rank's copies per destination GPU (``planner.plan.delivery_copies_NNGG``), so the
    count exchange must carry the delivery counts: a path already fixed for the call (a recompute
    replays its forward's, which gathered them too) that is one, a fixed selector's, or an online
    selector with one among its candidates. The same answer on every rank (the configuration's)."""
    if path is not None:
        return parse_route(path).min_max
    if isinstance(selector, FixedSelector):
        return selector.path.min_max
    if isinstance(selector, OnlineSelector):
        return any(p.route.min_max for p in selector.candidates)
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCall:
    """What one layer call is: its pass, step, micro-batch, plan phase and (recompute) path."""

    kind: PassKind
    step: int
    microbatch: int
    phase: int
    path: Route | None = None
    """The first forward's path, replayed by its recompute; None: select."""


@dataclass(kw_only=True, slots=True)
class LayerState:
    """Per-call state between the six hooks (cleared in combine_postprocess)."""

    hidden_shape: torch.Size
    routing_map: torch.Tensor
    call: LayerCall
    wants_stats: bool
    dispatched: DispatchOutput | None = None
    stats: LayerCommStats | None = None
    timers: dict[str, Stopwatch] = field(default_factory=dict)
    exchange_timers: list[Stopwatch] = field(default_factory=list)
    """The online selector: this call's exchange stopwatches (plan + dispatch, combine), started by
    the mode, the combine's added by ``token_combine``; read at a later call without a wait."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchInputs:
    """One ``token_dispatch`` call as a mode sees it (rank-local tensors, railwave expert order).

    Attributes:
        state: the layer call's state (``LayerState``).
        exchange: the layer's exchange.
        hidden_states: [T, H], hidden dtype.
        probs: [T, E], the routing probabilities.
        routing_map: [T, E] bool.
        record_bytes: bytes of one token row (H x the hidden dtype's size).
        layer_number: Megatron's layer number (None: not set), named in the online selector's
            logs and learned-paths report.
    """

    state: LayerState
    exchange: Exchange
    hidden_states: torch.Tensor
    probs: torch.Tensor
    routing_map: torch.Tensor
    record_bytes: int
    layer_number: int | None


class MoveTail(Protocol):
    """The dispatcher's shared tail of every mode (``RailWaveTokenDispatcher._move``): remember
    the path for the recompute, capture, dispatch (with the shared expert's overlap), then the
    statistics from ``descr`` (the descriptors, or the counts they are computed from). Returns
    (entries [n_ent, H], probs [n_ent])."""

    def __call__(
        self,
        inputs: DispatchInputs,
        *,
        path: Route,
        handle: LayerHandle,
        descr: TrafficStats | DemandCounts | None,
        plan_ms: float,
        expert_loads: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DispatchMode(ABC):
    """How a layer's calls choose their path and prepare the exchange, chosen once per layer
    (``choose.choose_dispatch_mode``). A mode owns the state its calls share.

    Args:
        selector: the layer's path selector (a ``FixedSelector`` for a fixed path).
    """

    def __init__(self, selector: PathSelector | OnlineSelector) -> None:
        self.selector = selector

    @abstractmethod
    def token_dispatch(
        self, inputs: DispatchInputs, move: MoveTail
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose this call's path, prepare the layer and ``move``. Returns ``move``'s result."""

    def tokens_per_expert(self, dispatched: DispatchOutput) -> torch.Tensor:
        """The ``tokens_per_expert`` Megatron's experts get ([E_loc] int64 on CPU): the
        exchange's counts."""
        return dispatched.tokens_per_expert

    def combine_done(self, state: LayerState) -> None:  # noqa: B027 (optional, no-op default)
        """After a combine that ran with ``state.exchange_timers``, all stopped. Default:
        nothing to keep."""
