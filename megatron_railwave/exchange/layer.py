"""One rank's part of one MoE layer: count exchange, preparation, and the four data programs.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens of this rank, E experts,
E_node = E / N, E_loc = E / W, H hidden, M = 2**G masks, n_rec records of this rank, n_copy
copies it receives, n_ent (token, local expert) entries it receives.

Lifecycle (the same programs run over torch.distributed and in the virtual cluster):
  1. ``gather_demand`` (program): one all-to-all of W x (N + 2 + M + E_loc) int64 on the EP
     group carries every rank's records per node, token count and input status, plus the
     mask histogram and expert counts each receiver needs (the online selector's timing word
     rides in the status word, ``pack_status``; and, on request, E more for the
     expert loads and W more for every rank's copies per destination GPU, the min-max plans'
     input); then ONE device-to-host copy of what arrived. This is the
     layer's only host sync. Bad input anywhere raises the same ``InputError`` on every rank
     right here, before any data moves.
  2. ``prepare_layer`` (plain function, host + asynchronous device work): the plan is passed
     in (pure, same on every rank), compiled into the ``ExecutionSchedule``; the rank view and
     the device index maps follow from it and from this rank's records.
  3. ``dispatch_forward`` / ``combine_forward`` and their backwards (programs).

Fixed-capacity mode (``max_tokens_per_rank`` = C; ``exchange.capacity``): steps 1 and 2 are
replaced by ``prepare_capacity_layer`` (no communication, no host sync: the capacity plan's
schedule and index maps are cached, the slots are filled on the device) and the received
entries come in the padded layout [E_loc, W * C] with a device ``tokens_per_expert``. The same
four programs run; where the modes differ they branch on ``LayerHandle.capacity``.

Reductions happen in a fixed order that does not depend on the path: local experts
ascending per copy, the destination node's GPUs in local order per record, destination
nodes in order per token (``ops.segment_sum``). All four paths give bitwise-identical outputs
and gradients on any device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_railwave import ops
from megatron_railwave.exchange.capacity import (
    PaddedEntries,
    capacity_layer,
    expand_padded,
    slot_tokens,
)
from megatron_railwave.exchange.groups import RankGroups
from megatron_railwave.exchange.layout import LayerLayout, build_layout, select_positions
from megatron_railwave.exchange.moves import (
    as_row_bytes,
    backward_moves,
    forward_moves,
    part_view,
    unpack_views,
)
from megatron_railwave.exchange.transport import Collective, Program
from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, PlanOptions
from megatron_railwave.schedule import (
    ExecutionSchedule,
    RankView,
    RecordWireFormat,
    compile_for_rank,
)
from megatron_railwave.schedule.wire import META_FIXED_WORDS, ROUTING_BITS_PER_WORD
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, mask_bits

__all__ = [
    "InputError",
    "CapacityOverflowError",
    "RankContext",
    "LayerDemand",
    "LayerHandle",
    "EntryIndex",
    "gather_demand",
    "prepare_layer",
    "dispatch_forward",
    "dispatch_backward",
    "combine_forward",
    "combine_backward",
    "input_status",
    "prepare_capacity_layer",
    "capacity_failure",
    "pack_status",
    "TimingWords",
    "count_row_words",
    "TIMING_WORD_MIN",
    "TIMING_WORD_MAX",
]


class InputError(ValueError):
    """Bad dispatcher input, raised identically on every rank (normal mode; in fixed-capacity
    mode on the rank whose input it is, before any communication)."""


class CapacityOverflowError(InputError):
    """Fixed-capacity mode: a rank has more tokens than ``max_tokens_per_rank``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankContext:
    """What one rank's programs need besides the layer's data."""

    topo: RailTopology
    groups: RankGroups
    num_experts: int
    options: PlanOptions

    def __post_init__(self) -> None:
        if self.num_experts % self.topo.world_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the EP size "
                f"{self.topo.world_size}; experts are placed contiguously, E / W per rank"
            )

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.topo.world_size

    @property
    def experts_per_node(self) -> int:
        return self.experts_per_rank * self.topo.gpus_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerDemand:
    """The gathered counts of one layer (host) and this rank's records (device).

    Attributes:
        demand: node view (``DemandCounts``): records_WN, this node's masks, own experts' counts.
        max_tokens: max T over ranks.
        num_tokens: T of this rank.
        token_C, node_C, mask_C: [T * N] int64 (device) this rank's records in canonical order;
            the first ``num_records`` are valid.
        num_records: n_rec of this rank (host).
        expert_load_E: [E] int64 (host), global tokens per expert (railwave column order), when
            ``gather_demand`` was asked for it; else None.
        timing_W: every rank's ``timing_word`` (railwave rank order; ``TimingWords``), when
            ``gather_demand`` carried one; else None.
    """

    demand: DemandCounts
    max_tokens: int
    num_tokens: int
    token_C: torch.Tensor
    node_C: torch.Tensor
    mask_C: torch.Tensor
    num_records: int
    expert_load_E: torch.Tensor | None = None
    timing_W: TimingWords | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryIndex:
    """Received entries, sorted by (local expert, source rank, token): the same on every path.

    Attributes:
        copy_of_entry: [n_ent] int64, received copy of each entry.
        expert_of_entry: [n_ent] int64, local expert of each entry.
    """

    copy_of_entry: torch.Tensor
    expert_of_entry: torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerHandle:
    """Everything one rank needs between dispatch and combine (and their backwards).

    Attributes:
        schedule: the compiled schedule; view: this rank's view; layout: device index maps.
        tokens_per_expert: [E_loc] int64 on the host (from the gathered counts); None in
            fixed-capacity mode (there it is a device tensor of the dispatch's entries).
        num_entries: entry rows dispatch returns (fixed capacity: the padded E_loc * W * C).
        num_tokens, max_tokens: host ints (fixed capacity: max_tokens = C).
        capacity: C in fixed-capacity mode, else None.
    """

    schedule: ExecutionSchedule
    view: RankView
    layout: LayerLayout
    tokens_per_expert: torch.Tensor | None
    num_entries: int
    num_tokens: int
    max_tokens: int
    capacity: int | None = None

    @property
    def plan(self) -> PathPlan:
        return self.schedule.plan

    @property
    def wire(self) -> RecordWireFormat:
        return self.schedule.wire

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of one dispatched record row (what the statistics count per record)."""
        return self.schedule.wire.dispatch_bytes


def input_status(
    ctx: RankContext, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
) -> tuple[int, str]:
    """(code, message) of this rank's input; 0 = well formed. Host only (shapes and dtypes)."""
    e = ctx.num_experts
    if routing_map.dtype != torch.bool:
        return 1, f"routing_map has dtype {routing_map.dtype}, expected torch.bool"
    if routing_map.dim() != 2 or routing_map.shape[1] != e:
        return 2, f"routing_map has shape {tuple(routing_map.shape)}, expected [T, {e}]"
    if tuple(probs.shape) != tuple(routing_map.shape):
        return (
            3,
            f"probs has shape {tuple(probs.shape)}, expected routing_map's "
            f"{tuple(routing_map.shape)}",
        )
    if hidden.dim() != 2 or hidden.shape[0] != routing_map.shape[0]:
        return 4, f"hidden has shape {tuple(hidden.shape)}, expected [T={routing_map.shape[0]}, H]"
    if not hidden.is_floating_point() or not probs.is_floating_point():
        return 5, f"hidden ({hidden.dtype}) and probs ({probs.dtype}) must be floating point"
    if hidden.device != routing_map.device or probs.device != routing_map.device:
        return 6, (
            f"hidden ({hidden.device}), probs ({probs.device}) and routing_map "
            f"({routing_map.device}) must be on one device"
        )
    return 0, ""


