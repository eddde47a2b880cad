"""Planning of synthetic layers and one rank's planning time (``railwave plan``, ``demo`` and
``plan-bench``).

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, E experts, K top-k,
R rails, V waves, M = 2**G target masks.

``plan_layer``: one layer of ``workloads.synthetic_routing_maps`` routing planned on every path,
with rank 0's planning timed (``bench.planning.time_rank_planning``); ``PlannedLayer.to_json`` is
the JSON of ``railwave plan`` (see there).

``bench_config`` (``railwave plan-bench``): one rank's CPU planning time per layer at a cluster
size.

What is timed, per layer, on one thread (``torch.set_num_threads(1)``), for the measured rank
(``bench.planning``): its records (``ops.records_from_routing``), ``build_plan`` from the node view
of the gathered ``DemandCounts``, ``compile_schedule`` + ``rank_view``, and the device index maps
(``exchange.layout.build_layout``, here on the CPU); warm-up runs, then the median of ``--repeats``
runs (``ms_per_layer``, wall time), with the median CPU time of the thread (``cpu_ms_per_layer``: on
a shared machine it leaves out the time slices given to other processes) and the fastest run
(``min_ms_per_layer``). Not timed: the count gather (a collective) and the data movement.

Demand: up to ``--full-routing-max-ranks`` ranks every rank's routing map comes from
``workloads.synthetic_routing_maps``. Beyond that, generating W routing maps is too slow, so a few
prototype ranks of node 0 get real synthetic routing maps (same model: log-normal expert popularity,
a per-rank bonus for its own node's experts) and every other rank w of node s copies the counts of
prototype ``w mod P`` with destinations shifted by s (node n -> node (n + s) mod N). The measured
rank 0 is prototype 0, so the records it routes are real and match the gathered counts.

Experts: E must divide by W; when ``--experts`` does not, the next multiple of W is used
(128 experts on 32x8 -> 256, on 128x8 -> 1024: one expert per rank) and the JSON says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_railwave.lab.bench.planning import RankTiming, time_rank_planning
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, PlanOptions
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, local_demand

__all__ = ["PlannedLayer", "plan_layer", "bench_config", "experts_for"]


@dataclass(frozen=True, slots=True)
class PlannedLayer:
    """One synthetic layer planned on some paths (``plan_layer``)."""

    topology: RailTopology
    workload: dict[str, Any]
    """tokens_per_gpu, experts, topk, seed, record_bytes, generator."""
    plans: list[PathPlan]
    timings: list[RankTiming]
    """Rank 0's planning time of each plan."""

    def plan_json(self, index: int) -> dict[str, Any]:
        """The JSON of one path's plan: ``PathPlan.to_json`` plus the workload and the timing."""
        data = self.plans[index].to_json(record_bytes=self.workload["record_bytes"])
        data["workload"] = self.workload
        data["plan_ms"] = self.timings[index].total_ms
        data["plan_ms_parts"] = self.timings[index].to_dict()
        return data

    def to_json(self) -> dict[str, Any]:
        """``{"topology", "workload", "plans": [per-path JSON]}``."""
        return {
            "topology": self.topology.to_dict(),
            "workload": self.workload,
            "plans": [self.plan_json(i) for i in range(len(self.plans))],
        }


def plan_layer(
    topo: RailTopology,
    *,
    paths: Sequence[Route],
    num_tokens: int,
    num_experts: int,
    topk: int,
    seed: int,
    record_bytes: int,
    options: PlanOptions,
    phase: int = 0,
    repeats: int = 5,
) -> PlannedLayer:
    """Route, count and plan one layer on every path of ``paths``, timing rank 0's planning."""
    maps = synthetic_routing_maps(
        topo, num_tokens=num_tokens, num_experts=num_experts, topk=topk, seed=seed
    )
    demand = DemandCounts.from_routing_maps(maps, topo)
    workload = {
        "tokens_per_gpu": num_tokens,
        "experts": num_experts,
        "topk": topk,
        "seed": seed,
        "record_bytes": record_bytes,
        "generator": "workloads.synthetic_routing_maps",
    }
    plans, timings = [], []
    for path in paths:
        plan, timing = time_rank_planning(
            demand,
            topo,
            path,
            rank=0,
            routing_TE=maps[0],
            options=options,
            phase=phase,
            repeats=repeats,
        )
        plans.append(plan)
        timings.append(timing)
    return PlannedLayer(topology=topo, workload=workload, plans=plans, timings=timings)


