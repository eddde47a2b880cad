"""``railwave call-costs``: per-call costs of the exchange on CPU (count exchange, fixed cost per
phase, RailBalance's planning steps, fixed-capacity mode's online timing reduce), for the flow
model's per-call cost fields.

Letters: N nodes, G GPUs per node, W = N * G processes, T tokens per rank, H hidden.

W gloo processes on loopback run the exchange (``bench.call_costs``; the module docstring says
what each number is); the in-process virtual cluster runs the same rank programs without a
transport. These are CPU software costs; GPU / NCCL / DeepEP values are not yet measured.

JSON written by ``--json`` (schema ``railwave.call_costs/1``): ``spec``, ``topology``,
``gloo`` (``steps``: median / p10 / p90 microseconds per step, slowest rank per sample;
``phases_per_call`` and ``move_us`` per path; ``per_phase_fit``: per_phase_us, fixed_us, r2;
``railbalance_us``) and ``virtual`` (count exchange and per path move time and phases per rank).
"""

from __future__ import annotations

import argparse

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "call-costs",
        help="measure the exchange's per-call costs on CPU (count exchange, per phase, "
        "RailBalance)",
        description="Time the count exchange, an empty phase on the rail and node groups, a node "
        "barrier and every path's plan / prepare / dispatch / combine at a small payload on "
        "W gloo processes (loopback), fit a per-phase cost, and repeat on the virtual cluster.",
    )
    _args.add_shape_args(parser, nodes=4, gpus_per_node=2, gpus_help="GPUs (processes) per node")
    _args.add_workload_args(
        parser,
        tokens=128,
        experts=32,
        topk=8,
        hidden=64,
        per="rank",
        experts_help="experts, a multiple of W",
    )
    group = parser.add_argument_group("measurement")
    _args.add_flag(group, "--warmups", 5, help="untimed calls per step")
    _args.add_flag(group, "--samples", 30, help="timed calls per step")
    group.add_argument(
        "--no-virtual", action="store_true", help="skip the virtual-cluster measurement"
    )
    _args.add_flag(group, "--timeout", 600.0, help="limit for the multi-process run in seconds")
    _args.add_output_args(parser, json="the result")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.bench.call_costs import CallCostSpec, measure_call_costs

    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    spec = CallCostSpec(
        num_nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        seed=args.seed,
        warmups=args.warmups,
        samples=args.samples,
    )
    result = measure_call_costs(spec, timeout_s=args.timeout, virtual=not args.no_virtual)
    g = result["gloo"]
    steps = g["steps"]
    world = args.nodes * args.gpus_per_node
    _render.print_table(
        f"per-call costs, {args.nodes}x{args.gpus_per_node} ({world} gloo processes, loopback), "
        f"T={args.tokens} "
        f"H={args.hidden}; {args.samples} samples, slowest rank per sample (us)",
        ["step", "median", "p10", "p90"],
        [[name, s["median_us"], s["p10_us"], s["p90_us"]] for name, s in steps.items()],
    )
    fit = g["per_phase_fit"]
    _render.print_table(
        "dispatch + combine per path",
        ["path", "phases per call", "move us (median)"],
        [[p, g["phases_per_call"][p], g["move_us"][p]] for p in g["phases_per_call"]],
    )
    rb = g["railbalance_us"]
    _render.print_text(
        f"count exchange {steps['count_exchange']['median_us']:.0f} us; empty phase rail "
        f"{steps['empty_phase_rail']['median_us']:.0f} us, node "
        f"{steps['empty_phase_node']['median_us']:.0f} us; "
        f"fit: {fit['per_phase_us']:.0f} us per phase + {fit['fixed_us']:.0f} us (r2 "
        f"{fit['r2']:.2f}); "
        f"RailBalance quota (plan RAIL - NATIVE) {rb['quota_rail_minus_native']:.0f} us, node "
        f"barrier "
        f"{rb['node_barrier']:.0f} us; fixed-capacity online timing reduce: post "
        f"{steps['timing_reduce_post']['median_us']:.0f} us, read an epoch later "
        f"{steps['timing_reduce_read']['median_us']:.0f} us. CPU gloo numbers: GPU / NCCL / "
        f"DeepEP values are "
        "not yet measured."
    )
    if "virtual" in result:
        v = result["virtual"]
        _render.print_table(
            f"virtual cluster (host work per rank, no transport): count exchange "
            f"{v['count_exchange_us_per_rank']:.0f} us",
            ["path", "phases per rank", "move us per rank", "plan us"],
            [
                [p, d["phases_per_rank"], d["move_us_per_rank"], d["plan_us"]]
                for p, d in v["paths"].items()
            ],
        )
        _render.print_text(
            f"RailBalance quota step on the host (plan RAIL - NATIVE, one process): "
            f"{v['quota_rail_minus_native_us']:.0f} us; JOINT - PERM "
            f"{v['quota_joint_minus_perm_us']:.0f} us"
        )
    if args.json:
        _common.write_json(args.json, result)
        _render.print_text(f"wrote {args.json}")
    return 0
