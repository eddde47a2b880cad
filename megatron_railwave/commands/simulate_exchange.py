"""``railwave simulate-exchange``: every path of one layer on the in-process virtual cluster.

All W ranks of ``--cluster`` run in this process on one device (``--device cpu`` or ``cuda``),
through the same rank programs as the distributed exchange, on one seeded routing. Prints, per
path: bitwise equality with the first path (outputs and gradients of every rank), the max
relative error against the dense float64 reference, host syncs per layer per rank (forward +
backward), the wall time and the bytes the schedules send over rails and NVLink; ``--json`` writes
the report (``bench.virtual_exchange``).
With ``--max-tokens-per-rank C`` the layer runs in fixed-capacity mode, and each path also runs
in the normal mode on the same inputs: the table adds bitwise equality to the normal mode and
the normal mode's syncs and time. Exits 1 when the paths differ (from each other or, in
fixed-capacity mode, from the normal mode) or the error exceeds ``--max-error``.
"""

from __future__ import annotations

import argparse

import torch

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate-exchange",
        help="run every path of one layer on an in-process virtual cluster (equality, error, "
        "syncs)",
        description="Run dispatch + combine, forward and backward, of every path for all ranks of "
        "a "
        "cluster in one process on one device, with seeded routing and linear experts.",
    )
    _args.add_cluster_args(parser)
    _args.add_workload_args(
        parser,
        tokens=512,
        experts=128,
        topk=8,
        hidden=256,
        dtype="fp32",
        per="rank",
        dtypes=("fp32", "bf16"),
        seed_help="routing and data seed",
    )
    _args.add_flag(parser, "--device", "cpu")
    parser.add_argument(
        "--max-tokens-per-rank",
        type=int,
        default=None,
        metavar="C",
        help="fixed-capacity mode: buffers sized for C tokens per rank, no host sync "
        "(C >= --tokens; default: the normal mode)",
    )
    _args.add_flag(parser, "--chunks", 1, default_text="1: whole waves")
    parser.add_argument(
        "--max-error",
        type=float,
        default=None,
        help="fail when a relative error exceeds this (default 1e-5 for fp32, 2e-2 for bf16)",
    )
    parser.add_argument(
        "--max-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="refuse to start when the estimated peak device memory of this run "
        "(lab.bench.virtual_exchange.estimate_peak_bytes) exceeds GIB (default: no limit)",
    )
    parser.add_argument(
        "--expect-host-syncs",
        type=float,
        default=None,
        metavar="N",
        help="fail (exit 1) when any path's host syncs per layer per rank differ from N "
        "(the device check asserts 1 in the normal mode, 0 in fixed-capacity mode)",
    )
    parser.add_argument(
        "--require-compiled",
        action="store_true",
        help="fail (exit 1) when the compiled railwave ops do not serve --device (a run on the "
        "pure-torch fallback checks nothing about the kernels)",
    )
    _args.add_output_args(parser, json="the report")
    parser.set_defaults(handler=run)


def _megabytes(wire: dict[str, int]) -> str:
    """Bytes all ranks send per layer (forward + backward) over rails / NVLink, in MB."""
    return f"{wire['rail'] / 1e6:.2f} / {wire['nvlink'] / 1e6:.2f}"


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.bench.virtual_exchange import (
        VirtualSpec,
        estimate_peak_bytes,
        simulate_exchange,
    )
    from megatron_railwave.planner import PlanOptions

    topo = _common.cluster_from_args(args)
    capacity = args.max_tokens_per_rank
    spec = VirtualSpec(
        topology=topo,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_tokens_per_rank=capacity,
        options=PlanOptions(chunks=args.chunks),
    )  # a bad value raises ValueError: exit 2
    estimate_gib = estimate_peak_bytes(spec) / 2**30
    if args.max_memory_gib is not None and estimate_gib > args.max_memory_gib:
        raise ValueError(
            f"the estimated peak memory of this run is {estimate_gib:.1f} GiB, over "
            f"--max-memory-gib "
            f"{args.max_memory_gib:g}; lower --tokens, --hidden or --max-tokens-per-rank"
        )
    if args.require_compiled:
        from megatron_railwave import ops

        if not ops.compiled_for(torch.device(args.device)):
            _render.print_text(
                f"FAILED: --require-compiled: the compiled railwave ops do not serve "
                f"{args.device} tensors ({ops.load_error() or 'built without kernels for it'}); "
                "the run would time the pure-torch fallback"
            )
            return 1
    report = simulate_exchange(spec)
    limit = (
        args.max_error if args.max_error is not None else (1e-5 if args.dtype == "fp32" else 2e-2)
    )
    rows = []
    for path in spec.paths:
        err = report["max_rel_error"][path]
        row = [path, "yes" if report["bitwise_equal"][path] else "NO"]
        if capacity is not None:
            row.append("yes" if report["bitwise_equal_to_normal_mode"][path] else "NO")
        row += [
            f"{max(err.values()):.2e}",
            report["host_syncs_per_layer"][path],
            report["time_ms"][path],
            _megabytes(report["wire_bytes"][path]),
        ]
        if capacity is not None:
            normal = report["normal_mode"]
            row += [
                normal["host_syncs_per_layer"][path],
                normal["time_ms"][path],
                _megabytes(normal["wire_bytes"][path]),
            ]
        rows.append(row)
    mode = f", fixed capacity C={capacity}" if capacity is not None else ""
    columns = ["path", f"bitwise = {report['bitwise_equal_to']}"]
    if capacity is not None:
        columns.append("bitwise = normal mode")
    columns += [
        "max rel. error",
        "host syncs / layer / rank",
        "time ms (all ranks)",
        "MB rail / NVLink",
    ]
    if capacity is not None:
        columns += ["normal mode: syncs", "normal mode: time ms", "normal mode: MB rail / NVLink"]
    _render.print_table(
        f"virtual cluster {topo.name} ({topo.num_nodes}x{topo.gpus_per_node}), T={args.tokens} "
        f"H={args.hidden} "
        f"E={args.experts} top-{args.topk} {args.dtype} on {args.device}{mode}",
        columns,
        rows,
    )
    peak = (
        f", measured peak {report['measured_peak_bytes'] / 2**30:.1f} GiB"
        if "measured_peak_bytes" in report
        else ""
    )
    _render.print_text(f"estimated peak memory {estimate_gib:.1f} GiB{peak}")
    worst = max(max(e.values()) for e in report["max_rel_error"].values())
    report["max_error_limit"] = limit
    syncs_ok = True
    if args.expect_host_syncs is not None:
        report["expected_host_syncs_per_layer"] = args.expect_host_syncs
        wrong = {
            path: n
            for path, n in report["host_syncs_per_layer"].items()
            if n != args.expect_host_syncs
        }
        syncs_ok = not wrong
        if wrong:
            _render.print_text(
                f"FAILED: host syncs per layer per rank {wrong}, expected "
                f"{args.expect_host_syncs:g} on every path"
            )
    report["ok"] = report["all_bitwise_equal"] and worst <= limit and syncs_ok
    if args.json:
        _common.write_json(args.json, report)
    if not report["ok"]:
        if report["all_bitwise_equal"] and worst <= limit:
            return 1  # the host syncs failed, reported above
        _render.print_text(
            f"FAILED: bitwise equal: {report['all_bitwise_equal']}, worst error {worst:.3g} "
            f"(limit {limit:g})"
        )
        return 1
    return 0
