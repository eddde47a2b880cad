"""One rank's schedule, view and layout counts for one layer: the exchange's per-layer compile.

Letters: N nodes, G GPUs per node, M = 2**G target masks, P phases.

The exchange needs, per layer, the ``ExecutionSchedule`` with its own node's deliveries, its
``RankView`` and the host counts its device index maps are built from (``exchange.layout``).
Where the compiled ops load, one call of ``ops.rank_schedule`` computes all three (a few
microseconds); otherwise ``compile_schedule`` and ``rank_view`` run, and the layout computes its
counts itself. Both give the same schedule and view (tests/unit/schedule/test_rank_schedule_op.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_railwave import ops
from megatron_railwave.planner import PathPlan
from megatron_railwave.schedule.execution import (
    ExecutionSchedule,
    MaskSource,
    _build_phases,
    _dispatch_phase_indices,
    compile_schedule,
)
from megatron_railwave.schedule.rank_view import RankView, phase_counts, rank_view
from megatron_railwave.schedule.wire import RecordWireFormat

__all__ = ["RankSchedule", "compile_for_rank"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSchedule:
    """Attributes:
    schedule: the layer's schedule (stage 3 of the rank's node only; the transfers from or to
        the rank only: ``ExecutionSchedule.transfer_ranks``).
    view: the rank's view of it.
    layout_counts: [K] int64 (numpy), ``exchange.layout``'s host counts in its order, or
        None (the layout then computes them).
    """

    schedule: ExecutionSchedule
    view: RankView
    layout_counts: np.ndarray | None


def compile_for_rank(
    plan: PathPlan, wire: RecordWireFormat, *, demand: MaskSource, node: int, rank: int
) -> RankSchedule:
    """The schedule of ``plan`` with the deliveries of ``node`` (the rank's node), the rank's view
    and its layout counts. Pure; host only.

    Args:
        demand: the target-mask histograms of the records into ``node`` (``demand.masks_into``).
    """
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    phases = _build_phases(plan.num_rail_phases, plan.num_relay_phases)
    relay_phase_U, rail_phase_V, deliver_phase_R = _dispatch_phase_indices(
        plan.num_rail_phases, plan.num_relay_phases
    )
    out = ops.rank_schedule(
        plan.records_NNG,
        plan.quota_NNG,
        plan.relay_NNGG,
        plan.pair_wave_NN,
        demand.masks_into(node),
        rank=rank,
        chunks=plan.chunks,
        num_phases=len(phases),
        relay_phase_U=relay_phase_U,
        rail_phase_V=rail_phase_V,
        deliver_phase_R=deliver_phase_R,
    )
    if out is None:
        schedule = compile_schedule(plan, wire, demand=demand, delivery_nodes=(node,))
        return RankSchedule(
            schedule=schedule.only_ranks((rank,)),
            view=rank_view(schedule, rank),
            layout_counts=None,
        )
    table, send_PQ, recv_PQ, view_counts, layout_counts = out
    schedule = ExecutionSchedule(
        plan=plan,
        wire=wire,
        phases=phases,
        delivery_nodes=(node,),
        demand=demand,
        phase_X=table[0],
        src_X=table[1],
        dst_X=table[2],
        rows_X=table[3],
        transfer_ranks=(rank,),
    )
    v = view_counts.numpy()
    m = 1 << g
    kept = g + 1
    relay_in = kept + n
    egress = relay_in + n * g
    source_round = egress + n
    arrival = source_round + n
    view = RankView(
        rank=rank,
        node=node,
        local=rank % g,
        phases=phase_counts(phases, send_PQ.numpy(), recv_PQ.numpy(), n, g),
        owner_category_counts=v[:kept].tolist(),
        kept_N=v[kept:relay_in],
        relay_in_NG=v[relay_in:egress].reshape(n, g),
        egress_N=v[egress:source_round].tolist(),
        arrival_counts_NGM=v[arrival : arrival + n * g * m].reshape(n, g, m),
        source_round_N=v[source_round:arrival],
        num_copies=int(v[-1]),
    )
    return RankSchedule(schedule=schedule, view=view, layout_counts=layout_counts.numpy())
