"""``railwave netmodel``: the flow model's own tools.

* ``fit-incast``: fit the incast alpha to the paper's incast experiment
  (``netmodel.calibrate.calibrate_incast``), replay the paper's UltraEP case on the fitted model
  as a cross-check (4-node clusters) and write the model YAML (``--write-model``, the
  ``megatron_railwave/configs/netmodel/`` files; ``--out`` before, deprecated).
* ``bench-engine``: time the max-min engine on rail all-to-all flow sets
  (``netmodel.bench_engine.time_engine``); JSON: one row per case.
"""

from __future__ import annotations

import argparse

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "netmodel",
        help="flow-model tools: fit the incast alpha, time the engine",
        description="Tools of the flow-level network model (docs/netmodel.md).",
    )
    sub = parser.add_subparsers(dest="netmodel_command", metavar="ACTION", required=True)

    fit = sub.add_parser(
        "fit-incast",
        help="fit the incast alpha to the paper's incast experiment",
        description="Replay the paper's incast experiment (GLM-4.5-Air, RING vs EXTREME "
        "windows, NATIVE) on the flow model and fit alpha to its slowdown.",
    )
    _args.add_cluster_args(fit, default="h800_4x8", overrides=False)
    _args.add_workload_args(fit, tokens=2048)
    fit.add_argument(
        "--delivery",
        choices=_args.DELIVERIES,
        default="after_rail",
        help="NVLink delivery model (default after_rail, as the exchange runs it)",
    )
    fit.add_argument(
        "--k-sat",
        type=int,
        default=2,
        help="incast saturation: excess senders after which the loss stops growing (default 2)",
    )
    fit.add_argument(
        "--max-alpha",
        type=float,
        default=8.0,
        help="upper end of the alpha search (default 8: a port with 3 senders at 6%% goodput)",
    )
    output = _args.add_output_args(fit)
    _args.add_output_file(
        output,
        "--write-model",
        metavar="YAML",
        help="write the fitted model here (like the packaged configs/netmodel/*.yaml)",
        renamed_from="--out",
    )
    fit.set_defaults(handler=_fit_incast)

    bench = sub.add_parser(
        "bench-engine",
        help="time the max-min engine on rail all-to-all flow sets",
        description="Time netmodel.simulate on rail-aligned all-to-all flow sets "
        "(all at once and in N-1 waves, uniform and random sizes).",
    )
    bench.add_argument(
        "--nodes", type=int, nargs="+", default=[4, 64, 256], help="node counts (default 4 64 256)"
    )
    bench.add_argument("--gpus-per-node", type=int, default=8, help="G (default 8)")
    bench.add_argument(
        "--sizes",
        nargs="+",
        choices=["uniform", "random"],
        default=["uniform", "random"],
        help="flow size patterns (default both)",
    )
    bench.add_argument(
        "--rel-tol",
        type=float,
        nargs="+",
        default=[1e-3, 1e-2],
        help="event batching tolerances (default 1e-3 1e-2)",
    )
    _args.add_flag(bench, "--alpha", 0.0, default_text="0: pure max-min")
    _args.add_output_args(bench, json="the rows")
    bench.set_defaults(handler=_bench_engine)


def _fit_incast(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.netmodel import NetModelConfig
    from megatron_railwave.lab.netmodel.calibrate import (
        calibrate_incast,
        is_ultraep_cluster,
        ultraep_check,
        write_config,
    )

    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    topo = _common.cluster_from_args(args)
    if args.k_sat < 1 or not args.max_alpha > 0:
        raise ValueError(
            f"need --k-sat >= 1 and --max-alpha > 0, got {args.k_sat}, {args.max_alpha}"
        )
    base = NetModelConfig(delivery=args.delivery, k_sat=args.k_sat)
    calib = calibrate_incast(
        topo,
        base=base,
        tokens=args.tokens,
        seed=args.seed,
        log=_render.print_text,
        bounds=(0.0, args.max_alpha),
        tol=2e-3,
    )
    _render.print_text(
        f"alpha = {calib.model.alpha} (ratio {calib.fitted_ratio:.4f}, target "
        f"{calib.target_ratio:.4f}); "
        f"RING {calib.low_s:.3f} s, EXTREME {calib.high_s:.3f} s; {calib.seconds:.0f} s"
    )
    check = ultraep_check(topo, calib.model) if is_ultraep_cluster(topo) else []
    if not check:
        _render.print_text("cross-check skipped: the paper's UltraEP case ran on 4 nodes x 8 GPUs")
    for row in check:
        _render.print_text(
            f"cross-check, the paper's UltraEP case (3 source nodes -> 1, balanced rails, "
            f"{row.mib_per_gpu:g} MiB per "
            f"source GPU): PERM over NATIVE {row.dispatch_speedup:.2f}x dispatch, "
            f"{row.total_speedup:.2f}x dispatch + "
            f"combine (paper, H800: {row.paper_speedup}x per all-to-all)"
        )
    if args.write_model:
        write_config(args.write_model, calib, cluster=args.cluster, cross_check=check)
        _render.print_text(f"wrote {args.write_model}")
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.netmodel.bench_engine import time_engine

    if args.gpus_per_node < 1 or any(t < 0 for t in args.rel_tol):
        raise ValueError(
            f"need --gpus-per-node >= 1 and --rel-tol >= 0, got {args.gpus_per_node}, "
            f"{args.rel_tol}"
        )
    rows = []
    _render.print_text(
        f"{'nodes':>5} {'gpus':>4} {'pattern':>11} {'sizes':>7} {'rel_tol':>7} {'flows':>8} "
        f"{'events':>7} {'makespan_ms':>11} {'seconds':>8} {'cpu_s':>8}"
    )
    for row in time_engine(
        args.nodes, args.gpus_per_node, sizes=args.sizes, rel_tols=args.rel_tol, alpha=args.alpha
    ):
        rows.append(row)
        _render.print_text(
            f"{row['nodes']:>5} {row['gpus_per_node']:>4} {row['pattern']:>11} {row['sizes']:>7} "
            f"{row['rel_tol']:>7.0e} {row['flows']:>8} {row['events']:>7} "
            f"{1e3 * row['makespan_s']:>11.3f} "
            f"{row['seconds']:>8.2f} {row['cpu_seconds']:>8.2f}"
        )
    if args.json:
        _common.write_json(args.json, {"rows": rows})
        _render.print_text(f"wrote {args.json}")
    return 0
