"""``railwave bench``: modelled dispatch + combine of every path over GLM-4.5-Air layers.

What is sampled, how and what is summarised: ``lab.bench.netmodel_bench``.

JSON (``--json``): ``config``, ``model`` (NetModelConfig), ``samples`` (one row per sample and
variant) and ``summary`` (per pattern: ``baseline``, per variant the percentiles, speedups,
bounds and NIC shares, plus ``joint_over_best_single`` and ``<peer>_over_joint_p50``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.lab.bench.netmodel_bench import (
    PEERS,
    RECORD_BYTES,
    bench_samples,
    is_sparse,
    model_spec,
    summarize_samples,
)
from megatron_railwave.names import ROUTES, route_list

__all__ = ["register", "run"]

_PATHS = tuple(map(str, ROUTES))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="per-path dispatch+combine percentiles over GLM-4.5-Air layers on the network model",
        description="Model every path on the synthetic GLM-4.5-Air routing under replay "
        "arrangements: "
        "P50/P95/P99 of dispatch+combine over layers and steps, CPU planning time, "
        "speedup over NATIVE and NIC shares.",
    )
    # The flags' order is the order of the JSON's "config" (every parsed flag): keep it.
    _args.add_cluster_args(parser)
    _args.add_flag(parser, "--backend", "netmodel")
    _args.add_flag(
        parser,
        "--model",
        help="netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8; default: the "
        "built-in NetModelConfig, "
        "max-min: alpha 0)",
    )
    _args.add_flag(parser, "--alpha", help="override the incast alpha of --model")
    group = parser.add_argument_group("workload")
    _args.add_flag(group, "--workload", "glm45-air")
    _args.add_flag(group, "--pattern", ["ring", "moderate", "extreme"])
    _args.add_flag(
        group,
        "--layers",
        "45",
        type=_args.layer_count_or_list,
        metavar="K|L,L",
        help="one number K: the first K MoE layers; a list: those layer numbers",
    )
    _args.add_flag(group, "--steps", 1, help="training steps per layer")
    _args.add_flag(group, "--tokens", 2048)
    _args.add_flag(group, "--payload-scale", 1.0, default_text="1")
    _args.add_flag(group, "--seed", 0)
    group = parser.add_argument_group("paths")
    _args.add_flag(
        group,
        "--paths",
        list(_PATHS),
        type=_args.comma_choices(_PATHS),
        metavar="P,P",
        help=route_list(),
        default_text="all",
    )
    positive = _args.comma_ints("positive integers", minimum=1)
    _args.add_flag(
        group,
        "--fanin",
        [1],
        type=positive,
        metavar="F,F",
        help="wave fan-ins for perm/joint",
        default_text="1: cyclic, N-1 waves",
    )
    _args.add_flag(
        group, "--chunks", [1], type=positive, metavar="C,C", default_text="1: whole waves"
    )
    group.add_argument(
        "--streamed",
        action="store_true",
        help="also every relaying path (rail, joint, flow, flow-waves) with its relay streamed "
        "into its rail phases, as '<path>+streamed'",
    )
    _args.add_flag(
        group,
        "--peers",
        ["deepep-balanced", "deepep-direct", "megatron", "fast"],
        type=_args.comma_choices(PEERS + ("none",)),
        help="peers on the same demand and model: deepep-balanced (the baseline on equal tokens "
        "per rank), deepep-direct (PXN-like, one copy per target GPU), megatron (NCCL all-to-all "
        "in its rotating node rounds, PXN), megatron-flat (all pairs at once), fast (per-layer "
        "BvN waves); none",
    )
    _args.add_flag(
        group,
        "--path-delivery",
        "after_rail",
        default_text="after_rail; the baseline is always streamed",
    )
    group.add_argument(
        "--plan-repeats",
        type=int,
        default=3,
        help="timed planning runs per sample after one warm-up (0: do not time; default 3)",
    )
    _args.add_output_args(
        parser, json="the samples and summary", plot="bar chart of P50/P95/P99 per path"
    )
    _args.add_progress_arg(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    topo = _common.cluster_from_args(args)
    model = _common.load_model(args.model)
    if args.alpha is not None:
        model = replace(model, alpha=args.alpha)
    if args.steps < 1 or args.tokens < 1 or args.plan_repeats < 0 or not args.payload_scale > 0:
        raise ValueError(
            f"need --steps >= 1, --tokens >= 1, --plan-repeats >= 0 and --payload-scale > 0, got "
            f"{args.steps}, {args.tokens}, {args.plan_repeats}, {args.payload_scale}"
        )
    layers = _common.glm_layers(args.layers, "--layers", default=[])
    if is_sparse(topo, args.tokens) and set(args.pattern) != {"none"}:
        raise ValueError(
            f"--pattern {','.join(args.pattern)} needs the dense demand, which is too large at "
            f"{topo.num_nodes} nodes x {args.tokens} tokens; use --pattern none"
        )
    if any(c < 1 for c in args.chunks):
        raise ValueError(f"--chunks must be >= 1, got {args.chunks}")
    record_bytes = RECORD_BYTES
    torch.set_num_threads(1)
    samples = bench_samples(
        topo,
        model,
        layers=layers,
        steps=args.steps,
        tokens=args.tokens,
        seed=args.seed,
        patterns=args.pattern,
        payload_scale=args.payload_scale,
        paths=args.paths,
        fanins=args.fanin,
        chunks=args.chunks,
        peers=[p for p in args.peers if p != "none"],
        path_delivery=args.path_delivery,
        plan_repeats=args.plan_repeats,
        progress=not args.no_progress,
        streamed=args.streamed,
    )
    summary = summarize_samples(samples)
    _print(summary, topo, args)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "handler"}
        config.update(
            layers=layers,
            topology=topo.to_dict(),
            record_bytes=record_bytes,
            model_spec=model_spec(topo).name,
        )
        _common.write_json(
            args.json,
            {"config": config, "model": model.to_dict(), "summary": summary, "samples": samples},
        )
    if args.plot:
        _plot(
            summary,
            args.plot,
            f"{topo.name}: {topo.num_nodes}x{topo.gpus_per_node}, alpha {model.alpha}",
        )
    return 0


def _times(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _print(summary: dict[str, Any], topo: Any, args: argparse.Namespace) -> None:
    for pattern, entry in summary.items():
        rows = []
        for variant, v in entry["variants"].items():
            rows.append(
                [
                    variant,
                    v["comm_p50_ms"],
                    v["comm_p95_ms"],
                    v["comm_p99_ms"],
                    v["bound_p50_ms"],
                    v["per_record_bound_p50_ms"],
                    _times(v.get("per_record_fraction_p50"), ""),
                    v["any_routing_bound_p50_ms"],
                    _times(v.get("any_routing_fraction_p50"), ""),
                    v["plan_p50_ms"],
                    v["total_p50_ms"],
                    _times(v.get("speedup_p50", 1.0)),
                    f"{_times(v.get('speedup_min', 1.0), '')}-"
                    f"{_times(v.get('speedup_max', 1.0), '')}",
                    _times(v.get("speedup_total_p50", 1.0)),
                    v["rail_p50_ms"],
                    _times(v.get("rail_speedup_p50", 1.0)),
                    " / ".join(f"{100 * s:.1f}" for s in v["nic_shares"][:4]),
                ]
            )
        _render.print_table(
            f"{pattern} on {topo.name} ({topo.num_nodes}x{topo.gpus_per_node}), "
            f"{entry['variants'][entry['baseline']]['samples']} samples, ms; speedups over "
            f"{entry['baseline']}",
            [
                "variant",
                "P50",
                "P95",
                "P99",
                "own bound P50",
                "per-record bound P50",
                "of per-record",
                "any-routing bound P50",
                "of any-routing",
                "plan P50",
                "total P50",
                "speedup P50",
                "per-sample",
                "speedup total",
                "rails P50",
                "rails speedup",
                "NIC shares % (top 4)",
            ],
            rows,
        )
        base = entry["variants"][entry["baseline"]]
        for b, label in (("per_record", "per-record routing"), ("any_routing", "any-routing")):
            _render.print_text(
                f"{pattern}: {label} bound P50 {base[f'{b}_bound_p50_ms']:.2f} ms, binding "
                f"resource (most samples) {base[f'{b}_resource']}; largest speedup it allows "
                f"over {entry['baseline']} {_times(base.get(f'{b}_speedup_p50'))}"
            )
        _render.print_text(
            f"{pattern}: 'of per-record' / 'of any-routing' = bound / time (the fraction of the "
            "largest speedup a routing of that class could have)"
        )
        for peer in PEERS:
            if entry.get(f"{peer}_over_joint_p50") is not None:
                plan_ratio = entry.get(f"{peer}_plan_over_joint_plan_p50")
                _render.print_text(
                    f"{pattern}: {peer} P50 / JOINT P50 {entry[f'{peer}_over_joint_p50']:.2f}x; "
                    f"planning {peer} / JOINT "
                    f"{'-' if plan_ratio is None else f'{plan_ratio:.2f}x'}"
                )
                for key, value in entry.items():
                    prefix = f"{peer}_over_joint/"
                    if key.startswith(prefix) and value is not None:
                        _render.print_text(
                            f"{pattern}: {peer} P50 / joint/{key[len(prefix) : -4]} P50 "
                            f"{value:.3f}x"
                        )
        if entry.get("joint_over_best_single") is not None:
            _render.print_text(
                f"{pattern}: JOINT over the better single mechanism "
                f"{entry['joint_over_best_single']:.2f}x"
            )


def _plot(summary: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    patterns = list(summary)
    variants = list(dict.fromkeys(v for e in summary.values() for v in e["variants"]))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(patterns) * max(1, len(variants)) / 4, 3.6))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs = [p + (i - (len(variants) - 1) / 2) * width for p in range(len(patterns))]
        entries = [summary[p]["variants"].get(variant) for p in patterns]
        p50 = [e["comm_p50_ms"] if e else 0.0 for e in entries]
        ax.bar(xs, p50, width, label=variant)
        for key, marker in (("comm_p95_ms", "_"), ("comm_p99_ms", "x")):
            ax.scatter(
                xs,
                [e[key] if e else 0.0 for e in entries],
                marker=marker,
                color="black",
                s=18,
                zorder=3,
            )
    ax.set_xticks(range(len(patterns)), patterns)
    ax.set_ylabel("dispatch + combine, ms (bar P50, - P95, x P99)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