_CODE_SHIFT = 56
"""The input status code sits above bit 56 of the status word; the timing word below it, so one
``max`` over the W status words tells whether any rank's input is bad, and ``min`` / ``max`` give
the lowest and highest timing word without a pass in Python."""
_TIMING_OFFSET = 1 << 8
TIMING_WORD_MIN = 1 - _TIMING_OFFSET
"""Lowest timing word the status word carries (the selector's codes are -1 .. -4)."""
TIMING_WORD_MAX = (1 << 54) - 1
"""Highest: 2**54 ns is 208 days; word + 2**8 stays below the code bits."""


def pack_status(code: int, timing_word: int | None) -> int:
    """The status word of every row of a rank's count message: the input status ``code`` (0 = well
    formed, 1-6 = ``input_status``'s problems) above bit 56 and, below it, the online selector's
    timing word plus 2**8 (0 there: no timing word).

    Raises:
        ValueError: a timing word outside [``TIMING_WORD_MIN``, ``TIMING_WORD_MAX``] (this rank
        only,
            before the count exchange: a caller's bug, not an input problem).
    """
    if not 0 <= code < 1 << (63 - _CODE_SHIFT):
        raise ValueError(f"internal: input status code {code} does not fit {63 - _CODE_SHIFT} bits")
    if timing_word is None:
        return code << _CODE_SHIFT
    if not TIMING_WORD_MIN <= timing_word <= TIMING_WORD_MAX:
        raise ValueError(
            f"timing_word={timing_word} is outside [{TIMING_WORD_MIN}, {TIMING_WORD_MAX}]; pass "
            "selector.online.encode_timing's word (nanoseconds, or a code)"
        )
    return (code << _CODE_SHIFT) | (int(timing_word) + _TIMING_OFFSET)


