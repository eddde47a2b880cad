"""``railwave bench-exchange``: time one dispatch + combine of every RailWave path next to
Megatron's ``alltoall`` dispatcher on CPU gloo over loopback, and count bytes per rail.

Letters: N nodes, G GPUs per node, R rails, W = N * G processes, T tokens per rank, E experts,
K top-k, H hidden.

W processes on this machine form one gloo group (EP = W); rank e plays GPU e % G of node e // G.
All variants see the same seeded routing (``workloads.synthetic_routing_maps``) and inputs; they run
interleaved (warm-ups, then round-robin per sample) and each sample keeps the slowest rank's time.
Loopback has no rails, so times measure software overhead (planning, index building, message
count, copies) rather than incast or rail imbalance; the bytes come from the plan.

The ``alltoall`` baseline drives ``MoEAlltoAllTokenDispatcher`` through its six hooks, with the
CPU shims of ``testing.megatron_cpu`` on a CPU-only torch. ``--no-alltoall`` skips it; without
``megatron-core`` it is skipped with a message. The JSON says why in ``alltoall_skipped``.

JSON written by ``--json``: see ``megatron_railwave.lab.bench.summary`` (schema
``railwave.bench_exchange/1``): ``config``, ``topology``, ``variants`` (median/P95/mean/min ms,
samples, phase medians, max error, ratio to alltoall), ``bytes`` (per path and alltoall:
inter-node rows and bytes, per-rail bytes, node-local bytes), ``summary`` (NATIVE/alltoall,
inter-node byte ratios), ``alltoall_skipped``, ``profile``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]

_MiB = float(1 << 20)
_VARIANTS = ("native", "rail", "perm", "joint", "alltoall")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-exchange",
        help="time dispatch+combine of each path vs Megatron alltoall on CPU gloo (loopback)",
        description="Interleaved CPU benchmark of one MoE dispatch + combine: RailWave native, "
        "rail, "
        "perm and joint next to Megatron's alltoall dispatcher, W local gloo processes, "
        "same seeded routing; also the bytes each path puts on every rail.",
    )
    _args.add_shape_args(
        parser,
        nodes=4,
        gpus_per_node=2,
        gpus_help="GPUs (processes) per node (W = N * G processes)",
        failed_rail=True,
    )
    _args.add_workload_args(
        parser,
        tokens=256,
        experts=32,
        topk=8,
        hidden=512,
        dtype="fp32",
        per="rank",
        experts_help="experts, a multiple of W",
        dtypes=("fp32", "bf16", "fp16"),
        seed_help="routing and input seed",
    )
    group = parser.add_argument_group("measurement")
    _args.add_flag(group, "--path", "all")
    _args.add_flag(group, "--warmups", 3, help="untimed rounds of every variant")
    _args.add_flag(group, "--samples", 20, help="timed rounds")
    group.add_argument(
        "--backward",
        action="store_true",
        help="also time the backward pass (dispatch+combine gradients)",
    )
    group.add_argument(
        "--no-alltoall",
        action="store_true",
        help="skip Megatron's alltoall baseline (default: time it when megatron-core is installed)",
    )
    _args.add_flag(
        group, "--timeout", 900.0, help="limit for the whole multi-process run in seconds"
    )
    group.add_argument(
        "--profile",
        choices=_VARIANTS,
        default=None,
        metavar="VARIANT",
        help="cProfile this variant's timed samples on rank 0 (native, ..., alltoall)",
    )
    group.add_argument(
        "--shared-expert",
        action="store_true",
        help="instead: the share of a shared expert's compute hidden behind dispatch+combine "
        "(moe_shared_expert_overlap), each path next to alltoall's own overlap",
    )
    group.add_argument(
        "--shared-ffn",
        type=int,
        default=None,
        metavar="F",
        help="--shared-expert: the shared expert's FFN size (default 4 x hidden)",
    )
    output = _args.add_output_args(parser, json="the result")
    _args.add_output_file(
        output,
        "--profile-out",
        metavar="FILE",
        help="write the --profile text here (default: print the top entries)",
    )
    parser.set_defaults(handler=run)


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--nodes", args.nodes, 1),
        ("--gpus-per-node", args.gpus_per_node, 1),
        ("--tokens", args.tokens, 1),
        ("--hidden", args.hidden, 1),
        ("--samples", args.samples, 1),
        ("--warmups", args.warmups, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.profile_out and not args.profile:
        raise ValueError("--profile-out needs --profile VARIANT")
    if args.shared_expert and (args.profile or args.backward):
        raise ValueError("--shared-expert times forward passes only; drop --profile / --backward")
    if args.shared_ffn is not None and not args.shared_expert:
        raise ValueError("--shared-ffn needs --shared-expert")


def _rows(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    wire = result["bytes"]
    for name, v in result["variants"].items():
        b = wire["alltoall"] if name == "alltoall" else wire["railwave"][name]
        rows.append(
            [
                name,
                v["median_ms"],
                v["p95_ms"],
                v["min_ms"],
                f"{v['over_alltoall']:.2f}x" if v["over_alltoall"] is not None else "-",
                b.get("inter_node_records", b.get("inter_node_entries")),
                b["inter_node_bytes"] / _MiB,
                " / ".join(f"{x / _MiB:.2f}" for x in b["rail_bytes_R"]),
                b["node_rail_imbalance"],
                b["node_local_bytes"] / _MiB,
                f"{v['max_abs_err']:.1e}",
            ]
        )
    return rows


def _run_shared_expert(args: argparse.Namespace, spec: Any, skipped: str | None) -> int:
    from megatron_railwave.lab.bench.shared_overlap import SharedOverlapSpec, run_shared_overlap

    shared_ffn = args.shared_ffn if args.shared_ffn is not None else 4 * args.hidden
    result = run_shared_overlap(
        SharedOverlapSpec(bench=spec, shared_ffn=shared_ffn),
        timeout_s=args.timeout,
        alltoall_skipped=skipped,
    )
    _render.print_table(
        f"shared expert (F={shared_ffn}) during dispatch+combine, forward, "
        f"{args.nodes}x{args.gpus_per_node} "
        f"({result['world_size']} gloo processes, loopback), T={args.tokens} H={args.hidden} "
        f"{args.dtype} "
        f"E={args.experts} K={args.topk}; {args.samples} samples, slowest rank per sample; shared "
        f"expert "
        f"alone {result['shared_ms']:.2f} ms",
        ["variant", "exchange ms", "exchange + shared ms", "hidden ms", "hidden share", "max err"],
        [
            [
                name,
                v["exchange_ms"],
                v["overlapped_ms"],
                v["hidden_ms"],
                f"{v['hidden_share']:.0%}" if v["hidden_share"] is not None else "-",
                f"{v['max_abs_err']:.1e}",
            ]
            for name, v in result["variants"].items()
        ],
    )
    if args.json:
        _common.write_json(args.json, result)
        _render.print_text(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    _check(args)
    from megatron_railwave.lab.bench import (
        ALLTOALL,
        NATIVE_GOALS,
        BenchSpec,
        alltoall_skip_reason,
        run_bench_exchange,
    )

    skipped = alltoall_skip_reason(args.no_alltoall)
    if skipped:
        _render.print_text(f"alltoall baseline skipped: {skipped}")
    paths = tuple(str(p) for p in _common.paths_from_choice(args.path))
    if args.profile == ALLTOALL and skipped:
        raise ValueError(
            f"--profile alltoall needs the alltoall baseline, which is skipped: {skipped}"
        )
    if args.profile and args.profile != ALLTOALL and args.profile not in paths:
        raise ValueError(
            f"--profile {args.profile} is not among the benchmarked paths {list(paths)}"
        )
    spec = BenchSpec(
        num_nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        dtype=args.dtype,
        seed=args.seed,
        warmups=args.warmups,
        samples=args.samples,
        backward=args.backward,
        paths=paths,
        alltoall=skipped is None,
        profile_variant=args.profile,
        failed_rails=tuple(sorted(args.failed_rail)),
    )
    spec.topology()  # validates nodes, GPUs and failed rails before any process starts
    if args.shared_expert:
        return _run_shared_expert(args, spec, skipped)
    result = run_bench_exchange(spec, timeout_s=args.timeout, alltoall_skipped=skipped)

    world = args.nodes * args.gpus_per_node
    _render.print_table(
        f"dispatch+combine{' + backward' if args.backward else ''}, "
        f"{args.nodes}x{args.gpus_per_node} "
        f"({world} gloo processes, loopback), T={args.tokens} H={args.hidden} {args.dtype} "
        f"E={args.experts} "
        f"K={args.topk}; {args.samples} samples, slowest rank per sample",
        [
            "variant",
            "median ms",
            "P95 ms",
            "min ms",
            "vs alltoall",
            "inter-node rows",
            "inter-node MiB",
            "MiB per rail",
            "node rail max/mean",
            "node-local MiB",
            "max err",
        ],
        _rows(result),
    )
    phase_names = sorted(
        {p for v in result["variants"].values() for p in v["phases_ms"]},
        key=["counts", "plan", "dispatch", "experts", "combine", "backward"].index,
    )
    _render.print_table(
        "phase medians (ms, slowest rank per sample; alltoall 'counts' = dispatch_preprocess)",
        ["variant"] + phase_names,
        [
            [n] + [v["phases_ms"].get(p, "-") for p in phase_names]
            for n, v in result["variants"].items()
        ],
    )
    _render.print_text(f"RailWave ops: {result['ops']}")
    s = result["summary"]
    if s["native_over_alltoall"] is not None:
        if s["native_goal"] is None:
            verdict = "no goal stated at this size; goals: " + ", ".join(
                f"T={t} H={h}: <= {g}x" for (t, h), g in NATIVE_GOALS.items()
            )
        else:
            verdict = (
                f"{'within' if s['native_within_goal'] else 'NOT within'} the "
                f"{s['native_goal']}x goal"
            )
        _render.print_text(
            f"NATIVE / alltoall median: {s['native_over_alltoall']:.2f}x ({verdict})"
        )
    if s["inter_node_records_ratio"] is not None:
        _render.print_text(
            "inter-node rows alltoall/railwave (dedup per destination node): "
            f"{s['inter_node_records_ratio']:.2f}x; "
            f"payload bytes {s['inter_node_payload_ratio']:.2f}x; wire bytes incl. probs+metadata "
            f"{s['inter_node_wire_ratio']:.2f}x"
        )
    if result["profile"]:
        if args.profile_out:
            Path(args.profile_out).write_text(result["profile"])
            _render.print_text(f"wrote profile of {args.profile} (rank 0) to {args.profile_out}")
        else:
            _render.print_text(result["profile"])
    if args.json:
        _common.write_json(args.json, result)
        _render.print_text(f"wrote {args.json}")
    return 0
