"""Device index maps of one rank for one layer, from its ``RankView`` and its own records.

Letters: N nodes, G GPUs per node, M = 2**G masks, n_rec records of this rank, n_pool rows at
this GPU's egress, n_arr rows arriving in one round, n_copy copies received, n_ent
(token, local expert) entries.

Everything here runs on the input's device with tensor ops whose output sizes are host
integers from the rank view: no host sync, no Python loop over records. The small count
tensors the maps are built from (``layout_counts``, or ``ops.rank_schedule``'s copy of them)
travel to the device in one non-blocking copy. Row orders are those of ``schedule.rank_view``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.planner import (
    PathPlan,
    chunk_arrival_counts,
    chunk_sizes,
    owner_egress_bounds,
    relay_chunk_rows_NNGGC,
)
from megatron_railwave.schedule import RankView

__all__ = [
    "HostCounts",
    "LayerLayout",
    "StreamedMaps",
    "build_layout",
    "layout_counts",
    "select_positions",
]


class HostCounts:
    """Small host int64 arrays moved to the device in one copy (pinned, non-blocking on CUDA).

    ``add(name, array)`` collects (numpy or torch); ``to(device)`` returns a dict of device views.
    """

    def __init__(self) -> None:
        self._parts: list[tuple[str, np.ndarray]] = []

    def add(self, name: str, values: np.ndarray | torch.Tensor) -> None:
        array = values.numpy() if isinstance(values, torch.Tensor) else values
        self._parts.append((name, np.asarray(array, dtype=np.int64).reshape(-1)))

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        flat = torch.from_numpy(
            np.concatenate([a for _, a in self._parts])
            if self._parts
            else np.zeros(0, dtype=np.int64)
        )
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        out, offset = {}, 0
        for name, a in self._parts:
            out[name] = flat[offset : offset + a.size]
            offset += a.size
        return out


def select_positions(flags: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: positions of the True entries of the 1-D ``flags``, ascending.

    ``total`` (their number) is known on the host, so this needs no sync: ``nonzero_static``
    has a fixed output size (``nonzero`` without it would wait for the device to count).
    """
    return torch.nonzero_static(flags, size=total).view(-1)


