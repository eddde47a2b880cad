"""``railwave ops-bench``: the compiled data-movement ops against their pure-torch reference and a
plain copy of the same bytes (see ``bench.ops_bench`` for what is timed and how).

Letters: T tokens per rank, H hidden, E experts, K top-k, N nodes, G GPUs per node.
"""

from __future__ import annotations

import argparse

from megatron_railwave.commands import _args, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ops-bench",
        help="compiled ops vs their pure-torch reference and a plain copy (GLM-4.5-Air sizes)",
        description="Time each railwave op, its pure-torch reference and a plain copy of the same "
        "bytes "
        "(CPU: one thread).",
    )
    _args.add_flag(parser, "--device", "cpu")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes for a smoke test (T=256, H=256, E=64)"
    )
    # Unset flags keep the spec's value (OpsBenchSpec, or QUICK with --quick).
    _args.add_workload_args(
        parser,
        tokens=4096,
        experts=128,
        topk=8,
        hidden=4096,
        per="rank",
        experts_help="experts",
        seed_help="routing and data seed",
        unset_default=True,
    )
    _args.add_shape_args(parser, nodes=4, gpus_per_node=8, unset_default=True)
    _args.add_flag(parser, "--repeats", None, help="timed calls per op, median", default_text="5")
    _args.add_output_args(parser, json="the results")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from megatron_railwave.commands._common import write_json
    from megatron_railwave.lab.bench.ops_bench import QUICK, OpsBenchSpec, run_ops_bench

    base = QUICK if args.quick else OpsBenchSpec()
    overrides = {
        "num_tokens": args.tokens,
        "hidden": args.hidden,
        "num_experts": args.experts,
        "topk": args.topk,
        "num_nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "repeats": args.repeats,
    }
    spec = dataclasses.replace(
        base, seed=args.seed, **{k: v for k, v in overrides.items() if v is not None}
    )
    if args.device.startswith("cuda"):
        import torch

        from megatron_railwave import ops

        if torch.cuda.is_available() and not ops.compiled_for(torch.device(args.device)):
            # Without CUDA kernels the 'op' column would time the reference against itself.
            _render.print_text(
                f"FAILED: no compiled CUDA kernels ({ops.load_error() or 'built without them'}); "
                "ops-bench on cuda measures nothing without them"
            )
            return 1
    result = run_ops_bench(spec, args.device)
    if not result["compiled"]:
        _render.print_text(
            f"note: compiled ops unavailable ({result['compiled_unavailable_reason']}); "
            "the 'op' column times the reference"
        )
    rows = []
    for r in result["ops"]:
        goal = r["goal"]
        rows.append(
            [
                r["op"],
                r["ms"],
                r["reference_ms"],
                r["speedup_vs_reference"],
                r["GBps"],
                r["copy_GBps"],
                r["fraction_of_copy"],
                "yes" if r["equal_to_reference"] else "NO",
                "-" if goal is None else ("met" if goal["met"] else "NOT met"),
            ]
        )
    s = result["sizes"]
    _render.print_table(
        f"ops-bench on {result['device_name']} (T={spec.num_tokens} H={spec.hidden} "
        f"E={spec.num_experts} "
        f"K={spec.topk} {spec.num_nodes}x{spec.gpus_per_node}; {s['records']} records, "
        f"{s['copies']} copies, "
        f"{s['row_bytes']} B/row; median of {spec.repeats})",
        [
            "op",
            "ms",
            "reference ms",
            "x reference",
            "GB/s",
            "copy GB/s",
            "of copy",
            "= reference",
            "goal",
        ],
        rows,
    )
    line = (
        f"records_from_routing + assign_egress: {result['records_plus_assign_us']:.1f} us per layer"
    )
    if "records_plus_assign_goal" in result:
        line += (
            " (goal "
            + result["records_plus_assign_goal"]["what"]
            + ": "
            + ("met)" if result["records_plus_assign_goal"]["met"] else "NOT met)")
        )
    _render.print_text(line)
    if args.json:
        write_json(args.json, result)
    if not result["all_equal_to_reference"]:
        wrong = [r["op"] for r in result["ops"] if not r["equal_to_reference"]]
        _render.print_text(f"FAILED: outputs differ from the reference: {', '.join(wrong)}")
        return 1
    return 0
