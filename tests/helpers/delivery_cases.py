"""Demands whose target bits are independent, and the compiled schedule's dispatch delivery
rounds: what the arrival model and the path model's round loads are checked against (test-only)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, PlanOptions, build_plan
from megatron_railwave.schedule import PhaseKind, RecordWireFormat, compile_schedule
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

WIRE = RecordWireFormat(
    hidden=8, payload_dtype=torch.float32, probs_dtype=torch.float32, experts_per_node=8
)


def subset_demand(topo: RailTopology, rng: np.random.Generator) -> DemandCounts:
    """Every owner sends each other node the same number of records with every non-empty subset
    of its own set of target GPUs: bits independent (1/2 on the set) at integer counts, so the
    arrival model is exact, and the mask order inside a list (which bit sorts first, which end
    is kept) decides the result."""
    w, n, m = topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node
    wnm = torch.zeros(w, n, m, dtype=torch.int64)
    for r in range(w):
        for d in range(n):
            support, k = int(rng.integers(1, m)), int(rng.integers(0, 8))
            for mask in range(1, m):
                if mask & ~support == 0:
                    wnm[r, d, mask] = k
    return DemandCounts(records_WNM=wnm)


def dispatch_deliveries(
    demand: DemandCounts, topo: RailTopology, path: Route, chunks: int
) -> tuple[PathPlan, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]]:
    """The plan, and (round, source ranks, destination ranks, rows) of every dispatch delivery
    round of its compiled schedule (round 0: the local round), copies that stay on their GPU
    included."""
    plan = build_plan(demand, topo, path, options=PlanOptions(chunks=chunks))
    schedule = compile_schedule(plan, WIRE, demand=demand)
    rounds = []
    for phase in schedule.phases:
        if phase.kind == PhaseKind.DELIVER and not phase.name.startswith("combine"):
            src, dst, rows = (t.numpy() for t in schedule.transfers(phase))
            rounds.append((phase.step, src, dst, rows))
    return plan, rounds
