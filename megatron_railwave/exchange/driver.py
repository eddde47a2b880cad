"""``Exchange``: drives one execution backend (``exchange.base.ExchangeBackend``) for one EP
group; everything the backends share lives here, once.

Letters: T tokens of this rank, E experts, E_loc local experts, H hidden, n_ent received
(token, local expert) entries.

Per layer: ``gather_demand`` (one all-to-all on the EP group, then the layer's one host
sync), ``plan`` (pure, host), ``prepare`` (the backend's), ``dispatch`` and ``combine``
(autograd functions whose backward is the other's data movement; the backend supplies the four
programs). In fixed-capacity mode (``max_tokens_per_rank``; backends with
``runs_fixed_capacity``), ``prepare_capacity`` replaces the first three: no communication and no
host sync before ``dispatch``, and none in the whole layer. Every tensor the exchange makes lives
on the input's device; every wait is bounded by ``timeout_s`` and a failure names the stage, the
group and the unresponsive peers.

The backends' public faces are ``TorchDistExchange`` (exchange/torch_dist.py) and
``DeepEPExchange`` (exchange/deepep.py): this class with their backend built in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_railwave.exchange.base import ExchangeBackend
from megatron_railwave.exchange.capacity import check_capacity
from megatron_railwave.exchange.groups import (
    report_failure,
    reported_failures,
    survey_unresponsive,
)
from megatron_railwave.exchange.layer import (
    InputError,
    LayerDemand,
    LayerHandle,
    capacity_failure,
    gather_demand,
    prepare_capacity_layer,
)
from megatron_railwave.exchange.pending import (
    PendingProgram,
    comm_stream_for,
    finish,
    start,
)
from megatron_railwave.exchange.status import StatusWatch, abort_groups, exchange_status
from megatron_railwave.exchange.timing_reduce import PostedTimingReduce, post_timing_reduce
from megatron_railwave.exchange.transport import (
    GroupRef,
    TorchDistTransport,
    drive,
)
from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, build_plan
from megatron_railwave.traffic import DemandCounts

__all__ = ["Exchange", "DispatchOutput", "PendingDispatch", "PendingCombine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchOutput:
    """Attributes:
    tokens: [n_ent, H], hidden dtype, rows contiguous per local expert (ascending).
        Fixed-capacity mode: [E_loc * W * C, H], the padded layout (expert e's entries are
        rows e * W * C + k, k < tokens_per_expert[e]; the other rows are zero).
    tokens_per_expert: [E_loc] int64 on CPU (fixed-capacity mode: on the input's device).
    probs: [n_ent], probs dtype, routing probability of each entry (padding rows: 0).
    handle: pass back to ``combine`` (the backend's dispatch handle: ``ExchangeHandle`` for the
        torch backend, ``exchange.deepep.DeepEPHandle`` for DeepEP).
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    probs: torch.Tensor
    handle: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class PendingDispatch:
    """A dispatch whose phases are posted (``Exchange.start_dispatch``); pass it to
    ``finish_dispatch`` with the same hidden / probs."""

    program: PendingProgram
    handle: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class PendingCombine:
    """A combine whose phases are posted (``Exchange.start_combine``); pass it to
    ``finish_combine`` with the same expert output."""

    program: PendingProgram
    handle: Any


class _Box:
    """Carries the dispatch handle out of the autograd function (not a tensor)."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle: Any = None


# The autograd functions of every backend: each direction's backward runs the other direction's
# program. The backend supplies the four programs (``ExchangeBackend.dispatch_forward`` ...).
class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        probs,
        routing_map,
        exchange: Exchange,
        prepared: Any,
        box: _Box,  # type: ignore[override]
        pending: PendingProgram | None = None,
    ):
        if pending is not None:  # started by start_dispatch: only the rest of its program
            tokens, entry_probs, handle = finish(pending)
        else:
            tokens, entry_probs, handle = exchange._run(
                exchange.backend.dispatch_forward(prepared, hidden, probs, routing_map)
            )
        box.handle = handle
        ctx.exchange, ctx.handle, ctx.probs_dtype = exchange, handle, probs.dtype
        return tokens, entry_probs

    @staticmethod
    def backward(ctx, g_tokens, g_probs):  # type: ignore[override]
        ex: Exchange = ctx.exchange
        g_hidden, g_probs_TE = ex._run(
            ex.backend.dispatch_backward(
                ctx.handle, g_tokens.contiguous(), g_probs.contiguous(), ctx.probs_dtype
            )
        )
        return g_hidden, g_probs_TE, None, None, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        expert_out,
        exchange: Exchange,
        handle: Any,  # type: ignore[override]
        pending: PendingProgram | None = None,
    ):
        ctx.exchange, ctx.handle = exchange, handle
        if pending is not None:  # started by start_combine
            return finish(pending)
        return exchange._run(exchange.backend.combine_forward(handle, expert_out))

    @staticmethod
    def backward(ctx, g_out):  # type: ignore[override]
        ex: Exchange = ctx.exchange
        return (
            ex._run(ex.backend.combine_backward(ctx.handle, g_out.contiguous())),
            None,
            None,
            None,
        )


class Exchange:
    """Executes path plans for one expert-parallel group with one backend.

    Args:
        backend: what moves the data (``TorchDistBackend``, ``DeepEPBackend``); its ``ctx``
            gives the topology (W = the EP size), this rank's groups, E and the planner options.
        timeout_s: bound of every wait of a layer (None: the process groups' own timeouts).
        max_tokens_per_rank: C, the fixed-capacity mode (None: the normal mode); see
            ``prepare_capacity``. Only for a backend that ``runs_fixed_capacity``.
    """

    def __init__(
        self,
        backend: ExchangeBackend,
        *,
        timeout_s: float | None = None,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        self.backend = backend
        self.ctx = backend.ctx
        self.topo = self.ctx.topo
        self.groups = groups = self.ctx.groups
        self.num_experts = self.ctx.num_experts
        self.options = self.ctx.options
        self.timeout_s = timeout_s
        self.max_tokens_per_rank = check_capacity(max_tokens_per_rank)
        assert self.max_tokens_per_rank is None or backend.runs_fixed_capacity, (
            f"{type(backend).__name__} does not run the fixed-capacity mode"
        )
        self._calls = 0
        placement = groups.placement
        self.transport = TorchDistTransport(
            rank=groups.railwave_rank,
            timeout_s=timeout_s,
            survey=self._survey,
            explain=self._explain,
            abort=self.abort,
            ep_rank_of=None if placement.identity else placement.ep_rank_of_railwave,
        )
        self._watch = StatusWatch(timeout_s=timeout_s, abort=self.abort)
        """NCCL, fixed-capacity mode: the posted status words (``exchange.status``)."""

    @property
    def experts_per_rank(self) -> int:
        return self.ctx.experts_per_rank

    def _survey(self, stage: str, group: GroupRef) -> list[int]:
        return survey_unresponsive(
            self.groups, self._calls, stage, group, grace_s=min(2.0, (self.timeout_s or 8.0) / 4)
        )

    def _explain(self) -> str:
        reports = reported_failures(self.groups, self._calls)
        return "; ".join(
            f"EP rank {self.groups.ep_ranks([r])[0]} reported: {message}"
            for r, message in sorted(reports.items())
        )

    def abort(self) -> None:
        """Abort this rank's process groups (EP, node, rail): NCCL work in flight ends now, on
        this rank and on the peers waiting for it (``exchange.status.abort_groups``)."""
        abort_groups((self.groups.ep, self.groups.node, self.groups.rail))

    def _run(self, program):
        return drive(program, self.transport)

    # ------------------------------------------------------------------ step 1: counts
    def gather_demand(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        *,
        expert_loads: bool = False,
        delivery_counts: bool = False,
        timing_word: int | None = None,
    ) -> LayerDemand:
        """The count exchange (``exchange.layer.gather_demand``); ``expert_loads`` adds the
        global tokens per expert, ``delivery_counts`` every rank's copies per destination GPU
        (the min-max plans' input); both the same on every rank. ``timing_word``: this
        rank's timing word for the online selector, returned from every rank in ``timing_W``.

        Collective: yes (EP group). Host sync: yes (one, the counts).

        Raises:
            InputError: on every rank, when any rank's input is malformed (names the ranks).
        """
        self._calls += 1
        return self._run(
            gather_demand(
                self.ctx,
                hidden,
                probs,
                routing_map,
                expert_loads=expert_loads,
                delivery_counts=delivery_counts,
                timing_word=timing_word,
            )
        )

    # ------------------------------------------------------------------ step 2: plan
    def plan(
        self,
        demand: LayerDemand | DemandCounts,
        path: str,
        *,
        phase: int = 0,
        streamed: bool | None = None,
    ) -> PathPlan:
        """The global plan (pure; identical on every rank). ``streamed``: stream the relay into
        the rail phases for this call (the online selector's '+streamed' candidates; torch
        backend), None = the exchange's options. Host sync: no."""
        counts = demand.demand if isinstance(demand, LayerDemand) else demand
        options = self.options
        if streamed is not None and streamed != options.streamed:
            options = replace(options, streamed=streamed)
        return build_plan(counts, self.topo, path, options=options, phase=phase)

    def prepare(
        self, layer: LayerDemand, plan: PathPlan, hidden: torch.Tensor, probs: torch.Tensor
    ) -> Any:
        """Compile ``plan`` into the schedule and build this rank's index maps, the backend's
        prepared layer (part of the planning cost; ``ExchangeBackend.prepare``). No
        communication; host sync: no."""
        return self.backend.prepare(layer, plan, hidden, probs)

    # ------------------------------------------------------------------ fixed capacity
    def prepare_capacity(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        path: Route | str,
    ) -> LayerHandle:
        """Fixed-capacity mode: this layer's handle for ``dispatch`` without any communication or
        host sync (replaces ``gather_demand``, ``plan`` and ``prepare``; ``exchange.capacity``).

        Its checks are host-local (``capacity_failure``); then every rank exchanges a status word
        over the EP group (``exchange.status``: 0, or the failing rank's code and T), so a
        failure raises on every rank, named, even when the failing rank's process exits: gloo at
        once (the all-gather runs on the host here); NCCL at the next call, after a watcher
        thread that reads the posted words off the host's path aborted the groups (no host
        sync; not yet run on hardware). The failing rank also leaves its message in the job's
        store (``groups.report_failure``), which the peers quote.

        Collective: yes (EP group, W int64). Host sync: no (gloo: a host wait on the CPU
        all-gather).

        Raises:
            InputError / CapacityOverflowError: malformed input, or T > ``max_tokens_per_rank``,
                on this rank or (naming it) on another.
            ExchangeError / ExchangeTimeoutError: the status exchange failed (a peer is gone
                before it), or (NCCL) an earlier call's words were late.
            RuntimeError: the exchange was built without ``max_tokens_per_rank``.
        """
        if self.max_tokens_per_rank is None:
            raise RuntimeError(
                "prepare_capacity: this exchange runs the normal mode (max_tokens_per_rank=None); "
                "use gather_demand / plan / prepare, or build it with max_tokens_per_rank"
            )
        self._watch.check()
        self._calls += 1
        capacity = self.max_tokens_per_rank
        failure = capacity_failure(self.ctx, hidden, probs, routing_map, capacity)
        if failure is not None:
            report_failure(self.groups, self._calls, f"{type(failure).__name__}: {failure}")
        self._exchange_status(failure, int(routing_map.shape[0]), routing_map.device)
        if failure is not None:
            raise failure
        return prepare_capacity_layer(
            self.ctx, hidden, probs, routing_map, path=path, capacity=capacity
        )

    def _exchange_status(
        self, failure: InputError | None, num_tokens: int, device: torch.device
    ) -> None:
        """The status words of this call (``exchange.status.exchange_status``)."""
        exchange_status(
            self.groups,
            self.transport,
            self._watch,
            failure=failure,
            num_tokens=num_tokens,
            device=device,
            call=self._calls,
            capacity=self.max_tokens_per_rank,
            timeout_s=self.timeout_s,
        )

    def post_timing(self, word: int, device: torch.device) -> PostedTimingReduce:
        """Fixed-capacity mode, ``selector: online``: post the all-reduce of this rank's timing
        word over the EP count group (``exchange.timing_reduce``; 16 bytes per rank); read it
        with ``result()`` an epoch later.

        Collective: yes (EP group, asynchronous). Host sync: no.
        """
        self._watch.check()
        return post_timing_reduce(
            word, self.groups.ep, device=device, timeout_s=self.timeout_s, abort=self.abort
        )

    # ------------------------------------------------------------------ step 3: move
    def dispatch(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        handle: Any,
    ) -> DispatchOutput:
        """Move tokens to the experts (differentiable in hidden and probs).

        Args:
            hidden: [T, H] rank-local tokens (floating point).
            probs: [T, E] routing probabilities.
            routing_map: [T, E] bool, top-k True per row.
            handle: ``self.prepare(layer, plan, hidden, probs)`` (or ``prepare_capacity``) for
                the same routing map.

        Host sync: no (the DeepEP backend: one per wave, DeepEP's CPU wait on the received
        counts).
        """
        box = _Box()
        tokens, entry_probs = _DispatchFn.apply(hidden, probs, routing_map, self, handle, box)
        return _output(tokens, entry_probs, box.handle)

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """Expert outputs [n_ent, H] (rows as ``DispatchOutput.tokens``) -> [T, H], summed over a
        token's experts in the canonical order. Host sync: no."""
        return _CombineFn.apply(expert_out, self, handle)

    # ------------------------------------------------------------------ asynchronous form
    # ``dispatch`` = ``finish_dispatch(start_dispatch(...))`` and likewise for combine, with the
    # same numbers bit for bit: the programs are the same, only where the caller's own work falls
    # between their requests differs (``exchange.pending``). The backward directions stay
    # synchronous (autograd runs them).
    def start_dispatch(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        handle: Any,
    ) -> PendingDispatch:
        """Post the dispatch and return before it completes (gloo: at its first wait on a phase
        in flight; CUDA: once every phase is enqueued on the communication stream).

        Host sync: no. Collective: the dispatch's phases (node / rail groups).
        """
        hidden_d, probs_d = hidden.detach(), probs.detach()
        program = start(
            self.backend.dispatch_forward(handle, hidden_d, probs_d, routing_map),
            self.transport,
            comm_stream=comm_stream_for(hidden.device),
            inputs=(hidden_d, probs_d, routing_map),
        )
        return PendingDispatch(program=program, handle=handle)

    def finish_dispatch(
        self,
        hidden: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        pending: PendingDispatch,
    ) -> DispatchOutput:
        """Complete ``start_dispatch`` (same arguments): ``dispatch``'s output, differentiable in
        hidden and probs. Host sync: no (gloo: blocks until the phases completed)."""
        box = _Box()
        tokens, entry_probs = _DispatchFn.apply(
            hidden, probs, routing_map, self, pending.handle, box, pending.program
        )
        return _output(tokens, entry_probs, box.handle)

    def start_combine(self, expert_out: torch.Tensor, handle: Any) -> PendingCombine:
        """Post the combine and return before it completes (as ``start_dispatch``). Host sync:
        no."""
        out_d = expert_out.detach()
        program = start(
            self.backend.combine_forward(handle, out_d),
            self.transport,
            comm_stream=comm_stream_for(expert_out.device),
            inputs=(out_d,),
        )
        return PendingCombine(program=program, handle=handle)

    def finish_combine(self, expert_out: torch.Tensor, pending: PendingCombine) -> torch.Tensor:
        """Complete ``start_combine`` (same expert output): ``combine``'s [T, H], differentiable."""
        return _CombineFn.apply(expert_out, self, pending.handle, pending.program)


def _output(tokens: torch.Tensor, entry_probs: torch.Tensor, handle: Any) -> DispatchOutput:
    """``DispatchOutput`` of one dispatch (``handle.tokens_per_expert``: the host counts, or in
    fixed-capacity mode the ones dispatch counted on the device)."""
    return DispatchOutput(
        tokens=tokens, tokens_per_expert=handle.tokens_per_expert, probs=entry_probs, handle=handle
    )