def _runs(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times (device, sync-free: the total is given)."""
    return torch.repeat_interleave(values, counts, output_size=total)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerLayout:
    """Index maps of one rank (device tensors unless noted).

    Attributes:
        token_R, node_R: [n_rec] the rank's records in canonical order.
        owner_order: [n_rec] canonical index of each owner row (owner rows are grouped by
            category: egress GPU 0..G-1, then the local node).
        category_counts: host, [G + 1] owner rows per category.
        egress_perm: [n_pool] pool row of each egress row.
        egress_inverse: [n_pool] egress row of each pool row (the inverse permutation).
        egress_is_kept: host, True when no owner relays records here: the pool is the kept
            records, already in egress order (NATIVE / PERM without failed rails), so no copy.
        pool_counts: host, [1 + G - 1] pool rows: kept, then from each other owner.
        deliver_index: per round, [sum_j copies] arrival row of each delivered copy, grouped by
            target GPU j ascending.
        arrivals: host, per round, rows arriving at this GPU (round 0: its local-node records).
        num_copies: host, n_copy.
        streamed: None, or with a streamed relay (``PathPlan.streamed``) the per-phase maps
            (``StreamedMaps``).
    """

    token_R: torch.Tensor
    node_R: torch.Tensor
    owner_order: torch.Tensor
    category_counts: list[int]
    egress_perm: torch.Tensor
    egress_inverse: torch.Tensor
    egress_is_kept: bool
    pool_counts: list[int]
    deliver_index: list[torch.Tensor]
    arrivals: list[int]
    num_copies: int
    streamed: StreamedMaps | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamedMaps:
    """The row maps of a streamed relay: relay phase u moves what rail phase u sends.

    With a streamed relay each owner category block (egress GPU l) and each pool block is ordered
    by (rail phase u, destination node, canonical order) instead of (destination node, canonical
    order), so that relay phase u's message is one contiguous slice on both sides; the egress
    order (destination node, owner, canonical) and everything after it stay as they are.

    Attributes:
        owner_UL: host, [G][U] rows of owner category l (egress GPU l; l = this GPU: the kept
            ones) in each relay phase.
        pool_UB: host, [G][U] rows of pool block b (kept, then each other owner) per phase.
        rail_pool_index: per rail phase u, [rows of u] pool row of each row it sends, by
            destination node ascending (the egress rows of u's chunks).
        relay_back_index: per relay phase u, [pool rows of u] egress row of each pool row of
            phase u, pool block by block (the combine relay gathers them from the egress rows).
    """

    owner_UL: list[list[int]]
    pool_UB: list[list[int]]
    rail_pool_index: list[torch.Tensor]
    relay_back_index: list[torch.Tensor]


def _streamed_host_counts(plan: PathPlan, view: RankView) -> dict[str, np.ndarray]:
    """Host counts of a streamed relay's maps on rank ``view.rank`` (numpy int64):

    * group_start [(G + 1) * N]: first owner row of each (category, destination node) group
      (categories: egress GPU 0..G-1, then the local node) in (category, node) order;
    * my_off [N * G]: where this owner's records start in the egress rows of (node, GPU l);
    * chunk_hi [N * G * C]: the ends of the rail chunks in the egress rows of (node, GPU l);
    * wave [N]: each destination node's wave (-1: own node);
    * pool_key / pool_count / pool_phase [E]: pool rows as runs in pool order (block, rail phase,
      destination node): key node * G + owner, the rows, the phase;
    * egress_phase / egress_size [N * C]: rail phase and rows of each (node, chunk) part of this
      GPU's egress rows, node-major;
    * owner_UL / pool_UB [G, U]: rows per (owner category, phase) and per (pool block, phase).
    """
    topo = plan.topology
    n, g, c = topo.num_nodes, topo.gpus_per_node, plan.chunks
    s, me = view.node, view.local
    num_phases = plan.num_rail_phases
    wave_N = plan.pair_wave_NN[s].numpy()
    remote_N = wave_N >= 0
    relay_DOL = plan.relay_NNGG[s].numpy() * remote_N[:, None, None]  # [d, owner, egress]
    parts_DOLK = relay_chunk_rows_NNGGC(plan, node=s)  # [d, owner, egress, chunk]
    group_NC = np.zeros((g + 1, n), dtype=np.int64)
    group_NC[:g] = relay_DOL[:, me, :].T
    group_NC[g, s] = int(plan.records_NNG[s, s, me])
    group_start = np.cumsum(group_NC.reshape(-1)) - group_NC.reshape(-1)
    my_off = relay_DOL[:, :me, :].sum(axis=1)  # [d, l]
    sizes_DLK = chunk_sizes(relay_DOL.sum(axis=1), c)  # [d, l, k]: the quota's chunks
    owners = np.array([me] + [o for o in range(g) if o != me])  # pool blocks
    # The (destination node, chunk) parts of this node's pairs in rail-phase order (u, then node).
    remote = np.flatnonzero(remote_N)
    node_E = np.repeat(remote, c)
    chunk_E = np.tile(np.arange(c), remote.size)
    phase_E = wave_N[node_E] * c + chunk_E
    order = np.lexsort((node_E, phase_E))
    node_E, chunk_E, phase_E = node_E[order], chunk_E[order], phase_E[order]
    owner_UL = np.zeros((num_phases, g), dtype=np.int64)
    np.add.at(owner_UL, phase_E, parts_DOLK[node_E, me, :, chunk_E])  # [E, l] per category
    pool_BE = parts_DOLK[node_E[None, :], owners[:, None], me, chunk_E[None, :]]  # [blocks, E]
    pool_UB = np.zeros((num_phases, g), dtype=np.int64)
    np.add.at(pool_UB, phase_E, pool_BE.T)
    owner_UL, pool_UB = owner_UL.T, pool_UB.T
    keys = node_E[None, :] * g + owners[:, None]
    rows = pool_BE
    phase = np.broadcast_to(phase_E, pool_BE.shape)
    egress_phase = (wave_N[remote][:, None] * c + np.arange(c)).reshape(-1)
    return {
        "group_start": group_start,
        "my_off": my_off.reshape(-1),
        "chunk_hi": np.cumsum(sizes_DLK, axis=-1).reshape(-1),
        "wave": wave_N,
        "pool_key": keys.reshape(-1).astype(np.int64, copy=False),
        "pool_count": rows.reshape(-1).astype(np.int64, copy=False),
        "pool_phase": phase.reshape(-1).astype(np.int64, copy=False),
        "egress_phase": egress_phase,
        "egress_size": sizes_DLK[remote, me, :].reshape(-1),
        "owner_UL": owner_UL,
        "pool_UB": pool_UB,
    }


def _streamed_maps(
    plan: PathPlan, view: RankView, category_R: torch.Tensor, node_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StreamedMaps]:
    """(owner_order, egress_perm, egress_inverse, maps) of a streamed relay (device; no sync)."""
    topo = plan.topology
    n, g, c = topo.num_nodes, topo.gpus_per_node, plan.chunks
    num_phases = plan.num_rail_phases
    device = node_R.device
    host = _streamed_host_counts(plan, view)
    staged = HostCounts()
    for name in (
        "group_start",
        "my_off",
        "chunk_hi",
        "wave",
        "pool_key",
        "pool_count",
        "pool_phase",
        "egress_phase",
        "egress_size",
    ):
        staged.add(name, host[name])
    dev = staged.to(device)
    n_rec = view.num_records
    # Owner rows: (category, node, canonical) first, then within a category by rail phase.
    by_category = torch.sort(category_R, stable=True).indices
    cat_s, node_s = category_R[by_category], node_R[by_category]
    position = (
        torch.arange(n_rec, dtype=torch.int64, device=device)
        - dev["group_start"][cat_s * n + node_s]
    )
    cell = node_s * g + cat_s.clamp(max=g - 1)
    egress_row = dev["my_off"][cell] + position
    chunk = (egress_row[:, None] >= dev["chunk_hi"].view(n * g, c)[cell]).sum(dim=1)
    rail_phase = dev["wave"][node_s] * c + chunk
    key = torch.where(cat_s < g, cat_s * num_phases + rail_phase, g * num_phases)
    owner_order = by_category[torch.sort(key, stable=True).indices]
    # Pool rows -> egress rows (destination node, owner, canonical): a stable sort of the keys.
    pool_total = int(host["pool_count"].sum())
    egress_perm = torch.sort(
        _runs(dev["pool_key"], dev["pool_count"], pool_total), stable=True
    ).indices
    egress_inverse = torch.empty_like(egress_perm).scatter_(
        0, egress_perm, torch.arange(pool_total, dtype=torch.int64, device=device)
    )
    egress_total = int(host["egress_size"].sum())
    egress_by_phase = torch.sort(
        _runs(dev["egress_phase"], dev["egress_size"], egress_total), stable=True
    ).indices
    rail_rows = np.bincount(host["egress_phase"], host["egress_size"], minlength=num_phases)
    pool_by_phase = torch.sort(
        _runs(dev["pool_phase"], dev["pool_count"], pool_total), stable=True
    ).indices
    pool_UB = host["pool_UB"]
    maps = StreamedMaps(
        owner_UL=host["owner_UL"].tolist(),
        pool_UB=pool_UB.tolist(),
        rail_pool_index=list(
            egress_perm[egress_by_phase].split(rail_rows.astype(np.int64).tolist())
        ),
        relay_back_index=list(egress_inverse[pool_by_phase].split(pool_UB.sum(axis=0).tolist())),
    )
    return owner_order, egress_perm, egress_inverse, maps


def layout_counts(plan: PathPlan, view: RankView) -> np.ndarray:
    """[K] int64 (numpy): the host counts ``build_layout`` needs, in this order: counts_N,
    keep_N, surplus_lo_N, deficit_hi_NG, wave_N, pool_key [G, N], pool_count [G, N], then the
    arrival masks' counts of rounds 1..V (the round's sources ascending, owner, mask).

    ``ops.rank_schedule`` computes the same array with the schedule (``schedule.compile_for_rank``).
    """
    g = plan.topology.gpus_per_node
    s, me = view.node, view.local
    # This owner's egress intervals under the plan's relay counts (any relay plan): its list is
    # cut in GPU order, GPU l's part (l = me: what it keeps) after those of GPUs < l.
    keep_N, surplus_lo_N, hand_NL = owner_egress_bounds(plan.relay_NNGG[s], me)
    # Pool rows (kept, then owners o != me), each block by destination node: key node * G + owner.
    owners = [me] + [o for o in range(g) if o != me]
    pool_NB = np.concatenate(
        [view.kept_N[:, None], view.relay_in_NG[:, owners[1:]]], axis=1
    )  # [N, blocks]
    parts = [
        plan.records_NNG[s, :, me].numpy(),
        keep_N,
        surplus_lo_N,
        hand_NL.reshape(-1),
        plan.pair_wave_NN[s].numpy(),
        (np.arange(view.kept_N.size)[None, :] * g + np.array(owners)[:, None]).reshape(-1),
        pool_NB.T.reshape(-1),
    ]
    for rnd in range(1, plan.num_rail_phases + 1):
        sources, chunk = _round_sources(view, rnd, plan.chunks)
        arrival = view.arrival_counts_NGM[sources]
        parts.append(
            (
                arrival
                if plan.chunks == 1
                else chunk_arrival_counts(arrival, plan.chunks)[:, chunk]
            ).reshape(-1)
        )
    return np.concatenate(parts).astype(np.int64, copy=False)


def _wave_first_round(rnd: int | np.ndarray, chunks: int) -> int | np.ndarray:
    """The delivery round of the first chunk of round ``rnd``'s wave (``rnd`` >= 1; an int or an
    array of them): a source node's rounds are ``source_round_N`` and the next chunks - 1."""
    return (rnd - 1) // chunks * chunks + 1