class TimingWords(Sequence[int]):
    """Every rank's timing word from the status words ``pack_status`` made, where every input was
    well formed (``gather_demand`` raised otherwise): a sequence of W ints, read one by one only
    when needed; ``lowest`` and ``highest`` come from one ``min`` / ``max`` of the status words.
    (A plain class: a frozen dataclass's constructor costs a microsecond on every layer call.)"""

    __slots__ = ("status_W", "lowest", "highest")

    def __init__(self, status_W: list[int], highest_status: int) -> None:
        """From the received status words and their ``max`` (which ``gather_demand`` has
        already)."""
        self.status_W = status_W
        self.lowest = min(status_W) - _TIMING_OFFSET
        self.highest = highest_status - _TIMING_OFFSET

    def __len__(self) -> int:
        return len(self.status_W)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [word - _TIMING_OFFSET for word in self.status_W[index]]
        return self.status_W[index] - _TIMING_OFFSET


def count_row_words(
    topo: RailTopology,
    num_experts: int,
    *,
    expert_loads: bool = False,
    delivery_counts: bool = False,
    timing: bool = False,
) -> int:
    """int64 words of one row (one peer's part) of ``gather_demand``'s count message: N records per
    node, the token count, the status word, M mask counts, E_loc expert counts, and E expert loads
    and W delivery counts on request. ``timing`` adds nothing (the status word carries it);
    it is an argument so that the bytes it adds are computed here, where the message is laid out."""
    n, g, w = topo.num_nodes, topo.gpus_per_node, topo.world_size
    words = n + 2 + (1 << g) + num_experts // w
    words += num_experts if expert_loads else 0
    words += w if delivery_counts else 0
    return words


