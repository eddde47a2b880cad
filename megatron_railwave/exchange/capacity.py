"""Fixed-capacity mode: a layer that needs no host sync at all (``max_tokens_per_rank``).

Letters: N nodes, G GPUs per node, W = N * G ranks, C = max_tokens_per_rank (the capacity),
T <= C tokens of this rank, E_loc experts of one rank, M = 2**G target masks, S = E_loc * W * C
padded entry rows of one rank.

Like DeepEP's low-latency mode (``num_max_dispatch_tokens_per_rank``), every buffer is sized
from C before any data is seen, so no split size has to come back to the host:

* **capacity plan**: each path is planned for the worst-case demand that does not depend on
  the data: every rank sends C records to every node (its own included), each with the target
  mask "every GPU of the node". The existing planner and ``compile_schedule`` turn it into an
  ``ExecutionSchedule`` once per (topology, path, C, plan options, wire format); every rank's
  view and its index maps (owner order, RailBalance egress, relay and delivery maps) are built
  once per (schedule, rank, device) and cached. Nothing of it depends on the routing.
* **slots**: owner rank g has C slots per destination node, slot (d, i) in canonical order
  d * C + i. Its i-th token (ascending) that routes to an expert of node d fills slot (d, i)
  (a cumsum on the device; i < T <= C since a token makes at most one record per node). The
  other slots are padding: zero payload and probs, source rank -1, no routing bits.
* **moves**: the capacity schedule's phases move the padded slot buffers unchanged (relay,
  rails, delivery of every arrival slot to every GPU of the node).
* **expert side** (``expand_padded``): the received copies give [S] padded entry rows,
  ``[E_loc, W * C]`` flattened: expert e's entries are rows e * W * C + k, k < tokens_per_expert[e]
  (a DEVICE tensor), in (source rank, token) order, the same canonical order as the normal mode,
  so every reduction adds the same numbers in the same order: outputs and gradients equal the
  normal mode's bit for bit. Padding rows are zero and are never read back; in every reduction
  they carry an out-of-range segment id (copy n_copy, token T), which ``ops.segment_sum`` leaves
  out, so no segment walks the padding.

Cost: the experts see S = E_loc * W * C rows per rank whatever the routing, E / K times the
rows a full batch (T = C) really has (16x for E = 128, top-8). ``check_padding`` warns once per
process, with the numbers, where S exceeds ``PADDING_WARN_MULTIPLE`` times the expected rows:
the mode is meant for small calls (decode-sized C), not training-size batches.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from megatron_railwave.exchange.layout import LayerLayout, build_layout
from megatron_railwave.names import Route, parse_route
from megatron_railwave.planner import PathPlan, PlanOptions, build_plan
from megatron_railwave.schedule import (
    ExecutionSchedule,
    RankView,
    RecordWireFormat,
    compile_schedule,
    rank_view,
)
from megatron_railwave.schedule.wire import META_FIXED_WORDS, ROUTING_BITS_PER_WORD
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "CapacityLayer",
    "capacity_demand",
    "capacity_plan",
    "capacity_layer",
    "slot_tokens",
    "expand_padded",
    "PaddedEntries",
    "check_capacity",
    "check_padding",
    "PADDING_WARN_MULTIPLE",
]

_CACHE_SIZE = 512
_SCHEDULES: OrderedDict[tuple, ExecutionSchedule] = OrderedDict()
_LAYERS: OrderedDict[tuple, CapacityLayer] = OrderedDict()


def check_capacity(capacity: int | None) -> int | None:
    """``max_tokens_per_rank`` as given, or ValueError naming the fix (None = normal mode)."""
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(
            f"max_tokens_per_rank={capacity!r} must be a positive integer (the most tokens one "
            f"rank "
            "dispatches per layer), or None for the normal mode"
        )
    return capacity


PADDING_WARN_MULTIPLE = 4
"""``check_padding`` warns where the padded rows per rank exceed this many times the expected
rows."""
_PADDING_WARNED: set[tuple] = set()


def check_padding(
    *,
    capacity: int,
    num_experts: int,
    world_size: int,
    topk: int,
    hidden_size: int,
    element_bytes: int,
) -> str:
    """Warn once per process (and return the text; '' when under the limit) where fixed capacity
    pads the experts' input beyond ``PADDING_WARN_MULTIPLE`` times the rows a full batch has.

    Padded rows per rank: S = E_loc * W * C = E * C; expected rows at T = C tokens: C * K (each
    token goes to K experts, spread over the W ranks' E_loc experts). Host arithmetic only.
    """
    padded, expected = num_experts * capacity, capacity * topk
    if padded <= PADDING_WARN_MULTIPLE * expected:
        return ""
    text = (
        f"max_tokens_per_rank={capacity}: fixed-capacity mode gives every rank's experts {padded} "
        f"rows "
        f"(E_loc * W * C = {num_experts // world_size} * {world_size} * {capacity}) where a full "
        f"batch has "
        f"{expected} (C * top-{topk}): {padded / expected:g}x, over the {PADDING_WARN_MULTIPLE}x "
        f"this mode is "
        f"meant for; {padded * hidden_size * element_bytes / 2**30:.2f} GiB of expert input per "
        f"layer and rank. "
        "Fixed capacity is for small calls (decode-sized C); use the normal mode "
        "(max_tokens_per_rank: null) "
        "for training-size batches"
    )
    key = (capacity, num_experts, world_size, topk, hidden_size, element_bytes)
    if key not in _PADDING_WARNED:
        _PADDING_WARNED.add(key)
        warnings.warn(text, stacklevel=2)
    return text


def capacity_demand(topo: RailTopology, capacity: int, num_experts: int = 0) -> DemandCounts:
    """The worst-case demand: C records from every rank to every node, mask 'every GPU'."""
    w, n, m = topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node
    records_WNM = torch.zeros(w, n, m, dtype=torch.int64)
    records_WNM[:, :, m - 1] = capacity
    experts_WE = torch.full((w, num_experts), capacity, dtype=torch.int64) if num_experts else None
    return DemandCounts(records_WNM=records_WNM, experts_WE=experts_WE)


def _options_key(options: PlanOptions) -> tuple:
    """Every field of the options, hashable (a tensor as nested tuples): a field added to
    ``PlanOptions`` keys the caches without being listed here."""
    return tuple(
        (
            f.name,
            tuple(map(tuple, v.tolist()))
            if isinstance(v := getattr(options, f.name), torch.Tensor)
            else v,
        )
        for f in dataclasses.fields(options)
    )


def _lru_get(cache: OrderedDict, key: tuple, make):
    value = cache.get(key)
    if value is None:
        # Outside inference mode: a first call under torch.inference_mode() (an eval before
        # training) would otherwise cache inference tensors, which training cannot save for
        # backward.
        with torch.inference_mode(False):
            value = make()
        cache[key] = value
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


def capacity_plan(
    topo: RailTopology, path: Route | str, capacity: int, options: PlanOptions
) -> PathPlan:
    """The path's plan for the capacity demand (remainder rotation phase 0: the plan is fixed)."""
    return build_plan(
        capacity_demand(topo, capacity), topo, parse_route(path), options=options, phase=0
    )


def _schedule(
    topo: RailTopology, path: Route, capacity: int, options: PlanOptions, wire: RecordWireFormat
) -> ExecutionSchedule:
    key = (topo, path, capacity, _options_key(options), wire)
    return _lru_get(
        _SCHEDULES,
        key,
        lambda: compile_schedule(
            capacity_plan(topo, path, capacity, options),
            wire,
            demand=capacity_demand(topo, capacity),
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CapacityLayer:
    """One rank's cached part of the capacity plan (nothing here depends on the routing).

    Attributes:
        schedule: the capacity plan's schedule (shared by every rank).
        view: this rank's view of it.
        layout: its index maps; ``token_R`` is a placeholder that each layer replaces by its
            slot tokens (``slot_tokens``).
        capacity: C.
    """

    schedule: ExecutionSchedule
    view: RankView
    layout: LayerLayout
    capacity: int


def capacity_layer(
    topo: RailTopology,
    path: Route | str,
    capacity: int,
    options: PlanOptions,
    wire: RecordWireFormat,
    rank: int,
    device: torch.device,
) -> CapacityLayer:
    """The cached schedule, rank view and index maps of the capacity plan (built on first use:
    host planning and one host-to-device copy of small counts; later calls cost a dict lookup)."""
    path = parse_route(path)
    device = torch.device(device)
    key = (topo, path, capacity, _options_key(options), wire, rank, device)

    def make() -> CapacityLayer:
        schedule = _schedule(topo, path, capacity, options, wire)
        view = rank_view(schedule, rank)
        n = topo.num_nodes
        node_R = torch.arange(n, dtype=torch.int64, device=device).repeat_interleave(capacity)
        layout = build_layout(
            schedule.plan,
            view,
            token_R=torch.zeros_like(node_R),
            node_R=node_R,
        )
        return CapacityLayer(schedule=schedule, view=view, layout=layout, capacity=capacity)

    return _lru_get(_LAYERS, key, make)


def slot_tokens(routing_map: torch.Tensor, num_nodes: int, capacity: int) -> torch.Tensor:
    """[N * C] int64: the token in each slot (d, i) of this rank, T for padding. Device; no sync.

    Slot (d, i) holds the i-th token (ascending) routed to an expert of node d.
    """
    t, e = routing_map.shape
    device = routing_map.device
    hit_TN = routing_map.view(t, num_nodes, e // num_nodes).any(dim=2)
    slot_TN = torch.cumsum(hit_TN.to(torch.int64), dim=0) - 1
    node_N = torch.arange(num_nodes, dtype=torch.int64, device=device)
    trash = num_nodes * capacity
    dest = torch.where(hit_TN, node_N * capacity + slot_TN, trash).reshape(-1)
    token = (
        torch.arange(t, dtype=torch.int64, device=device)
        .unsqueeze(1)
        .expand(t, num_nodes)
        .reshape(-1)
    )
    out = torch.full((trash + 1,), t, dtype=torch.int64, device=device)
    return out.scatter_(0, dest, token)[:trash]


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedEntries:
    """The received entries in the padded layout [E_loc, W * C] (flattened to [S]).

    Attributes:
        copy_of_slot: [S] int64, received copy of each entry row; n_copy for padding rows.
        valid: [S] bool, the rows that hold an entry (k < tokens_per_expert[e]).
        expert_of_slot: [S] int64, local expert of each row (e = row // (W * C)).
        tokens_per_expert: [E_loc] int64 DEVICE tensor, entries per local expert.
        num_copies: n_copy (host).
    """

    copy_of_slot: torch.Tensor
    valid: torch.Tensor
    expert_of_slot: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_copies: int

    # The normal mode's EntryIndex names, so that code shared by both modes reads either.
    @property
    def copy_of_entry(self) -> torch.Tensor:
        return self.copy_of_slot

    @property
    def expert_of_entry(self) -> torch.Tensor:
        return self.expert_of_slot


def expand_padded(
    meta_C: torch.Tensor, *, local: int, experts_per_rank: int, world_size: int, capacity: int
) -> PaddedEntries:
    """Entries of the received copies in the padded layout, canonical order. Device; no sync.

    Every (copy, local expert) pair whose routing bit is set is an entry, keyed (expert,
    source rank, token) as in the normal mode; one fixed-size sort orders them, and an entry's
    row is e * W * C + (its position among expert e's entries).
    """
    e_loc, w = experts_per_rank, world_size
    device = meta_C.device
    n_copy = meta_C.shape[0]
    slots = w * capacity
    total = e_loc * slots
    experts = torch.arange(e_loc, dtype=torch.int64, device=device)
    bit = local * e_loc + experts
    word = meta_C.index_select(1, META_FIXED_WORDS + bit // ROUTING_BITS_PER_WORD).to(torch.int64)
    hits = ((word >> (bit % ROUTING_BITS_PER_WORD)) & 1).bool()  # [n_copy, E_loc]; padding: no bits
    src = meta_C[:, 0].to(torch.int64).unsqueeze(1)
    token = meta_C[:, 1].to(torch.int64).unsqueeze(1)
    key = torch.where(hits, (experts * w + src) * capacity + token, total).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    tokens_per_expert = hits.sum(dim=0, dtype=torch.int64)
    start = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
    copy, expert = order // e_loc, order % e_loc
    position = torch.arange(order.numel(), dtype=torch.int64, device=device) - start.index_select(
        0, expert
    )
    dest = torch.where(sorted_key < total, expert * slots + position, total)
    copy_of_slot = torch.full((total + 1,), n_copy, dtype=torch.int64, device=device).scatter_(
        0, dest, copy
    )[:total]
    expert_of_slot = torch.arange(total, dtype=torch.int64, device=device) // slots
    return PaddedEntries(
        copy_of_slot=copy_of_slot,
        valid=copy_of_slot < n_copy,
        expert_of_slot=expert_of_slot,
        tokens_per_expert=tokens_per_expert,
        num_copies=n_copy,
    )
