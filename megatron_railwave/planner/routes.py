"""Record-level routes and per-rank stage split sizes derived from a ``PathPlan``.

Letters: N nodes, G GPUs per node, M = 2**G target masks, T tokens of one rank, V waves,
n_rec records of one rank.

Canonical record order on an owner GPU: by destination node, then target mask, then token. The
owner's list for each pair is cut into parts in GPU order: egress l (the owner itself for l = g,
what it keeps) takes the ``relay[g, l]`` records after those of GPUs < l, for any relay plan
(RailBalance's greedy fill, FLOW's min-max plan). GPU order, not "kept part first": masks ascend
with their highest target GPU, so the part of egress l holds the masks whose targets sit around
GPU l, and a plan that knows the histogram can land records on a target's rail (``planner.flow``).
Because the order is a function of the mask histogram alone, every rank can compute how many
copies each arriving rail delivers to each GPU (stage 3) from the gathered counts, without another
exchange.

Delivery rounds: round 0 carries the local node's records (they need no rail, so their
delivery runs while rail wave 0 is in flight); round v + 1 carries the records of remote wave v.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from megatron_railwave.planner.chunks import chunk_sizes
from megatron_railwave.planner.plan import PathPlan
from megatron_railwave.traffic import DemandCounts, mask_bits

__all__ = [
    "owner_egress_bounds",
    "RecordRoutes",
    "route_records",
    "delivery_copies_NGG",
    "arrival_mask_counts_NGM",
    "chunk_arrival_counts",
    "RankSplits",
    "rank_splits",
]


def _stable_order(key_R: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Indices that sort ``key_R`` (values in [0, num_keys)) stably."""
    if num_keys <= 1 << 16:
        # numpy's stable sort of 16-bit keys is a radix sort, several times faster than torch's.
        keys = key_R.numpy().astype(np.uint16)
        return torch.from_numpy(np.argsort(keys, kind="stable")).to(torch.int64)
    return torch.sort(key_R, stable=True).indices