def _round_sources(view: RankView, rnd: int, chunks: int) -> tuple[np.ndarray, int]:
    """(source nodes ascending, chunk) of delivery round ``rnd`` >= 1."""
    first = _wave_first_round(rnd, chunks)
    return np.flatnonzero(view.source_round_N == first), rnd - first


def build_layout(
    plan: PathPlan,
    view: RankView,
    *,
    token_R: torch.Tensor,
    node_R: torch.Tensor,
    counts: np.ndarray | None = None,
) -> LayerLayout:
    """Owner, egress and delivery maps of rank ``view.rank`` (device; no host sync).

    Args:
        plan: the layer's plan.
        view: the rank's view of the schedule.
        token_R, node_R: [n_rec] int64 (device), the rank's records in canonical order
            (``ops.records_from_routing`` cut to n_rec). Their target masks are not needed: the
            delivery maps follow from the counts (``_delivery_runs``).
        counts: ``layout_counts(plan, view)`` when already computed (``schedule.compile_for_rank``).
    """
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    m = 1 << g
    s, me = view.node, view.local
    device = token_R.device
    if counts is None:
        counts = layout_counts(plan, view)
    offsets = np.cumsum([0, n, n, n, n * g, n, g * n, g * n])
    pool_GN = counts[offsets[6] : offsets[7]].reshape(g, n)  # host: pool rows per (block, node)
    # Rows arriving in rounds >= 1, from offsets[-1] on: per round, a (source of the round
    # ascending, owner, mask) block (``_round_sources``, counted for every round at once).
    rounds = np.arange(1, plan.num_rail_phases + 1)
    sources_R = np.bincount(
        view.source_round_N[view.source_round_N >= 1], minlength=rounds.size + 1
    )[_wave_first_round(rounds, plan.chunks)]
    cells_R = np.concatenate([[m], sources_R * g * m]).astype(np.int64)  # round 0: own records
    end = int(offsets[-1] + cells_R[1:].sum())
    runs = _delivery_runs(
        own_M=view.arrival_counts_NGM[s, me], arrive=counts[offsets[-1] : end], cells_R=cells_R, g=g
    )
    if runs.arrivals_R[0] != view.owner_category_counts[g]:  # host ints: before any collective
        raise RuntimeError(
            f"internal: rank {view.rank}: its local-node records by mask sum to "
            f"{runs.arrivals_R[0]}, its owner rows for the local node are "
            f"{view.owner_category_counts[g]} (the rank view and the layout counts disagree)"
        )
    # One copy to the device (pinned, non-blocking on CUDA); the named parts are views of it.
    flat = torch.from_numpy(np.concatenate([counts, runs.shift_and_length.reshape(-1)]))
    flat = (
        flat.pin_memory().to(device, non_blocking=True)
        if device.type == "cuda"
        else flat.to(device)
    )
    counts_N, keep_N, surplus_lo_N, deficit_hi_NG, wave_N, pool_key, pool_count = (
        flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])
    )

    egress_R, _ = ops.assign_egress(
        node_R,
        owner_gpu=me,
        counts_N=counts_N,
        keep_N=keep_N,
        surplus_lo_N=surplus_lo_N,
        deficit_hi_NG=deficit_hi_NG.view(n, g),
        wave_N=wave_N,
    )
    category_R = torch.where(node_R == s, g, egress_R)
    streamed = None
    pool_total = int(pool_GN.sum())
    # A streamed relay orders the kept rows by rail phase: never the egress order as they are.
    egress_is_kept = not plan.streamed and not bool(pool_GN[1:].any())
    if plan.streamed:
        owner_order, egress_perm, egress_inverse, streamed = _streamed_maps(
            plan, view, category_R, node_R
        )
    elif egress_is_kept:  # the pool is the kept records, already in egress order: the identity
        owner_order = torch.sort(category_R, stable=True).indices
        egress_perm = egress_inverse = torch.arange(pool_total, dtype=torch.int64, device=device)
    else:
        owner_order = torch.sort(category_R, stable=True).indices
        egress_perm = torch.sort(_runs(pool_key, pool_count, pool_total), stable=True).indices
        egress_inverse = torch.empty_like(egress_perm).scatter_(
            0, egress_perm, torch.arange(pool_total, dtype=torch.int64, device=device)
        )

    deliver_index = _deliver_index(runs, flat[counts.size :].view(-1, 2))
    return LayerLayout(
        token_R=token_R,
        node_R=node_R,
        owner_order=owner_order,
        category_counts=list(view.owner_category_counts),
        egress_perm=egress_perm,
        egress_inverse=egress_inverse,
        egress_is_kept=egress_is_kept,
        pool_counts=pool_GN.sum(axis=1).tolist(),
        deliver_index=deliver_index,
        arrivals=runs.arrivals_R,
        num_copies=view.num_copies,
        streamed=streamed,
    )


