"""``railwave plan``: plan one layer of synthetic routing on a cluster and print / save the plan.

Letters: N nodes, R rails, T tokens per rank, E experts, K top-k, H hidden size.

JSON written by ``--json`` for one path (``--path all`` writes the same keys per path under
``plans`` plus the shared ``topology`` and ``workload``)::

    path, topology, workload, phase, schedule_kind,
    waves          [V][pairs][2]  (src node, dst node) of each wave / sending window
    rail_load      [N][R][N]      records node s sends on rail r to node d (local pairs: owner rail)
    records_total, relayed_records,
    stats          B_mean_bytes, B_max_bytes, rho_g, kappa, coords, records_total, remote_records
    plan_ms        rank 0's planning time per layer (records + build_plan + schedule + index maps,
                   ``bench.planning``)
    plan_ms_parts  the four parts and the number of timed repeats
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_railwave.commands import _common, _outputs, _render
from megatron_railwave.lab.bench.planning import time_rank_planning
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = ["register", "run", "plan_layer"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan one layer (rails, waves, descriptors) for synthetic routing",
        description="Plan one MoE layer of seeded synthetic routing on a cluster: per-rail egress, "
        "waves and traffic descriptors of each path.",
    )
    _common.add_cluster_args(parser)
    _common.add_workload_args(parser)
    _common.add_plan_args(parser)
    parser.add_argument("--repeats", type=int, default=5, help="timed planning repeats (default 5)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the plan(s) as JSON")
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("json",))


def plan_layer(
    topo: RailTopology,
    *,
    paths: list[Route],
    num_tokens: int,
    num_experts: int,
    topk: int,
    seed: int,
    record_bytes: int,
    options: PlanOptions,
    phase: int = 0,
    repeats: int = 5,
    verbose: bool = True,
) -> dict[str, Any]:
    """Route, count and plan one layer on every path; print the summary when ``verbose``.

    Returns:
        ``{"topology", "workload", "plans": [per-path JSON dict]}`` (see the module docstring).
    """
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
    plans, desc_rows = [], []
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
        data = plan.to_json(record_bytes=record_bytes)
        data["workload"] = workload
        data["plan_ms"] = timing.total_ms
        data["plan_ms_parts"] = timing.to_dict()
        plans.append(data)
        stats = plan.stats(record_bytes=record_bytes)
        desc_rows.append((str(path), stats, plan.relayed_records(), timing.total_ms))
        if verbose:
            _render.print_rail_egress(plan, record_bytes=record_bytes)
            _render.print_waves(plan)
    if verbose:
        failed = sorted(topo.failed_rails)
        _render.print_text(
            f"{topo.name}: {topo.num_nodes} nodes x {topo.gpus_per_node} GPUs, {topo.num_rails} "
            f"rails"
            + (f", failed rails {failed}" if failed else "")
            + f"; T={num_tokens} E={num_experts} K={topk} record {record_bytes} B; "
            f"{plans[0]['records_total']} records"
        )
        _render.print_descriptors(desc_rows)
    return {"topology": topo.to_dict(), "workload": workload, "plans": plans}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # plan_ms is one rank's single-core planning time
    topo = _common.cluster_from_args(args)
    _common.check_workload_args(args, topo)
    record_bytes = _common.record_bytes_from_args(args)
    options = _common.options_from_args(args, topo)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    result = plan_layer(
        topo,
        paths=_common.paths_from_choice(args.path),
        num_tokens=args.tokens,
        num_experts=args.experts,
        topk=args.topk,
        seed=args.seed,
        record_bytes=record_bytes,
        options=options,
        phase=args.phase,
        repeats=args.repeats,
    )
    if args.json:
        out = result["plans"][0] if args.path != "all" else result
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    return 0