def gather_demand(
    ctx: RankContext,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    expert_loads: bool = False,
    delivery_counts: bool = False,
    timing_word: int | None = None,
) -> Program:
    """Program: the count exchange (see module docstring). Returns a ``LayerDemand``.

    Args:
        expert_loads: also carry every rank's full [E] expert histogram (E more int64 per row,
            in the same all-to-all and the same host copy), for the layer's expert-load statistics.
            Must be the same on every rank.
        delivery_counts: also carry every rank's (record, target GPU) copies per destination GPU
            (W more int64 per row; same all-to-all and host copy) into
            ``DemandCounts.delivery_WNG``, for the min-max plans (FLOW / FLOW_WAVES). Must be the
            same on every rank.
        timing_word: this rank's measured time of the layer's previous call for the online
            selector (``selector.online.encode_timing``: nanoseconds, or a code in
            [-255, 0]), the same to every peer; every rank gets all of them in ``timing_W``. It
            shares the input-status word of every row (``pack_status``), so the message is no
            longer for it: 0 extra bytes. Given (or None) on every rank alike.

    Collective: yes (EP group, one all-to-all). Host sync: yes (one, the counts).

    Raises:
        InputError: on every rank, when any rank's input is malformed (names the ranks).
    """
    topo = ctx.topo
    n, g, w = topo.num_nodes, topo.gpus_per_node, topo.world_size
    m, e_loc = 1 << g, ctx.experts_per_rank
    device = routing_map.device
    code, message = input_status(ctx, hidden, probs, routing_map)
    width = n + 2 + m + e_loc
    loads_end = width + (ctx.num_experts if expert_loads else 0)
    delivery_end = count_row_words(
        topo,
        ctx.num_experts,
        expert_loads=expert_loads,
        delivery_counts=delivery_counts,
        timing=timing_word is not None,
    )
    status_word = pack_status(
        code, timing_word
    )  # before any collective: a bad word raises on this rank
    send = torch.zeros(w, delivery_end, dtype=torch.int64, device=device)
    t = int(routing_map.shape[0]) if routing_map.dim() >= 1 else 0
    if code == 0:
        token_C, node_C, mask_C, counts_NM = ops.records_from_routing(routing_map, n, g)
        send[:, :n] = counts_NM.sum(dim=1)
        send[:, n] = t
        node_of_peer = torch.arange(w, device=device) // g
        send[:, n + 2 : n + 2 + m] = counts_NM[node_of_peer]
        per_expert = routing_map.sum(dim=0, dtype=torch.int64)
        send[:, n + 2 + m : width] = per_expert.view(w, e_loc)
        if expert_loads:
            send[:, width:loads_end] = per_expert
        if delivery_counts:  # copies per destination GPU: a record counts once per target bit.
            # Elementwise product and sum, not a matmul: CUDA has no int64 matmul.
            bits_MG = mask_bits(g).to(device).view(1, m, g)
            send[:, loads_end:delivery_end] = (
                (counts_NM.view(n, m, 1) * bits_MG).sum(dim=1).reshape(1, w)
            )
    else:
        token_C = node_C = mask_C = torch.zeros(0, dtype=torch.int64, device=device)
    send[:, n + 1] = status_word
    recv = torch.empty_like(send)
    yield Collective(
        kind="all_to_all",
        stage="count exchange",
        group=ctx.groups.ep,
        send=send,
        recv=recv,
        host_read=True,
    )
    counts = recv.cpu()  # the layer's one host sync: every split size follows from these counts
    status_W = counts[
        :, n + 1
    ].tolist()  # W ints: one max finds a bad input (the code bits are on top)
    highest_status = max(status_W)
    bad = (
        [i for i, word in enumerate(status_W) if word >> _CODE_SHIFT]
        if highest_status >> _CODE_SHIFT
        else []
    )
    if bad:
        own = f" (this rank: {message})" if code else ""
        raise InputError(
            f"malformed dispatcher input on EP rank(s) {ctx.groups.ep_ranks(bad)}{own}; expected "
            f"hidden [T, H] and probs [T, "
            f"{ctx.num_experts}] (floating point) and a bool routing_map [T, {ctx.num_experts}] "
            f"with top-k "
            "True per row, all on one device"
        )
    demand = DemandCounts(
        records_WN=counts[:, :n],
        view_node=ctx.groups.node_index,
        view_masks_WM=counts[:, n + 2 : n + 2 + m],
        view_experts_X=counts[:, n + 2 + m : width].sum(dim=0),
        delivery_WNG=counts[:, loads_end:delivery_end].reshape(w, n, g)
        if delivery_counts
        else None,
    )
    return LayerDemand(
        demand=demand,
        max_tokens=int(counts[:, n].max()),
        num_tokens=t,
        token_C=token_C,
        node_C=node_C,
        mask_C=mask_C,
        num_records=int(counts[ctx.groups.railwave_rank, :n].sum()),
        expert_load_E=counts[:, width:loads_end].sum(dim=0) if expert_loads else None,
        timing_W=TimingWords(status_W, highest_status) if timing_word is not None else None,
    )


