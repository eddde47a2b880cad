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

The planning and its timing are ``lab.bench.plan_bench.plan_layer``'s.
"""

from __future__ import annotations

import argparse

import torch

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.lab.bench.plan_bench import PlannedLayer, plan_layer

__all__ = ["register", "run", "print_planned_layer"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan one layer (rails, waves, descriptors) for synthetic routing",
        description="Plan one MoE layer of seeded synthetic routing on a cluster: per-rail egress, "
        "waves and traffic descriptors of each path.",
    )
    _args.add_cluster_args(parser)
    _args.add_workload_args(
        parser,
        tokens=4096,
        experts=128,
        topk=8,
        hidden=4096,
        dtype="bf16",
        experts_help="routed experts, divisible by the world size",
    )
    _args.add_plan_args(parser)
    parser.add_argument("--repeats", type=int, default=5, help="timed planning repeats (default 5)")
    _args.add_output_args(parser, json="the plan(s)")
    parser.set_defaults(handler=run)


def print_planned_layer(layer: PlannedLayer) -> None:
    """Per path its rail egress and waves, then the layer's summary line and descriptors."""
    topo, work = layer.topology, layer.workload
    record_bytes = work["record_bytes"]
    for plan in layer.plans:
        _render.print_rail_egress(plan, record_bytes=record_bytes)
        _render.print_waves(plan)
    failed = sorted(topo.failed_rails)
    _render.print_text(
        f"{topo.name}: {topo.num_nodes} nodes x {topo.gpus_per_node} GPUs, {topo.num_rails} "
        f"rails"
        + (f", failed rails {failed}" if failed else "")
        + f"; T={work['tokens_per_gpu']} E={work['experts']} K={work['topk']} record "
        f"{record_bytes} B; {layer.plan_json(0)['records_total']} records"
    )
    _render.print_descriptors(
        [
            (
                str(plan.path),
                plan.stats(record_bytes=record_bytes),
                plan.relayed_records(),
                t.total_ms,
            )
            for plan, t in zip(layer.plans, layer.timings)
        ]
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # plan_ms is one rank's single-core planning time
    topo = _common.cluster_from_args(args)
    _common.check_workload_args(args, topo)
    record_bytes = _common.record_bytes_from_args(args)
    options = _common.options_from_args(args, topo)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    layer = plan_layer(
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
    print_planned_layer(layer)
    if args.json:
        out = layer.plan_json(0) if args.path != "all" else layer.to_json()
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    return 0
