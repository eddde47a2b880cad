"""One rank's view of an ``ExecutionSchedule``: its row counts per phase and peer, and the counts
that fix the order of rows in its buffers. Host ints and small CPU tensors; no device data.

Letters: N nodes, G GPUs per node, M = 2**G target masks, Q peers of a group (G for node
groups, N for rail groups).

Row order on rank (s, g), which the exchange's index maps follow (``exchange.layout``):

* owner rows: the rank's records in canonical order (destination node, target mask, token),
  grouped by category: egress GPU 0..G-1 for remote records (egress g = kept on its own rail),
  then the local node's records;
* pool (at egress GPU l): the kept records, then the records relayed by owners o != l in
  owner order, each block in canonical order;
* egress buffer: the pool reordered by (destination node, owner);
* arrivals of round r >= 1: the rail chunks of the wave's source nodes in node order, each in
  (owner, mask) order; round 0: the owner's own local-node records;
* copies: every round's deliveries in (round, sending GPU) order.

With a streamed relay (``PathPlan.streamed``) each owner category block of an egress GPU and each
pool block is ordered by (rail phase, destination node, canonical order) instead, so that relay
part u is one slice on both sides (``exchange.layout.StreamedMaps``); the egress buffer and
everything after it keep the order above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_railwave.planner import arrival_mask_counts_NGM
from megatron_railwave.schedule.execution import Direction, ExecutionSchedule, Phase

__all__ = ["PhaseCounts", "RankView", "rank_view"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseCounts:
    """Rows this rank sends to / receives from each peer of the phase's group (self included)."""

    phase: Phase
    send_Q: list[int]
    recv_Q: list[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankView:
    """What rank (node, local) needs to execute the schedule.

    Attributes:
        rank, node, local: the EP rank and its (node, local GPU).
        phases: per phase of the schedule (same order), this rank's row counts.
        owner_category_counts: [G + 1] own records per category (egress GPU, then local node).
        kept_N: [N] int64 (numpy), records this GPU keeps on its own rail per destination node.
        relay_in_NG: [N, G] int64 (numpy), records owner o relays to this GPU for node d (o ==
        local: 0).
        egress_N: [N] rows leaving on this rail per destination node (own node: 0).
        arrival_counts_NGM: [N, G, M] int64 (numpy), records of owner (s, o) arriving here, by mask.
        source_round_N: [N] int64 (numpy), delivery round of each source node's records (own node:
        0);
            with rail chunks, that of its first chunk (chunk k arrives in that round + k).
        num_copies: copies this rank receives over all rounds.
    """

    rank: int
    node: int
    local: int
    phases: tuple[PhaseCounts, ...]
    owner_category_counts: list[int]
    kept_N: np.ndarray
    relay_in_NG: np.ndarray
    egress_N: list[int]
    arrival_counts_NGM: np.ndarray
    source_round_N: np.ndarray
    num_copies: int

    @property
    def num_records(self) -> int:
        return sum(self.owner_category_counts)

    def counts(self, phase: Phase) -> PhaseCounts:
        return self.phases[phase.index]


def phase_counts(
    phases: tuple[Phase, ...], send_PQ: np.ndarray, recv_PQ: np.ndarray, n: int, g: int
) -> tuple[PhaseCounts, ...]:
    """Per phase, the rank's rows to / from each peer (``send_PQ`` / ``recv_PQ``: [P, >= max(N, G)]
    int64 rows per dispatch phase and peer; a combine phase runs its mirror backwards).

    Only the dispatch rows become Python lists, each at its group's width (N peers on a rail, G
    on NVLink): at 128 x 8 that is ~17 k numbers, where the whole [P, max(N, G)] tables were ~130 k.
    """
    send_PQ, recv_PQ = np.asarray(send_PQ), np.asarray(recv_PQ)
    dispatch = [p for p in phases if p.mirror_of is None]
    rows: dict[int, tuple[list[int], list[int]]] = {}
    for group, width in (("rail", n), ("node", g)):
        index = [p.index for p in dispatch if p.group == group]
        for i, send, recv in zip(
            index, send_PQ[index, :width].tolist(), recv_PQ[index, :width].tolist()
        ):
            rows[i] = (send, recv)
    counts = []
    for p in phases:
        if p.mirror_of is None:
            send, recv = rows[p.index]
        else:
            recv, send = rows[p.mirror_of]
        counts.append(PhaseCounts(phase=p, send_Q=list(send), recv_Q=list(recv)))
    return tuple(counts)


def rank_view(schedule: ExecutionSchedule, rank: int) -> RankView:
    """This rank's row counts per phase (from the transfer table) and buffer-order counts.

    Raises:
        ValueError: when the schedule holds no stage-3 transfers for the rank's node.
    """
    plan = schedule.plan
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    node, me = topo.node_of(rank), topo.local_of(rank)
    if node not in schedule.delivery_nodes:
        raise ValueError(
            f"rank {rank}: the schedule was compiled without node {node}'s deliveries "
            f"(delivery_nodes={schedule.delivery_nodes}); compile it with that node's demand view"
        )
    schedule.require_ranks("rank_view", (rank,))
    width = max(n, g)
    num_phases = len(schedule.phases)
    # numpy for the small host arithmetic of every layer (a fraction of torch's per-call cost).
    phase_X, src_X, dst_X, rows_X = (
        t.numpy() for t in (schedule.phase_X, schedule.src_X, schedule.dst_X, schedule.rows_X)
    )
    is_rail_P = np.array([p.group == "rail" for p in schedule.phases])

    def dense(from_rank: np.ndarray, peer: np.ndarray) -> np.ndarray:
        phase, rows, other = phase_X[from_rank], rows_X[from_rank], peer[from_rank]
        peer_index = np.where(is_rail_P[phase], other // g, other % g)
        out = np.zeros(num_phases * width, dtype=np.int64)
        np.add.at(out, phase * width + peer_index, rows)
        return out.reshape(num_phases, width)

    counts = phase_counts(
        schedule.phases, dense(src_X == rank, dst_X), dense(dst_X == rank, src_X), n, g
    )

    wave_N = plan.pair_wave_NN.numpy()
    remote_N = wave_N[node] >= 0
    relay_DOL = plan.relay_NNGG[node].numpy() * remote_N[:, None, None]  # [d, owner, egress]
    categories = relay_DOL[:, me, :].sum(axis=0).tolist() + [int(plan.records_NNG[node, node, me])]
    kept_N = relay_DOL[:, me, me].copy()
    relay_in_NG = relay_DOL[:, :, me].copy()
    relay_in_NG[:, me] = 0
    egress_N = (plan.quota_NNG[node, :, me].numpy() * remote_N).tolist()
    source_round_N = wave_N[:, node] * plan.chunks + 1
    source_round_N[node] = 0
    num_copies = sum(
        sum(c.recv_Q)
        for c in counts
        if c.phase.direction == Direction.DISPATCH and c.phase.kind == "deliver"
    )
    return RankView(
        rank=rank,
        node=node,
        local=me,
        phases=counts,
        owner_category_counts=categories,
        kept_N=kept_N,
        relay_in_NG=relay_in_NG,
        egress_N=egress_N,
        arrival_counts_NGM=arrival_mask_counts_NGM(plan, schedule.demand, node, me).numpy(),
        source_round_N=source_round_N,
        num_copies=num_copies,
    )