def prepare_layer(
    ctx: RankContext,
    layer: LayerDemand,
    plan: PathPlan,
    *,
    hidden_dtype: torch.dtype,
    probs_dtype: torch.dtype,
    hidden_size: int,
) -> LayerHandle:
    """Compile the schedule and build this rank's index maps. No communication, no host sync."""
    wire = RecordWireFormat(
        hidden=hidden_size,
        payload_dtype=hidden_dtype,
        probs_dtype=probs_dtype,
        experts_per_node=ctx.experts_per_node,
    )
    compiled = compile_for_rank(
        plan, wire, demand=layer.demand, node=ctx.groups.node_index, rank=ctx.groups.railwave_rank
    )
    schedule, view = compiled.schedule, compiled.view
    if view.num_records != layer.num_records:
        raise RuntimeError(
            f"internal: railwave rank {ctx.groups.railwave_rank}: the plan counts "
            f"{view.num_records} "
            f"records of this rank, its routing has {layer.num_records}"
        )
    n_rec = layer.num_records
    layout = build_layout(
        plan,
        view,
        token_R=layer.token_C[:n_rec],
        node_R=layer.node_C[:n_rec],
        counts=compiled.layout_counts,
    )
    tokens_per_expert = layer.demand.view_experts_X
    return LayerHandle(
        schedule=schedule,
        view=view,
        layout=layout,
        tokens_per_expert=tokens_per_expert,
        num_entries=int(tokens_per_expert.sum()),
        num_tokens=layer.num_tokens,
        max_tokens=layer.max_tokens,
    )


def capacity_failure(
    ctx: RankContext,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
) -> InputError | None:
    """Fixed-capacity mode: the error of this rank's input (malformed, or T > ``capacity``), or
    None. Host only (shapes and dtypes); raises nothing."""
    code, message = input_status(ctx, hidden, probs, routing_map)
    ep_rank = ctx.groups.ep_rank
    if code:
        return InputError(
            f"malformed dispatcher input on EP rank {ep_rank}: {message}; expected hidden [T, H] "
            f"and "
            f"probs [T, {ctx.num_experts}] (floating point) and a bool routing_map [T, "
            f"{ctx.num_experts}] "
            "with top-k True per row, all on one device"
        )
    t = int(routing_map.shape[0])
    if t > capacity:
        return CapacityOverflowError(
            f"EP rank {ep_rank}: {t} tokens in this layer call exceed "
            f"max_tokens_per_rank={capacity} (the fixed "
            f"capacity every buffer is sized for); raise max_tokens_per_rank to at least {t} "
            f"(micro-batch size x "
            "sequence length / tensor-parallel size for Megatron), or set it to None for the "
            "normal mode"
        )
    return None


