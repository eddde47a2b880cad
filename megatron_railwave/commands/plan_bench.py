"""``railwave plan-bench``: one rank's CPU planning time per layer at several cluster sizes.

What is timed and how the demand of large clusters is built: ``lab.bench.plan_bench``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.lab.bench.plan_bench import bench_config

__all__ = ["register", "run"]

_DEFAULT_CONFIGS = "4x8,32x8,128x8"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan-bench",
        help="one rank's planning time per layer (records, plan, schedule, index maps)",
        description="Time one rank's per-layer planning on one CPU thread for several cluster "
        "sizes.",
    )
    parser.add_argument(
        "--configs",
        default=_DEFAULT_CONFIGS,
        metavar="NxG,...",
        help=f"cluster sizes, nodes x GPUs per node (default {_DEFAULT_CONFIGS})",
    )
    _args.add_workload_args(
        parser,
        tokens=4096,
        experts=128,
        topk=8,
        experts_help="experts; raised to the next multiple of the world size",
    )
    group = parser.add_argument_group("planner")
    _args.add_flag(group, "--path", "joint")
    _args.add_flag(group, "--fanin", 1, help="wave fan-in for perm/joint")
    group = _args.add_measure_args(
        parser,
        warmups=3,
        repeats=20,
        warmups_help="untimed runs per config",
        repeats_help="timed runs per config",
        renamed_warmup=True,
    )
    group.add_argument(
        "--full-routing-max-ranks",
        type=int,
        default=32,
        metavar="W",
        help="largest world that gets a routing map per rank (default 32)",
    )
    _args.add_output_args(parser, json="the results")
    parser.set_defaults(handler=run)


def _parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--configs: expected NxG entries such as 4x8, got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    configs = _parse_configs(args.configs)
    if args.warmups < 0 or args.repeats < 1:
        raise ValueError(
            f"--warmups must be >= 0 and --repeats >= 1, got {args.warmups}, {args.repeats}"
        )
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    rows: list[dict[str, Any]] = []
    for n, g in configs:
        rows += bench_config(
            n,
            g,
            num_tokens=args.tokens,
            num_experts=args.experts,
            topk=args.topk,
            paths=_common.paths_from_choice(args.path),
            fanin=args.fanin,
            seed=args.seed,
            warmup=args.warmups,
            repeats=args.repeats,
            full_routing_max_ranks=args.full_routing_max_ranks,
        )
    _render.print_table(
        f"one rank's planning per layer (median of {args.repeats}, 1 thread)",
        [
            "config",
            "path",
            "E",
            "waves",
            "records",
            "records ms",
            "build_plan ms",
            "schedule ms",
            "layout ms",
            "ms/layer",
            "cpu ms/layer",
            "min ms/layer",
        ],
        [
            [
                f"{r['nodes']}x{r['gpus_per_node']}",
                r["path"],
                r["experts"],
                r["num_waves"],
                r["rank_records"],
                r["records_ms"],
                r["build_plan_ms"],
                r["schedule_ms"],
                r["layout_ms"],
                r["ms_per_layer"],
                r["cpu_ms_per_layer"],
                r["min_ms_per_layer"],
            ]
            for r in rows
        ],
    )
    for r in rows:
        if r["experts_note"]:
            _render.print_text(f"{r['nodes']}x{r['gpus_per_node']}: {r['experts_note']}")
    if args.json:
        _common.write_json(args.json, {"threads": 1, "configs": rows})
        _render.print_text(f"wrote {args.json}")
    return 0
