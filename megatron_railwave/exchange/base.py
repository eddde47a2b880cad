"""``ExchangeBackend``: what one execution backend of the exchange supplies, and nothing else.

Letters: T tokens of this rank, E experts, E_loc local experts, H hidden, n_ent received
(token, local expert) entries.

Shaped like Megatron-Core's flex dispatcher, which gives each communication manager one small
interface and keeps the managers siblings: ``exchange.driver.Exchange`` owns everything the
backends share (the count exchange, planning, fixed-capacity preparation, the autograd functions,
the asynchronous start / finish form, the timing reduce, the transport and its failure reports)
and drives one backend, which supplies only what differs:

* ``prepare``: this rank's index maps of one planned layer (the backend's prepared layer);
* four rank programs (generators the transport drives, ``exchange.transport.Program``):
  dispatch forward / backward and combine forward / backward. Each direction's backward is the
  other direction's data movement; every program follows the layer's ``ExecutionSchedule``.

The siblings: ``TorchDistBackend`` (exchange/torch_dist.py; every move a point-to-point phase of
the schedule) and ``DeepEPBackend`` (exchange/deepep.py; the relay phase, then DeepEP's internode
dispatch / combine per wave). A new backend is a new file with a subclass of this one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from megatron_railwave.exchange.layer import LayerDemand, LayerHandle, RankContext, prepare_layer
from megatron_railwave.exchange.transport import Program
from megatron_railwave.planner import PathPlan

__all__ = ["ExchangeBackend"]


class ExchangeBackend(ABC):
    """One execution backend: preparation and the four rank programs of a layer (rank-local).

    A prepared layer (``prepare``'s result) has ``plan`` (the ``PathPlan``) and
    ``tokens_per_expert`` ([E_loc] int64 on CPU; None in fixed-capacity mode). A dispatch handle
    (the third result of ``dispatch_forward``, passed back to the other three programs) has
    ``plan`` and ``tokens_per_expert`` ([E_loc] int64: the prepared layer's, or in fixed-capacity
    mode the counts dispatch made on the device).

    Attributes:
        ctx: the EP group's topology, groups, E and planner options (``RankContext``).
        runs_fixed_capacity: whether the programs take ``prepare_capacity_layer``'s handles (the
            fixed-capacity mode, ``exchange.capacity``).
    """

    ctx: RankContext
    runs_fixed_capacity: ClassVar[bool] = False

    @abstractmethod
    def prepare(
        self, layer: LayerDemand, plan: PathPlan, hidden: torch.Tensor, probs: torch.Tensor
    ) -> Any:
        """This rank's prepared layer for ``plan`` (schedule, index maps). No communication; host
        sync: no.

        Raises:
            ValueError: the inputs or the plan are outside what the backend runs.
        """

    def prepare_schedule(
        self, layer: LayerDemand, plan: PathPlan, hidden: torch.Tensor, probs: torch.Tensor
    ) -> LayerHandle:
        """What every backend's ``prepare`` starts from: the plan compiled into the schedule,
        this rank's view of it and its index maps (``exchange.layer.prepare_layer``)."""
        return prepare_layer(
            self.ctx,
            layer,
            plan,
            hidden_dtype=hidden.dtype,
            probs_dtype=probs.dtype,
            hidden_size=hidden.shape[-1],
        )

    @abstractmethod
    def dispatch_forward(
        self, prepared: Any, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> Program:
        """Program returning (tokens [n_ent, H] hidden dtype, rows contiguous per local expert;
        entry probs [n_ent] probs dtype; the dispatch handle).

        Args:
            prepared: ``prepare``'s result (or, when ``runs_fixed_capacity``, a fixed-capacity
                ``LayerHandle``).
            hidden: [T, H] rank-local tokens.
            probs: [T, E] routing probabilities.
            routing_map: [T, E] bool, top-k True per row.
        """

    @abstractmethod
    def dispatch_backward(
        self, handle: Any, g_tokens: torch.Tensor, g_probs: torch.Tensor, probs_dtype: torch.dtype
    ) -> Program:
        """Program returning (g_hidden [T, H], g_probs [T, E] ``probs_dtype``) from the gradients
        of dispatch's outputs (g_tokens [n_ent, H], g_probs [n_ent]; contiguous)."""

    @abstractmethod
    def combine_forward(self, handle: Any, expert_out: torch.Tensor) -> Program:
        """Program returning [T, H]: expert outputs [n_ent, H] (rows as dispatch's tokens) summed
        over each token's experts in the canonical order."""

    @abstractmethod
    def combine_backward(self, handle: Any, g_out: torch.Tensor) -> Program:
        """Program returning g_expert_out [n_ent, H] from g_out [T, H] (contiguous)."""