@dataclass(frozen=True, slots=True)
class _DeliveryRuns:
    """Where a GPU's delivered copies come from, as runs of arrival rows (host; ``_delivery_runs``).

    Attributes:
        shift_and_length: [K, 2] int64, per run in map order (round, target GPU j, arrival
            order): its first arrival row (in its round) minus its first position in the rounds'
            maps end to end, and its rows.
        copies_R: per round 0..V, the copies delivered (the length of the round's map).
        arrivals_R: per round 0..V, the rows arriving.
    """

    shift_and_length: np.ndarray
    copies_R: list[int]
    arrivals_R: list[int]


def _delivery_runs(
    *, own_M: np.ndarray, arrive: np.ndarray, cells_R: np.ndarray, g: int
) -> _DeliveryRuns:
    """The delivery maps of every round from the counts alone (host, numpy).

    The rows arriving at a GPU come in runs of one mask: round 0's are this GPU's local-node
    records in canonical order (mask ascending: ``own_M``); round r >= 1's come by (source of the
    round, owner, mask) (``arrive``, ``layout_counts``). A run of mask m delivers each of its rows
    to every target j in m, so the map of round r (copies grouped by target j ascending, rows
    ascending within j) is, for j = 0..G-1, the round's runs whose mask holds j, each run's rows
    in order. Nothing here looks at the data: the device only expands the runs.

    Args:
        own_M: [M] int64, round 0's rows by mask.
        arrive: [sum of cells_R[1:]] int64, rows of rounds 1..V per (source, owner, mask) cell,
            the rounds' blocks end to end.
        cells_R: [V + 1] int64, cells of each round's block (round 0: M; every block is a whole
            number of [M] mask blocks, so a cell's mask is its index modulo M).
        g: G.
    """
    m = 1 << g
    rows_C = np.concatenate([np.asarray(own_M, dtype=np.int64).reshape(-1), arrive])
    # Only cells with rows matter (most (owner, mask) cells are empty): one pass over all cells,
    # the rest over these.
    live = np.flatnonzero(rows_C)
    rows_L = rows_C[live]
    round_L = np.searchsorted(np.cumsum(cells_R), live, side="right")
    round_rows = np.bincount(round_L, weights=rows_L, minlength=cells_R.size).astype(np.int64)
    # The cell's first row within its round.
    first_L = np.cumsum(rows_L) - rows_L - (np.cumsum(round_rows) - round_rows)[round_L]
    k, j = np.nonzero(((live % m)[:, None] >> np.arange(g)[None, :]) & 1)  # [live cell, target]
    order = np.lexsort((k, j, round_L[k]))  # round, then target, then arrival order
    cell = k[order]
    length = rows_L[cell]
    copies_R = np.bincount(round_L[cell], weights=length, minlength=cells_R.size)
    position = np.cumsum(length) - length  # the run's first position in the maps end to end
    return _DeliveryRuns(
        shift_and_length=np.stack([first_L[cell] - position, length], axis=1).astype(np.int64),
        copies_R=copies_R.astype(np.int64).tolist(),
        arrivals_R=round_rows.tolist(),
    )


def _deliver_index(runs: _DeliveryRuns, shift_and_length: torch.Tensor) -> list[torch.Tensor]:
    """Per delivery round, [copies of the round] arrival row of each copy this GPU delivers,
    grouped by target GPU j ascending, rows ascending within a target (device, no sync): the runs
    of ``_delivery_runs`` expanded for every round at once (``shift_and_length``: their [K, 2]
    copy on the device). Position t of the maps end to end, in run k, is arrival row t + shift[k]
    of its round."""
    total = int(sum(runs.copies_R))
    shift = _runs(shift_and_length[:, 0], shift_and_length[:, 1], total)
    rows = torch.arange(total, dtype=torch.int64, device=shift.device) + shift
    return list(rows.split(runs.copies_R))
