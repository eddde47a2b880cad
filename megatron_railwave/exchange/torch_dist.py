"""Dispatch and combine over torch.distributed (NCCL on GPUs, gloo on CPU).

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens of this rank, E experts,
E_loc = E / W local experts, E_node = G * E_loc experts of one node, H hidden, n_rec records of
this rank, n_copy copies received, n_ent (token, local expert) entries received.

Lifecycle of one layer:
  1. ``gather_demand``: one all-gather of a fixed-size int64 vector per rank (record histogram,
     expert counts, token count and an input-status code). Every rank gets the same global
     counts; bad input anywhere raises the same error on every rank right after this first
     collective, before any data moves. Host sync: yes (one, the counts).
  2. ``dispatch``: plan (pure, same on all ranks), route this rank's records, move payload,
     probs and metadata along the path, expand copies into entries sorted by
     (local expert, source rank, token) - a canonical order, so every path feeds the experts
     the same rows in the same order. Host sync: no more.
  3. ``combine``: entries -> copies (sum over local experts, ascending) -> records (sum over
     the destination node's GPUs, in local-rank order) -> tokens (sum over destination nodes, in
     order). The reduction order does not depend on the path: all four paths give
     bitwise-identical outputs and gradients.
Dispatch and combine are differentiable; the backward of one is the other's data movement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planner import PathPlan, PlanOptions, RankSplits, RecordRoutes, build_plan, rank_splits, route_records
from ..topology import RailTopology
from ..traffic import DemandCounts, target_masks
from .groups import RailGroups
from .layout import DeliveryLayout, OwnerLayout, delivery_layout, owner_layout
from .moves import combine_move, dispatch_move

__all__ = ["ExchangeHandle", "DispatchOutput", "TorchDistExchange", "InputError"]

_ROUTING_BITS_PER_WORD = 62
# torch >= 2.13 renames all_gather_into_tensor; keep older clusters working.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class InputError(ValueError):
    """Bad dispatcher input, raised identically on every rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeHandle:
    """Everything combine needs from dispatch (rank-local). Created by ``dispatch``.

    Attributes:
        plan: the global plan used.
        splits: this rank's split sizes.
        routes: this rank's records (canonical order).
        owner: index maps of stages 1-2.
        delivery: index maps of stage 3.
        copy_of_entry: [n_ent] int64, the received copy each entry came from.
        num_tokens: T of this rank.
    """

    plan: PathPlan
    splits: RankSplits
    routes: RecordRoutes
    owner: OwnerLayout
    delivery: DeliveryLayout
    copy_of_entry: torch.Tensor
    num_copies: int
    num_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchOutput:
    """Attributes:
        tokens: [n_ent, H], hidden dtype, rows contiguous per local expert (ascending).
        tokens_per_expert: [E_loc] int64 on CPU.
        probs: [n_ent] float32, routing probability of each entry.
        handle: pass back to ``combine``.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    probs: torch.Tensor
    handle: ExchangeHandle


class _Context:
    """Carries the handle pieces into the autograd functions (not a tensor)."""

    __slots__ = ("exchange", "plan", "splits", "owner", "delivery", "num_records")

    def __init__(self, exchange: TorchDistExchange, plan: PathPlan, splits: RankSplits,
                 owner: OwnerLayout, delivery: DeliveryLayout, num_records: int) -> None:
        self.exchange, self.plan, self.splits = exchange, plan, splits
        self.owner, self.delivery, self.num_records = owner, delivery, num_records

    def kwargs(self) -> dict:
        return dict(plan=self.plan, splits=self.splits, owner=self.owner, groups=self.exchange.groups,
                    delivery=self.delivery, timeout_s=self.exchange.timeout_s)


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, payload_R, probs_R, meta_R, hctx: _Context):  # type: ignore[override]
        out = dispatch_move([payload_R, probs_R, meta_R], check_masks_from=2, **hctx.kwargs())
        ctx.hctx = hctx
        ctx.mark_non_differentiable(out[2])
        return out[0], out[1], out[2]

    @staticmethod
    def backward(ctx, g_payload, g_probs, _g_meta):  # type: ignore[override]
        hctx: _Context = ctx.hctx
        g_payload, g_probs = combine_move([g_payload.contiguous(), g_probs.contiguous()],
                                          num_records=hctx.num_records, **hctx.kwargs())
        return g_payload, g_probs, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_copies, hctx: _Context):  # type: ignore[override]
        ctx.hctx = hctx
        return combine_move([y_copies], num_records=hctx.num_records, **hctx.kwargs())[0]

    @staticmethod
    def backward(ctx, g_records):  # type: ignore[override]
        hctx: _Context = ctx.hctx
        return dispatch_move([g_records.contiguous()], **hctx.kwargs())[0], None


class TorchDistExchange:
    """Executes path plans for one expert-parallel group.

    Args:
        topo: the cluster (W must equal the EP size).
        groups: this rank's node and rail groups (``build_rail_groups``).
        num_experts: E (global), divisible by W.
        options: planner options (eligible policy, fan-in, replay windows).
        timeout_s: limit for each rail transfer to complete; a stuck rail raises
            ``ExchangeTimeoutError`` naming the rail and nodes (None: the process group's timeout).
    """

    def __init__(self, topo: RailTopology, groups: RailGroups, *, num_experts: int,
                 options: PlanOptions | None = None, timeout_s: float | None = None) -> None:
        if num_experts % topo.world_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {topo.world_size}")
        self.topo = topo
        self.groups = groups
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // topo.world_size
        self.experts_per_node = self.experts_per_rank * topo.gpus_per_node
        self.options = options or PlanOptions()
        self.timeout_s = timeout_s
        self._num_masks = 1 << topo.gpus_per_node

    # ------------------------------------------------------------------ step 1: counts
    def _status(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple[int, str]:
        e = self.num_experts
        if routing_map.dtype != torch.bool:
            return 1, f"routing_map has dtype {routing_map.dtype}, expected torch.bool"
        if routing_map.dim() != 2 or routing_map.shape[1] != e:
            return 2, f"routing_map has shape {tuple(routing_map.shape)}, expected [T, {e}]"
        if tuple(probs.shape) != tuple(routing_map.shape):
            return 3, f"probs has shape {tuple(probs.shape)}, expected routing_map's {tuple(routing_map.shape)}"
        if hidden.dim() != 2 or hidden.shape[0] != routing_map.shape[0]:
            return 4, f"hidden has shape {tuple(hidden.shape)}, expected [T={routing_map.shape[0]}, H]"
        return 0, ""

    def gather_demand(self, hidden: torch.Tensor, probs: torch.Tensor,
                      routing_map: torch.Tensor) -> tuple[DemandCounts, int]:
        """Exchange the counts this rank needs; returns (demand node view, max tokens over ranks).

        Two fixed-size collectives, posted together, then one host sync:
          * all-gather of [N + 2] per rank: records per destination node, T, input status;
          * all-to-all of [M + E_loc] per rank pair: the mask histogram of the records sent to
            the receiver's node, and the (token, expert) counts of the receiver's experts.
        Per rank that is W * (N + M + E_loc) integers, not W * N * M: it scales to 1000+ GPUs.
        Every rank takes part in both even when its input is malformed (it sends zeros), so a
        bad input raises the same ``InputError`` on every rank after the sync and never hangs.

        Raises:
            InputError: on every rank, when any rank's input is malformed (names the rank).

        Collective: yes (EP group). Host sync: yes (one).
        """
        n, m, e = self.topo.num_nodes, self._num_masks, self.num_experts
        w, g, e_loc = self.topo.world_size, self.topo.gpus_per_node, self.experts_per_rank
        device = routing_map.device
        code, message = self._status(hidden, probs, routing_map)
        totals = torch.zeros(n + 2, dtype=torch.int64, device=device)
        per_peer = torch.zeros(w, m + e_loc, dtype=torch.int64, device=device)
        if code == 0:
            from ..traffic import local_demand
            records_NM, experts_E = local_demand(routing_map, self.topo)
            totals[:n] = records_NM.sum(dim=-1)
            totals[n] = routing_map.shape[0]
            node_of_peer = torch.arange(w, device=device) // g
            per_peer[:, :m] = records_NM[node_of_peer]
            per_peer[:, m:] = experts_E.view(w, e_loc)
        totals[n + 1] = code
        gathered = torch.empty(w * (n + 2), dtype=torch.int64, device=device)
        received = torch.empty_like(per_peer)
        _all_gather(gathered, totals, group=self.groups.ep_group)
        dist.all_to_all_single(received, per_peer, group=self.groups.ep_group)
        gathered = gathered.view(w, n + 2).cpu()  # host sync: the counts
        received = received.cpu()
        bad = torch.nonzero(gathered[:, -1]).squeeze(1).tolist()
        if bad:
            own = f" (this rank: {message})" if code else ""
            raise InputError(
                f"malformed dispatcher input on EP rank(s) {bad}{own}; expected hidden [T, H], "
                f"probs [T, {e}] and a bool routing_map [T, {e}] with top-k True per row"
            )
        demand = DemandCounts(records_WN=gathered[:, :n], view_node=self.groups.node,
                              view_masks_WM=received[:, :m],
                              view_experts_X=received[:, m:].sum(dim=0))
        return demand, int(gathered[:, n].max())

    # ------------------------------------------------------------------ step 2: dispatch
    def _metadata(self, routes: RecordRoutes, routing_map: torch.Tensor) -> torch.Tensor:
        """[n_rec, 3 + words] int64: src rank, token, mask, routing bits of the node's experts."""
        t = routing_map.shape[0]
        node_rows = routing_map.view(t, self.topo.num_nodes, self.experts_per_node)[routes.token_R, routes.node_R]
        words = -(-self.experts_per_node // _ROUTING_BITS_PER_WORD)
        padded = torch.zeros(node_rows.shape[0], words * _ROUTING_BITS_PER_WORD, dtype=torch.int64)
        padded[:, : self.experts_per_node] = node_rows.to(torch.int64).cpu()
        shifts = torch.arange(_ROUTING_BITS_PER_WORD, dtype=torch.int64)
        packed = (padded.view(-1, words, _ROUTING_BITS_PER_WORD) << shifts).sum(-1)
        rank = torch.full_like(routes.token_R, self.groups.ep_rank)
        return torch.cat([torch.stack([rank, routes.token_R, routes.mask_R], 1), packed], 1)

    def _local_hits(self, meta: torch.Tensor) -> torch.Tensor:
        """[n_copy, E_loc] bool: which of this GPU's experts each received copy is routed to."""
        first = self.groups.local * self.experts_per_rank
        bit = torch.arange(first, first + self.experts_per_rank, dtype=torch.int64)
        word = meta[:, 3 + bit // _ROUTING_BITS_PER_WORD]
        return ((word >> (bit % _ROUTING_BITS_PER_WORD)) & 1).bool()

    def plan(self, demand: DemandCounts, path: str, *, phase: int = 0) -> PathPlan:
        """The global plan (pure; identical on every rank)."""
        return build_plan(demand, self.topo, path, options=self.options, phase=phase)

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 demand: DemandCounts, plan: PathPlan, *, demand_max_tokens: int) -> DispatchOutput:
        """Move tokens to the experts along ``plan``.

        Args:
            hidden: [T, H] rank-local tokens (any float dtype; differentiable).
            probs: [T, E] float routing probabilities (differentiable).
            routing_map: [T, E] bool, top-k True per row.
            demand: the gathered counts (``gather_demand`` on the same routing_map).
            plan: ``self.plan(demand, path)``.
            demand_max_tokens: max T over ranks (second value of ``gather_demand``).
        """
        rank = self.groups.ep_rank
        routes = route_records(plan, rank, target_masks(routing_map, self.topo))
        splits = rank_splits(plan, demand, rank)
        owner = owner_layout(plan, splits, routes, self.groups.node, self.groups.local)
        delivery = delivery_layout(plan, demand, routes, owner, splits.num_rounds,
                                   self.groups.node, self.groups.local)
        sizes = [[int(ix.numel()) for ix in rnd] for rnd in delivery.deliver_idx]
        if sizes != splits.deliver_send_VG:
            raise RuntimeError(f"internal: delivery sizes {sizes} differ from plan {splits.deliver_send_VG} "
                               f"on EP rank {rank}")
        hctx = _Context(self, plan, splits, owner, delivery, int(routes.token_R.numel()))

        t = hidden.shape[0]
        payload_R = hidden.index_select(0, routes.token_R.to(hidden.device))
        probs_R = probs.float().view(t, self.topo.num_nodes, self.experts_per_node)[
            routes.token_R, routes.node_R]
        meta_R = self._metadata(routes, routing_map)
        payload_C, probs_C, meta_C = _DispatchFn.apply(payload_R, probs_R, meta_R, hctx)

        # Entries sorted by (local expert, source rank, token): path-independent.
        hits = self._local_hits(meta_C)
        copy_idx, expert_idx = torch.nonzero(hits, as_tuple=True)
        token_stride = max(int(demand_max_tokens), 1)
        key = (expert_idx * self.topo.world_size + meta_C[copy_idx, 0]) * token_stride + meta_C[copy_idx, 1]
        order = torch.sort(key).indices
        copy_idx, expert_idx = copy_idx[order], expert_idx[order]
        tokens = payload_C.index_select(0, copy_idx)
        first = self.groups.local * self.experts_per_rank
        entry_probs = probs_C[copy_idx, first + expert_idx]
        tokens_per_expert = demand.view_experts_X
        if tokens_per_expert is None or tokens_per_expert.numel() != self.experts_per_rank:
            tokens_per_expert = torch.bincount(expert_idx, minlength=self.experts_per_rank).cpu()
        elif expert_idx.device.type == "cpu" and not torch.equal(
                torch.bincount(expert_idx, minlength=self.experts_per_rank), tokens_per_expert):
            raise RuntimeError(f"internal: received entries per expert differ from the gathered "
                               f"counts on EP rank {rank}")
        handle = ExchangeHandle(plan=plan, splits=splits, routes=routes, owner=owner, delivery=delivery,
                                copy_of_entry=copy_idx, num_copies=int(meta_C.shape[0]),
                                num_tokens=t)
        return DispatchOutput(tokens=tokens, tokens_per_expert=tokens_per_expert,
                              probs=entry_probs, handle=handle)

    # ------------------------------------------------------------------ step 3: combine
    def combine(self, expert_out: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """Return expert outputs to their tokens.

        Args:
            expert_out: [n_ent, H], rows in the order of ``DispatchOutput.tokens`` (already
                weighted by probs where the experts apply them).
            handle: from ``dispatch``.

        Returns:
            [T, H], the sum over a token's experts (canonical order, see module docstring).
        """
        hctx = _Context(self, handle.plan, handle.splits, handle.owner, handle.delivery,
                        int(handle.routes.token_R.numel()))
        y_copies = expert_out.new_zeros((handle.num_copies, expert_out.shape[1]))
        # index_add walks entries in (expert, source, token) order: experts ascending per copy.
        y_copies = y_copies.index_add(0, handle.copy_of_entry, expert_out)
        y_records = _CombineFn.apply(y_copies, hctx)
        out = expert_out.new_zeros((handle.num_tokens, expert_out.shape[1]))
        # Records are in (node, mask, token) order: nodes ascending per token.
        return out.index_add(0, handle.routes.token_R.to(out.device), y_records)
