"""One rank's per-layer planning cost, as the exchange pays it.

Letters: T tokens of the rank, E experts, N nodes, W ranks.

Timed steps (the host and index work of a layer besides the data movement):
  * records: ``ops.records_from_routing`` on the rank's routing map (the count step's local work);
  * plan: ``build_plan`` from the node view of the gathered counts (pure, host);
  * schedule: ``schedule.compile_for_rank`` (the schedule with this node's deliveries, the rank
    view and the layout's counts: one ``ops.rank_schedule`` call where the compiled ops load,
    else ``compile_schedule`` + ``rank_view``), as the exchange runs it;
  * layout: ``exchange.layout.build_layout`` (egress via ``ops.assign_egress``, relay / egress /
    delivery index maps).
Medians over repeats after warm-ups; wall and thread CPU time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from megatron_railwave import ops
from megatron_railwave.exchange.layout import build_layout
from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, PlanOptions, build_plan
from megatron_railwave.schedule import MaskSource, RecordWireFormat, compile_for_rank
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = ["RankTiming", "time_rank_planning", "node_view"]

_STEPS = ("records", "build_plan", "schedule", "layout")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTiming:
    """Median per-layer planning time of one rank, in milliseconds."""

    records_ms: float
    build_plan_ms: float
    schedule_ms: float
    layout_ms: float
    total_ms: float
    """Median wall time of the four steps together."""
    cpu_ms: float
    """Median CPU time of this thread for the four together: unlike wall time it excludes time
    the OS gave to other processes, so it is the planning cost on a shared machine."""
    min_ms: float
    """Fastest wall time of the four together."""
    repeats: int

    def to_dict(self) -> dict[str, float | int]:
        return {
            "records_ms": self.records_ms,
            "build_plan_ms": self.build_plan_ms,
            "schedule_ms": self.schedule_ms,
            "layout_ms": self.layout_ms,
            "ms_per_layer": self.total_ms,
            "cpu_ms_per_layer": self.cpu_ms,
            "min_ms_per_layer": self.min_ms,
            "repeats": self.repeats,
        }


def node_view(demand: DemandCounts, node: int) -> DemandCounts:
    """What a rank of ``node`` gathers: every rank's per-node totals and the masks into ``node``."""
    return DemandCounts(
        records_WN=demand.records_WN, view_node=node, view_masks_WM=demand.masks_into(node)
    )


def time_rank_planning(
    demand: DemandCounts | MaskSource,
    topo: RailTopology,
    path: Route | str,
    *,
    rank: int,
    routing_TE: torch.Tensor,
    options: PlanOptions | None = None,
    phase: int = 0,
    warmup: int = 2,
    repeats: int = 5,
    hidden: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[PathPlan, RankTiming]:
    """One rank's planning work for one layer, timed (module docstring).

    Args:
        demand: the gathered counts (a node view of the rank's node, the full counts, or a
            ``workloads.SparseDemand``: anything with ``records_NGN()`` and ``masks_into(node)``).
        rank: the EP rank whose records ``routing_TE`` holds.
        routing_TE: [T, E] bool routing map of ``rank``, consistent with ``demand``.

    Returns:
        (the plan, medians over ``repeats`` runs after ``warmup`` untimed ones).
    """
    node = topo.node_of(rank)
    records_NGN = demand.records_NGN()
    num_records = int(records_NGN[node, topo.local_of(rank)].sum())
    wire = RecordWireFormat(
        hidden=hidden,
        payload_dtype=dtype,
        probs_dtype=torch.float32,
        experts_per_node=routing_TE.shape[1] // topo.num_nodes,
    )
    samples: list[list[float]] = []
    cpu: list[float] = []
    plan = None
    for i in range(warmup + repeats):
        c0 = time.thread_time()
        t = [time.perf_counter()]
        token_C, node_C, _, _ = ops.records_from_routing(
            routing_TE, topo.num_nodes, topo.gpus_per_node
        )
        t.append(time.perf_counter())
        plan = build_plan(records_NGN, topo, path, options=options, phase=phase)
        t.append(time.perf_counter())
        compiled = compile_for_rank(plan, wire, demand=demand, node=node, rank=rank)
        t.append(time.perf_counter())
        build_layout(
            plan,
            compiled.view,
            token_R=token_C[:num_records],
            node_R=node_C[:num_records],
            counts=compiled.layout_counts,
        )
        t.append(time.perf_counter())
        c1 = time.thread_time()
        if i >= warmup:
            samples.append([b - a for a, b in zip(t, t[1:])])
            cpu.append(c1 - c0)
    assert plan is not None and samples
    med = [statistics.median(s[k] for s in samples) * 1e3 for k in range(len(_STEPS))]
    totals = [sum(s) for s in samples]
    return plan, RankTiming(
        records_ms=med[0],
        build_plan_ms=med[1],
        schedule_ms=med[2],
        layout_ms=med[3],
        total_ms=statistics.median(totals) * 1e3,
        cpu_ms=statistics.median(cpu) * 1e3,
        min_ms=min(totals) * 1e3,
        repeats=repeats,
    )