def prepare_capacity_layer(
    ctx: RankContext,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    path: Route | str,
    capacity: int,
) -> LayerHandle:
    """Fixed-capacity mode: this rank's handle for one layer, with no communication and no host
    sync (``exchange.capacity``). Replaces ``gather_demand`` + ``prepare_layer``.

    The checks are host-local (``capacity_failure``: shapes, dtypes, T <= C) and raise on this
    rank only; ``Exchange.prepare_capacity`` runs them first and exchanges a status word, so
    that every rank raises them (``exchange.status``; docs/exchange.md, "Fixed-capacity mode").

    Raises:
        InputError: malformed input on this rank.
        CapacityOverflowError: T > ``capacity``.
    """
    failure = capacity_failure(ctx, hidden, probs, routing_map, capacity)
    if failure is not None:
        raise failure
    t = int(routing_map.shape[0])
    wire = RecordWireFormat(
        hidden=int(hidden.shape[-1]),
        payload_dtype=hidden.dtype,
        probs_dtype=probs.dtype,
        experts_per_node=ctx.experts_per_node,
    )
    fixed = capacity_layer(
        ctx.topo, path, capacity, ctx.options, wire, ctx.groups.railwave_rank, routing_map.device
    )
    layout = dataclasses.replace(
        fixed.layout, token_R=slot_tokens(routing_map, ctx.topo.num_nodes, capacity)
    )
    return LayerHandle(
        schedule=fixed.schedule,
        view=fixed.view,
        layout=layout,
        tokens_per_expert=None,
        num_entries=ctx.experts_per_rank * ctx.topo.world_size * capacity,
        num_tokens=t,
        max_tokens=capacity,
        capacity=capacity,
    )


def _trash(handle: LayerHandle) -> int:
    """Extra segment / row that padding goes to in fixed-capacity mode (dropped); 0 otherwise."""
    return 0 if handle.capacity is None else 1


def _entry_rows(rows_C: torch.Tensor, entries: EntryIndex | PaddedEntries) -> torch.Tensor:
    """Each entry's row of the per-copy ``rows_C``; padding rows (fixed capacity) are zero."""
    if isinstance(entries, PaddedEntries):
        picked = rows_C.index_select(0, entries.copy_of_slot.clamp(max=max(rows_C.shape[0] - 1, 0)))
        valid = entries.valid.view((-1,) + (1,) * (picked.dim() - 1))
        return picked.masked_fill_(~valid, 0)
    return rows_C.index_select(0, entries.copy_of_entry)


