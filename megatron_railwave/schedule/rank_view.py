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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planner import arrival_mask_counts_NGM
from .execution import Direction, ExecutionSchedule, Phase

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
        kept_N: [N] int64, records this GPU keeps on its own rail per destination node.
        relay_in_NG: [N, G] int64, records owner o relays to this GPU for node d (o == local: 0).
        egress_N: [N] rows leaving on this rail per destination node (own node: 0).
        arrival_counts_NGM: [N, G, M] int64, records of owner (s, o) arriving here, by mask.
        source_round_N: [N] delivery round of each source node's records (own node: 0).
        num_copies: copies this rank receives over all rounds.
    """

    rank: int
    node: int
    local: int
    phases: tuple[PhaseCounts, ...]
    owner_category_counts: list[int]
    kept_N: torch.Tensor
    relay_in_NG: torch.Tensor
    egress_N: list[int]
    arrival_counts_NGM: torch.Tensor
    source_round_N: torch.Tensor
    num_copies: int

    @property
    def num_records(self) -> int:
        return sum(self.owner_category_counts)

    def counts(self, phase: Phase) -> PhaseCounts:
        return self.phases[phase.index]


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
            f"(delivery_nodes={schedule.delivery_nodes}); compile it with that node's demand view")
    width = max(n, g)
    num_phases = len(schedule.phases)
    is_rail_P = torch.tensor([p.group == "rail" for p in schedule.phases])

    def dense(from_rank: torch.Tensor, peer: torch.Tensor) -> torch.Tensor:
        phase, rows = schedule.phase_X[from_rank], schedule.rows_X[from_rank]
        peer_index = torch.where(is_rail_P[phase], peer[from_rank] // g, peer[from_rank] % g)
        out = torch.zeros(num_phases * width, dtype=torch.int64)
        return out.index_add_(0, phase * width + peer_index, rows).view(num_phases, width)

    send_PQ = dense(schedule.src_X == rank, schedule.dst_X).tolist()
    recv_PQ = dense(schedule.dst_X == rank, schedule.src_X).tolist()
    counts = []
    for p in schedule.phases:
        q = n if p.group == "rail" else g
        if p.mirror_of is None:
            send, recv = send_PQ[p.index][:q], recv_PQ[p.index][:q]
        else:  # combine runs its mirror backwards
            send, recv = recv_PQ[p.mirror_of][:q], send_PQ[p.mirror_of][:q]
        counts.append(PhaseCounts(phase=p, send_Q=send, recv_Q=recv))

    remote_N = plan.pair_wave_NN[node] >= 0
    relay_DOL = plan.relay_NNGG[node] * remote_N.view(n, 1, 1)  # [d, owner, egress]
    categories = relay_DOL[:, me, :].sum(dim=0).tolist() + [int(plan.records_NNG[node, node, me])]
    kept_N = relay_DOL[:, me, me].clone()
    relay_in_NG = relay_DOL[:, :, me].clone()
    relay_in_NG[:, me] = 0
    egress_N = (plan.quota_NNG[node, :, me] * remote_N).tolist()
    source_round_N = plan.pair_wave_NN[:, node] + 1
    source_round_N[node] = 0
    num_copies = sum(sum(c.recv_Q) for c in counts if c.phase.direction == Direction.DISPATCH
                     and c.phase.kind == "deliver")
    return RankView(
        rank=rank, node=node, local=me, phases=tuple(counts), owner_category_counts=categories,
        kept_N=kept_N, relay_in_NG=relay_in_NG, egress_N=egress_N,
        arrival_counts_NGM=arrival_mask_counts_NGM(plan, schedule.demand, node, me),
        source_round_N=source_round_N, num_copies=num_copies,
    )