def owner_egress_bounds(
    relay_DGL: torch.Tensor | np.ndarray, owner: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keep_N, surplus_lo_N, deficit_hi_NG) int64 (numpy): ``ops.assign_egress``'s intervals
    of one owner GPU under any relay plan.

    The owner's list for destination node d is cut in GPU order: GPU l's part (l = owner: the
    records it keeps) ends at ``deficit_hi_NG[d, l]``, the running sum of ``relay[d, owner, l']``
    over l' <= l. On ``ops.assign_egress``'s line that is no separate kept prefix (``keep_N``
    zeros) and a line starting at 0 (``surplus_lo_N`` zeros).

    Args:
        relay_DGL: [N_dst, G_owner, G_egress] int64, one source node's ``relay_NNGG``.
        owner: the owner GPU g.
    """
    relay = relay_DGL.numpy() if isinstance(relay_DGL, torch.Tensor) else relay_DGL
    own_NL = relay[:, owner, :].astype(np.int64)
    zeros_N = np.zeros(own_NL.shape[0], dtype=np.int64)
    return zeros_N, zeros_N.copy(), np.cumsum(own_NL, axis=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordRoutes:
    """Where each record of one source rank goes (rank-local), in canonical order.

    Attributes:
        token_R: [n_rec] int64, token index of the record on the source rank.
        node_R: [n_rec] int64, destination node.
        mask_R: [n_rec] int64, target-GPU mask on the destination node.
        egress_R: [n_rec] int64, local GPU whose rail carries the record (owner for local node).
        wave_R: [n_rec] int64, wave of the record's node pair (-1 for the local node).
    """

    token_R: torch.Tensor
    node_R: torch.Tensor
    mask_R: torch.Tensor
    egress_R: torch.Tensor
    wave_R: torch.Tensor


def route_records(plan: PathPlan, rank: int, masks_TN: torch.Tensor) -> RecordRoutes:
    """Egress GPU and wave of every record of ``rank``.

    Args:
        plan: the global plan.
        rank: source rank (node * G + local).
        masks_TN: [T, N] int64, rank-local target masks (``traffic.target_masks``); 0 = no record.

    Raises:
        ValueError: when the masks do not match the counts the plan was built from.
    """
    topo = plan.topology
    s, g = topo.node_of(rank), topo.local_of(rank)
    n, m = topo.num_nodes, 1 << topo.gpus_per_node
    masks_NT = masks_TN.t().cpu()
    node_R, token_R = torch.nonzero(masks_NT, as_tuple=True)  # node-major, tokens ascending
    mask_R = masks_NT[node_R, token_R]
    # Stable sort by (node, mask) keeps tokens ascending inside each group.
    order_R = _stable_order(node_R * m + mask_R, n * m)
    node_R, token_R, mask_R = node_R[order_R], token_R[order_R], mask_R[order_R]

    counts_N = plan.records_NNG[s, :, g]
    if not torch.equal(torch.bincount(node_R, minlength=n), counts_N):
        raise ValueError(
            f"rank {rank}: its routing does not match the gathered counts the plan was built from "
            "(routing map changed between counting and routing?)"
        )
    start_N = counts_N.cumsum(0) - counts_N
    pos_R = torch.arange(node_R.numel(), dtype=torch.int64) - start_N[node_R]

    _, _, ends_NL = (torch.from_numpy(a) for a in owner_egress_bounds(plan.relay_NNGG[s], g))
    # Egress = first GPU whose part of the owner's list ends after the position. One search on a
    # single sorted line: node d's ends are shifted by d * span (span > every end).
    span = int(ends_NL[:, -1].max()) + 1 if ends_NL.numel() else 1
    line = (ends_NL + torch.arange(n, dtype=torch.int64).unsqueeze(1) * span).flatten()
    egress_R = (
        torch.searchsorted(line, pos_R + node_R * span, right=True) - node_R * topo.gpus_per_node
    )
    wave_R = plan.pair_wave_NN[s, node_R]
    return RecordRoutes(
        token_R=token_R, node_R=node_R, mask_R=mask_R, egress_R=egress_R, wave_R=wave_R
    )


@functools.lru_cache(maxsize=16)
def _mask_bits_f64(gpus_per_node: int) -> np.ndarray:
    """[M, G] float64 bits of every mask (read-only, cached: on every layer's planning path)."""
    bits = mask_bits(gpus_per_node).numpy().astype(np.float64)
    bits.flags.writeable = False
    return bits


def delivery_copies_NGG(plan: PathPlan, demand: DemandCounts, dest_node: int) -> torch.Tensor:
    """[N_src, G_arrive, G_target] int64: copies of node s's records that arrive at GPU
    (dest_node, l) and are delivered to GPU (dest_node, j). For s == dest_node, l is the owner.

    Derived from the mask histogram of the records into ``dest_node`` and the plan's
    keep/relay counts (records sorted by mask on every owner).
    """
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    hist = (
        demand.masks_into(dest_node).reshape(n, g, -1).numpy().astype(np.float64)
    )  # [s, owner, m]
    # Owner g's sorted list is cut in GPU order (the plan's relay counts, its kept part in slot
    # g), so the records for egress l end at the running sum of relay[g, l'] over l' <= l.
    relay = plan.relay_NNGG[:, dest_node].numpy()  # [s, owner, egress l]
    ends = np.concatenate(
        [np.zeros(relay.shape[:2] + (1,), np.int64), np.cumsum(relay, axis=-1)], axis=-1
    )  # [s, g, G+1]
    # F(x)[j]: copies for target j among the first x records = sum over masks of the part of the
    # mask's run [c_lo, c_lo + hist) below x, times bit j. Float64 is exact here (counts << 2**53)
    # and lets the sum over masks run as one matrix product.
    c_lo = np.cumsum(hist, axis=-1) - hist
    below = np.clip(ends[:, :, :, None].astype(np.float64) - c_lo[:, :, None, :], 0.0, None)
    below = np.minimum(below, hist[:, :, None, :])  # [s, g, G+1, m]
    f_NGPG = below @ _mask_bits_f64(g)  # [s, g, G+1, j]
    copies = f_NGPG[:, :, 1:, :] - f_NGPG[:, :, :-1, :]  # [s, g, l, j]
    return torch.from_numpy(np.rint(copies.sum(axis=1)).astype(np.int64))


def arrival_mask_counts_NGM(
    plan: PathPlan, demand: DemandCounts, dest_node: int, arrive_gpu: int
) -> torch.Tensor:
    """[N_src, G_owner, M] int64: records of owner (s, g) that arrive at GPU (dest_node, l), by
    mask.

    On the arrival GPU the records of one source node come in egress-buffer order: owner g
    ascending, then mask ascending (each owner's list is mask-sorted and its part for egress l is
    one contiguous interval of it). So the mask of every arriving record follows from these
    counts, and the delivery index maps need no look at the data (no device sync).
    For s == dest_node the "arrival" is the owner itself (local records, l == g only).
    """
    n, g = plan.topology.num_nodes, plan.topology.gpus_per_node
    l = arrive_gpu
    hist = demand.masks_into(dest_node).reshape(n, g, -1).numpy()  # [s, owner, m]
    relay = plan.relay_NNGG[:, dest_node].numpy()  # [s, owner, egress]
    a = relay[:, :, :l].sum(axis=-1)  # [s, g]: start of egress l's part of owner g's list
    b = a + relay[:, :, l]
    c_hi = np.cumsum(hist, axis=-1)
    c_lo = c_hi - hist
    out = np.minimum(b[:, :, None], c_hi) - np.maximum(a[:, :, None], c_lo)
    return torch.from_numpy(np.clip(out, 0, None))


def chunk_arrival_counts(arrival_NGM: np.ndarray, chunks: int) -> np.ndarray:
    """[N_src, chunks, G_owner, M] int64: the records of each source node arriving at one GPU
    (``arrival_NGM`` [N_src, G_owner, M], in arrival order: owner, then mask) that travel in each
    rail chunk. Chunk k is the k-th contiguous part of the source's block (``chunks.chunk_sizes``),
    so its counts are the cut of the block's cumulative counts at the chunk's bounds."""
    n, g, m = arrival_NGM.shape
    flat = arrival_NGM.reshape(n, g * m)
    hi = np.cumsum(flat, axis=1)
    lo = hi - flat
    sizes = chunk_sizes(hi[:, -1] if g * m else np.zeros(n, dtype=np.int64), chunks)  # [N, c]
    b_hi = np.cumsum(sizes, axis=1)
    b_lo = b_hi - sizes
    cut = np.minimum(hi[:, None, :], b_hi[:, :, None]) - np.maximum(
        lo[:, None, :], b_lo[:, :, None]
    )
    return np.clip(cut, 0, None).reshape(n, chunks, g, m)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSplits:
    """Split sizes (record or copy counts) of one rank for the three stages, all host ints.

    Attributes:
        relay_send_G / relay_recv_G: [G] stage 1 records to / from each local GPU (self = 0).
        rail_send_VN / rail_recv_VN: [V, N] stage 2 records to / from node n on this rail.
        deliver_recv_VG: [V', G] stage 3 copies received from each local GPU per round.
        deliver_send_VG: [V', G] stage 3 copies sent to each local GPU per round.
        num_rounds: V' = V + 1 (round 0: the local node's records; round v + 1: wave v).
    """

    relay_send_G: list[int]
    relay_recv_G: list[int]
    rail_send_VN: list[list[int]]
    rail_recv_VN: list[list[int]]
    deliver_send_VG: list[list[int]]
    deliver_recv_VG: list[list[int]]
    num_rounds: int


def rank_splits(plan: PathPlan, demand: DemandCounts, rank: int) -> RankSplits:
    """Every split size ``rank`` needs, from the global counts only (whole waves only: a
    chunked plan's rounds are in ``schedule.compile_for_rank``).

    Raises:
        ValueError: for a plan with rail chunks.
    """
    if plan.chunks != 1:
        raise ValueError(
            f"rank_splits covers whole waves only; this plan has {plan.chunks} rail chunks per "
            f"wave "
            "(use schedule.compile_for_rank and its rank view)"
        )
    topo = plan.topology
    n = topo.num_nodes
    s, me = topo.node_of(rank), topo.local_of(rank)
    remote_N = torch.ones(n, dtype=torch.bool)
    remote_N[s] = False
    relay = plan.relay_NNGG[s][remote_N]  # [d remote, owner, egress]
    relay_send = relay[:, me, :].sum(0)
    relay_recv = relay[:, :, me].sum(0)
    relay_send[me] = 0
    relay_recv[me] = 0

    num_waves = plan.num_waves
    rounds = num_waves + 1
    wave_NN = plan.pair_wave_NN
    send_to = plan.quota_NNG[s, :, me]  # [d]
    recv_from = plan.quota_NNG[:, s, me]  # [s']
    w_range = torch.arange(num_waves).unsqueeze(1)
    rail_send = torch.where(wave_NN[s].unsqueeze(0) == w_range, send_to.unsqueeze(0), 0)
    rail_recv = torch.where(wave_NN[:, s].unsqueeze(0) == w_range, recv_from.unsqueeze(0), 0)

    copies = delivery_copies_NGG(plan, demand, s)  # [s', l, j]
    round_of_src = wave_NN[:, s] + 1
    round_of_src[s] = 0
    onehot = torch.nn.functional.one_hot(round_of_src, rounds)  # [s', V']
    per_round = torch.einsum("slj,sv->vlj", copies, onehot)  # [V', l, j]
    return RankSplits(
        relay_send_G=relay_send.tolist(),
        relay_recv_G=relay_recv.tolist(),
        rail_send_VN=rail_send.tolist(),
        rail_recv_VN=rail_recv.tolist(),
        deliver_send_VG=per_round[:, me, :].tolist(),
        deliver_recv_VG=per_round[:, :, me].tolist(),
        num_rounds=rounds,
    )