def _routing_words(
    routing_map: torch.Tensor, rows: torch.Tensor, ctx: RankContext, words: int
) -> torch.Tensor:
    """[n, words] int32: the routing bits of each (token, node) row, 32 per word."""
    e_node = ctx.experts_per_node
    bits = routing_map.reshape(-1, e_node).index_select(0, rows).to(torch.int64)
    bits = torch.nn.functional.pad(bits, (0, words * ROUTING_BITS_PER_WORD - e_node))
    shifts = torch.arange(ROUTING_BITS_PER_WORD, dtype=torch.int64, device=bits.device)
    packed = (bits.view(-1, words, ROUTING_BITS_PER_WORD) << shifts).sum(dim=-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _expand(meta_C: torch.Tensor, ctx: RankContext, handle: LayerHandle) -> EntryIndex:
    """Entries (copy, local expert) of the received copies, in canonical order. No host sync."""
    e_loc, w = ctx.experts_per_rank, ctx.topo.world_size
    bit = ctx.groups.local * e_loc + torch.arange(e_loc, dtype=torch.int64, device=meta_C.device)
    word = meta_C.index_select(1, META_FIXED_WORDS + bit // ROUTING_BITS_PER_WORD).to(torch.int64)
    hits = ((word >> (bit % ROUTING_BITS_PER_WORD)) & 1).bool()  # [n_copy, E_loc]
    flat = select_positions(hits.reshape(-1), handle.num_entries)
    copy_idx, expert_idx = flat // e_loc, flat % e_loc
    src = meta_C[:, 0].to(torch.int64).index_select(0, copy_idx)
    token = meta_C[:, 1].to(torch.int64).index_select(0, copy_idx)
    key = (expert_idx * w + src) * max(handle.max_tokens, 1) + token
    order = torch.sort(key).indices
    return EntryIndex(
        copy_of_entry=copy_idx.index_select(0, order),
        expert_of_entry=expert_idx.index_select(0, order),
    )


def _probs_column(ctx: RankContext, entries: EntryIndex | PaddedEntries) -> torch.Tensor:
    """[n_ent] column of each entry's expert in a node's probs row."""
    return ctx.groups.local * ctx.experts_per_rank + entries.expert_of_entry


def dispatch_forward(
    ctx: RankContext,
    handle: LayerHandle,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
) -> Program:
    """Program: tokens to the experts. Returns (tokens [n_ent, H], probs [n_ent], ``EntryIndex``).

    Fixed capacity: tokens [E_loc * W * C, H] and probs [E_loc * W * C] in the padded layout
    (padding rows zero) and ``PaddedEntries`` (its ``tokens_per_expert`` is a device tensor).
    """
    layout, wire, n = handle.layout, handle.wire, ctx.topo.num_nodes
    e_node = ctx.experts_per_node
    order = layout.owner_order
    token_o = layout.token_R.index_select(0, order)
    row_o = token_o * n + layout.node_R.index_select(0, order)  # (token, node) row of probs/routing
    source_o = torch.full_like(token_o, ctx.groups.railwave_rank)
    probs_rows = probs.reshape(-1, e_node)
    if handle.capacity is not None:
        # Padding slots (token T) read an appended zero row and carry source rank -1, no routing
        # bits.
        t = handle.num_tokens
        valid_o = token_o < t
        row_o = torch.where(valid_o, row_o, t * n)
        source_o = torch.where(valid_o, source_o, -1)
        hidden = torch.cat([hidden, hidden.new_zeros((1, hidden.shape[1]))])
        probs_rows = torch.cat([probs_rows, probs_rows.new_zeros((1, e_node))])
        routing_map = torch.cat(
            [routing_map.reshape(-1, e_node), routing_map.new_zeros((1, e_node))]
        )
    meta = torch.cat([source_o.unsqueeze(1), token_o.unsqueeze(1)], dim=1)
    meta = torch.cat(
        [
            meta.to(torch.int32),
            _routing_words(routing_map, row_o, ctx, wire.meta_words - META_FIXED_WORDS),
        ],
        dim=1,
    )
    rows = ops.pack_rows([hidden, probs_rows, meta], [token_o, row_o, None])
    copies = yield from forward_moves(
        rows, layout=layout, view=handle.view, schedule=handle.schedule, groups=ctx.groups
    )
    specs = wire.dispatch_specs()
    _, probs_C, meta_C = ops.unpack_rows(
        copies[:, wire.payload_bytes :], [(torch.uint8, (0,))] + specs[1:]
    )
    if handle.capacity is None:
        entries: EntryIndex | PaddedEntries = _expand(meta_C, ctx, handle)
    else:
        entries = expand_padded(
            meta_C,
            local=ctx.groups.local,
            experts_per_rank=ctx.experts_per_rank,
            world_size=ctx.topo.world_size,
            capacity=handle.capacity,
        )
    payload_C = part_view(copies, specs, 0)  # rows gathered straight from the packed copies
    if payload_C is None:
        payload_C = ops.unpack_rows(copies, specs)[0]
    tokens = _entry_rows(payload_C, entries)
    if isinstance(entries, PaddedEntries):
        copy = entries.copy_of_slot.clamp(max=max(entries.num_copies - 1, 0))
        entry_probs = probs_C[copy, _probs_column(ctx, entries)].masked_fill_(~entries.valid, 0)
    else:
        entry_probs = probs_C[entries.copy_of_entry, _probs_column(ctx, entries)]
    return tokens, entry_probs, entries


def dispatch_backward(
    ctx: RankContext,
    handle: LayerHandle,
    entries: EntryIndex,
    g_tokens: torch.Tensor,
    g_probs: torch.Tensor,
) -> Program:
    """Program: gradients of dispatch. Returns (g_hidden [T, H], g_probs [T, E])."""
    layout, wire, n = handle.layout, handle.wire, ctx.topo.num_nodes
    n_copy, trash = (
        layout.num_copies,
        _trash(handle),
    )  # fixed capacity: padding probs go to a dropped row
    # Fixed capacity: padding entries carry copy n_copy, out of range, so segment_sum leaves them
    # out.
    g_payload_C = ops.segment_sum(
        g_tokens,
        entries.copy_of_entry,
        n_copy,
        out_dtype=wire.payload_dtype,
        max_segment_len=ctx.experts_per_rank,
    )
    g_probs_C = torch.zeros(
        (n_copy + trash, ctx.experts_per_node), dtype=wire.probs_dtype, device=g_tokens.device
    )
    g_probs_C.index_put_(
        (entries.copy_of_entry, _probs_column(ctx, entries)), g_probs.to(wire.probs_dtype)
    )
    rows = ops.pack_rows([g_payload_C, g_probs_C[:n_copy]], [None, None])
    back = yield from backward_moves(
        rows,
        wire.dispatch_grad_specs(),
        layout=layout,
        view=handle.view,
        schedule=handle.schedule,
        groups=ctx.groups,
    )
    n_rec = handle.view.num_records
    g_payload_R, g_probs_R = ops.unpack_rows(
        back, wire.dispatch_grad_specs(), row_index=layout.owner_order, num_rows=n_rec
    )
    t = handle.num_tokens
    g_hidden = ops.segment_sum(
        g_payload_R, layout.token_R, t, out_dtype=wire.payload_dtype, max_segment_len=n
    )  # padding slots (token T) are out of range: left out
    g_probs_full = torch.zeros(
        ((t + trash) * n, ctx.experts_per_node), dtype=wire.probs_dtype, device=g_tokens.device
    )
    g_probs_full.index_copy_(0, layout.token_R * n + layout.node_R, g_probs_R)
    return g_hidden, g_probs_full[: t * n].view(t, ctx.num_experts)


def combine_forward(
    ctx: RankContext, handle: LayerHandle, entries: EntryIndex, expert_out: torch.Tensor
) -> Program:
    """Program: expert outputs [n_ent, H] back to this rank's tokens. Returns [T, H]."""
    layout, wire = handle.layout, handle.wire
    if expert_out.dtype != wire.payload_dtype:
        raise ValueError(
            f"combine: expert output dtype {expert_out.dtype} differs from the dispatched hidden "
            f"dtype {wire.payload_dtype}"
        )
    if expert_out.shape[0] != handle.num_entries:
        raise ValueError(
            f"combine: expert output has {expert_out.shape[0]} rows, dispatch returned "
            f"{handle.num_entries}"
        )
    n_copy, t = layout.num_copies, handle.num_tokens
    # Padding (fixed capacity: copy n_copy, token T) is out of range: segment_sum leaves it out.
    y_C = ops.segment_sum(
        expert_out, entries.copy_of_entry, n_copy, max_segment_len=ctx.experts_per_rank
    )
    back = yield from backward_moves(
        as_row_bytes(y_C),
        wire.combine_specs(),
        layout=layout,
        view=handle.view,
        schedule=handle.schedule,
        groups=ctx.groups,
    )
    (y_R,) = ops.unpack_rows(
        back, wire.combine_specs(), row_index=layout.owner_order, num_rows=handle.view.num_records
    )
    return ops.segment_sum(y_R, layout.token_R, t, max_segment_len=ctx.topo.num_nodes)


def combine_backward(
    ctx: RankContext, handle: LayerHandle, entries: EntryIndex, g_out: torch.Tensor
) -> Program:
    """Program: gradient of combine. Returns g_expert_out [n_ent, H]."""
    layout, wire = handle.layout, handle.wire
    token_o = layout.token_R.index_select(0, layout.owner_order)
    g_out = g_out.to(wire.payload_dtype)
    if handle.capacity is not None:  # padding slots (token T) read an appended zero row
        g_out = torch.cat([g_out, g_out.new_zeros((1, g_out.shape[1]))])
    rows = ops.pack_rows([g_out], [token_o])
    copies = yield from forward_moves(
        rows, layout=layout, view=handle.view, schedule=handle.schedule, groups=ctx.groups
    )
    (g_y_C,) = unpack_views(copies, wire.combine_specs())
    return _entry_rows(g_y_C, entries)