def _prototype_demand(
    topo: RailTopology, *, num_tokens: int, num_experts: int, topk: int, seed: int, num_protos: int
) -> tuple[DemandCounts, torch.Tensor]:
    """Counts of W ranks from ``num_protos`` real routing maps of node-0 ranks (module docstring).

    Returns:
        (demand, routing_map_TE of rank 0).
    """
    n, g = topo.num_nodes, topo.gpus_per_node
    # Real routing of the first P ranks of a one-node-wider slice: same model and seed as the
    # full generator, on a cluster whose first node is what the prototypes see.
    protos = _node0_routing_maps(
        topo, num_tokens=num_tokens, num_experts=num_experts, topk=topk, seed=seed, count=num_protos
    )
    parts = [local_demand(r, topo) for r in protos]
    rec_PNM = torch.stack([p[0] for p in parts])
    exp_PE = torch.stack([p[1] for p in parts])
    w = torch.arange(topo.world_size)
    proto_W = w % num_protos
    src_W = w // g
    dst_N = torch.arange(n)
    # Rank w on node s sends to node (n + s) mod N what its prototype (on node 0) sends to node n.
    shifted_WN = (dst_N.unsqueeze(0) - src_W.unsqueeze(1)) % n  # prototype's destination index
    records_WNM = rec_PNM[proto_W.unsqueeze(1), shifted_WN]
    experts_WE = exp_PE[proto_W]
    return DemandCounts(records_WNM=records_WNM, experts_WE=experts_WE), protos[0]


def _node0_routing_maps(
    topo: RailTopology, *, num_tokens: int, num_experts: int, topk: int, seed: int, count: int
) -> list[torch.Tensor]:
    """[T, E] bool routing maps of ``count`` ranks on node 0 of ``topo``.

    The model of ``workloads.synthetic_routing_maps`` (log-normal expert popularity with max/mean
    about 8, Gumbel top-k, a per-rank bonus uniform in [0, 6] for the rank's own node's experts)
    drawn for these ranks only, so that the cost does not grow with W.
    """
    gen = torch.Generator().manual_seed(int(seed))
    sigma = math.sqrt(2 * math.log(8.0)) / max(math.sqrt(2 * math.log(num_experts)), 1.0) * 1.6
    log_pop = torch.randn(num_experts, generator=gen) * sigma
    own_node = (torch.arange(num_experts) < num_experts // topo.num_nodes).to(torch.float32)
    out = []
    for _ in range(count):
        bonus = float(torch.rand((), generator=gen)) * 6.0
        u = torch.rand(num_tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
        scores = -torch.log(-torch.log(u)) + log_pop + bonus * own_node
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        routing.scatter_(1, scores.topk(topk, dim=1).indices, True)
        out.append(routing)
    return out


def experts_for(num_experts: int, world: int) -> int:
    return num_experts if num_experts % world == 0 else world * math.ceil(num_experts / world)


def bench_config(
    num_nodes: int,
    gpus_per_node: int,
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    paths: Sequence[Route | str],
    fanin: int,
    seed: int,
    warmup: int,
    repeats: int,
    full_routing_max_ranks: int,
) -> list[dict[str, Any]]:
    """Time rank 0's per-layer planning on an N x G cluster; one result row per path of
    ``paths`` (the JSON rows of ``railwave plan-bench``)."""
    topo = RailTopology(
        num_nodes=num_nodes, gpus_per_node=gpus_per_node, name=f"{num_nodes}x{gpus_per_node}"
    )
    world = topo.world_size
    experts = experts_for(num_experts, world)
    if topk > experts:
        raise ValueError(f"--topk {topk} exceeds the {experts} experts of config {topo.name}")
    if world <= full_routing_max_ranks:
        maps = synthetic_routing_maps(
            topo, num_tokens=num_tokens, num_experts=experts, topk=topk, seed=seed
        )
        demand, routing_TE = DemandCounts.from_routing_maps(maps, topo), maps[0]
        source = "synthetic_routing_maps (every rank)"
    else:
        protos = min(world, 8)
        demand, routing_TE = _prototype_demand(
            topo,
            num_tokens=num_tokens,
            num_experts=experts,
            topk=topk,
            seed=seed,
            num_protos=protos,
        )
        source = f"{protos} prototype routing maps, node-shifted counts"
    # Rank 0 plans from what the exchange gathers: per-node totals of every rank and the masks
    # of the records into its own node (not the full W x N x M table).
    demand = DemandCounts(
        records_WN=demand.records_WN, view_node=0, view_masks_WM=demand.masks_into(0)
    )
    options = PlanOptions(fanin=fanin)
    rows = []
    for path in paths:
        plan, timing = time_rank_planning(
            demand,
            topo,
            path,
            rank=0,
            routing_TE=routing_TE,
            options=options,
            warmup=warmup,
            repeats=repeats,
        )
        rows.append(
            {
                "nodes": num_nodes,
                "gpus_per_node": gpus_per_node,
                "world_size": world,
                "path": str(path),
                "tokens_per_gpu": num_tokens,
                "experts": experts,
                "experts_note": (
                    f"--experts {num_experts} does not divide W={world}; used {experts} "
                    f"({experts // world} per rank)"
                )
                if experts != num_experts
                else "",
                "topk": topk,
                "num_waves": plan.num_waves,
                "rank_records": int(plan.records_NNG[0, :, 0].sum()),
                "demand_source": source,
                "demand_view": "node 0: records_WN + masks into node 0 (what the exchange gathers)",
                **timing.to_dict(),
            }
        )
    return rows
