"""The torch.distributed backend: the rank programs of ``exchange.layer``, every move a
point-to-point phase of the ``ExecutionSchedule`` over torch.distributed (any layout; also the
fixed-capacity mode).

Letters: T tokens of this rank, E experts, E_loc local experts, H hidden, n_ent received
(token, local expert) entries.

``TorchDistBackend`` is the backend (``exchange.base.ExchangeBackend``: preparation and the four
programs); ``TorchDistExchange`` is the exchange that drives it (``exchange.driver.Exchange``,
which owns the count exchange, planning, the autograd functions and the asynchronous form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_railwave.exchange.base import ExchangeBackend
from megatron_railwave.exchange.capacity import PaddedEntries
from megatron_railwave.exchange.driver import Exchange
from megatron_railwave.exchange.groups import RankGroups
from megatron_railwave.exchange.layer import (
    EntryIndex,
    LayerDemand,
    LayerHandle,
    RankContext,
    combine_backward,
    combine_forward,
    dispatch_backward,
    dispatch_forward,
)
from megatron_railwave.exchange.transport import Program
from megatron_railwave.planner import PathPlan, PlanOptions
from megatron_railwave.topology import RailTopology

__all__ = ["ExchangeHandle", "TorchDistBackend", "TorchDistExchange"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeHandle:
    """Everything combine needs from dispatch (rank-local).

    Attributes:
        layer: schedule, rank view, index maps and host counts of the layer.
        entries: the received entries' copies and experts.
    """

    layer: LayerHandle
    entries: EntryIndex | PaddedEntries

    @property
    def plan(self) -> PathPlan:
        return self.layer.plan

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[E_loc] int64: the host counts (CPU), or in fixed-capacity mode the counts dispatch
        made on the input's device."""
        counts = self.layer.tokens_per_expert
        return self.entries.tokens_per_expert if counts is None else counts


class TorchDistBackend(ExchangeBackend):
    """The schedule's point-to-point programs (``exchange.layer``) as an exchange backend.

    Args:
        topo: the cluster (W must equal the EP size).
        groups: this rank's groups (``build_rail_groups``).
        num_experts: E (global), divisible by W.
        options: planner options (eligible policy, fan-in, replay windows).
    """

    runs_fixed_capacity = True

    def __init__(
        self,
        topo: RailTopology,
        groups: RankGroups,
        *,
        num_experts: int,
        options: PlanOptions | None = None,
    ) -> None:
        self.ctx = RankContext(
            topo=topo, groups=groups, num_experts=num_experts, options=options or PlanOptions()
        )

    def prepare(
        self, layer: LayerDemand, plan: PathPlan, hidden: torch.Tensor, probs: torch.Tensor
    ) -> LayerHandle:
        """The schedule and this rank's index maps (``prepare_schedule``), nothing more."""
        return self.prepare_schedule(layer, plan, hidden, probs)

    def dispatch_forward(
        self,
        prepared: LayerHandle,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
    ) -> Program:
        tokens, entry_probs, entries = yield from dispatch_forward(
            self.ctx, prepared, hidden, probs, routing_map
        )
        return tokens, entry_probs, ExchangeHandle(layer=prepared, entries=entries)

    def dispatch_backward(
        self,
        handle: ExchangeHandle,
        g_tokens: torch.Tensor,
        g_probs: torch.Tensor,
        probs_dtype: torch.dtype,
    ) -> Program:
        return (
            yield from dispatch_backward(self.ctx, handle.layer, handle.entries, g_tokens, g_probs)
        )

    def combine_forward(self, handle: ExchangeHandle, expert_out: torch.Tensor) -> Program:
        return (yield from combine_forward(self.ctx, handle.layer, handle.entries, expert_out))

    def combine_backward(self, handle: ExchangeHandle, g_out: torch.Tensor) -> Program:
        return (yield from combine_backward(self.ctx, handle.layer, handle.entries, g_out))


class TorchDistExchange(Exchange):
    """Executes path plans for one expert-parallel group over torch.distributed: the
    ``Exchange`` driving a ``TorchDistBackend``.

    Args:
        topo, groups, backend_args: ``TorchDistBackend``'s (``num_experts``, ``options``).
        timeout_s: bound of every wait of a layer (None: the process groups' own timeouts).
        max_tokens_per_rank: C, the fixed-capacity mode (None: the normal mode); see
            ``Exchange.prepare_capacity``.
    """

    def __init__(
        self,
        topo: RailTopology,
        groups: RankGroups,
        *,
        timeout_s: float | None = None,
        max_tokens_per_rank: int | None = None,
        **backend_args: Any,
    ) -> None:
        super().__init__(
            TorchDistBackend(topo, groups, **backend_args),
            timeout_s=timeout_s,
            max_tokens_per_rank=max_tokens_per_rank,
        )
