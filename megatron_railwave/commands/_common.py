"""Argument groups and helpers shared by the CLI commands.

Letters: N nodes, G GPUs per node, T tokens per rank, E experts, K top-k, H hidden size.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from megatron_railwave.names import ROUTES, Route, parse_route, route_list
from megatron_railwave.planner import EligiblePolicy, PlanOptions
from megatron_railwave.topology import RailTopology, load_topology
from megatron_railwave.traffic import dtype_bytes

__all__ = [
    "add_cluster_args",
    "add_workload_args",
    "add_plan_args",
    "check_workload_args",
    "cluster_from_args",
    "options_from_args",
    "parse_failed_rail",
    "parse_path_choice",
    "paths_from_choice",
    "record_bytes_from_args",
    "json_ready",
    "write_json",
]

ALL_PATHS = ROUTES


def parse_failed_rail(text: str) -> tuple[int, int]:
    """argparse type of ``--failed-rail NODE:RAIL`` (range is checked by the topology)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected NODE:RAIL with two integers (e.g. 0:3), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def parse_path_choice(text: str) -> str:
    """argparse type of ``--path``: a path name (paper aliases accepted) or 'all'."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return str(parse_route(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown path {text!r}; choose one of {route_list(extra=('all',))}"
        ) from None


def paths_from_choice(choice: str) -> list[Route]:
    return list(ALL_PATHS) if choice == "all" else [parse_route(choice)]


def _rail_mask_gpus(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of local GPU indices (e.g. 0,1,2,3), got {text!r}"
        ) from None


def add_cluster_args(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--cluster",
        default=default,
        required=default is None,
        metavar="YAML",
        help="cluster YAML file, or the name of a packaged preset (e.g. h800_4x8)"
        + (f" (default {default})" if default else ""),
    )
    group.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="override the node count of the cluster file",
    )
    group.add_argument(
        "--failed-rail",
        type=parse_failed_rail,
        action="append",
        default=[],
        metavar="NODE:RAIL",
        help="mark rail RAIL of node NODE failed (repeatable)",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "workload (seeded synthetic routing, workloads.synthetic_routing_maps)"
    )
    group.add_argument(
        "--tokens", type=int, default=4096, metavar="T", help="tokens per GPU (default 4096)"
    )
    group.add_argument(
        "--experts",
        type=int,
        default=128,
        metavar="E",
        help="routed experts, divisible by the world size (default 128)",
    )
    group.add_argument(
        "--topk", type=int, default=8, metavar="K", help="experts per token (default 8)"
    )
    group.add_argument(
        "--hidden", type=int, default=4096, metavar="H", help="hidden size (default 4096)"
    )
    group.add_argument(
        "--dtype", default="bf16", help="payload element type: bf16, fp16, fp32, fp8 (default bf16)"
    )
    group.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")


def add_plan_args(parser: argparse.ArgumentParser, *, default_path: str = "joint") -> None:
    group = parser.add_argument_group("planner")
    group.add_argument(
        "--path",
        type=parse_path_choice,
        default=default_path,
        metavar="PATH",
        help=f"{route_list(extra=('all',))} (default {default_path})",
    )
    group.add_argument(
        "--policy",
        choices=[str(p) for p in EligiblePolicy],
        default="all",
        help="RailBalance eligible rails: all healthy, active senders, or --rail-mask",
    )
    group.add_argument(
        "--rail-mask",
        type=_rail_mask_gpus,
        default=None,
        metavar="GPUS",
        help="local GPUs (rails) allowed under --policy mask on every node, e.g. 0,1,2,3",
    )
    group.add_argument(
        "--fanin",
        type=int,
        default=1,
        metavar="F",
        help="remote senders per receiver per wave for perm/joint (default 1: cyclic)",
    )
    group.add_argument(
        "--chunks",
        type=int,
        default=1,
        metavar="C",
        help="rail chunks per wave for perm/joint (default 1: whole waves)",
    )
    group.add_argument(
        "--phase", type=int, default=0, help="remainder-rotation counter (default 0)"
    )


def cluster_from_args(args: argparse.Namespace) -> RailTopology:
    """The cluster named by ``--cluster`` with ``--nodes`` and ``--failed-rail`` applied."""
    try:
        topo = load_topology(args.cluster)
    except ValueError as exc:
        raise ValueError(f"--cluster: {exc}") from None
    if args.nodes is not None:
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
        topo = topo.with_nodes(args.nodes)
    if args.failed_rail:
        try:
            topo = topo.with_failed_rails(set(args.failed_rail))
        except ValueError as exc:
            raise ValueError(f"--failed-rail: {exc}") from None
    return topo


def record_bytes_from_args(args: argparse.Namespace) -> int:
    if args.hidden < 1:
        raise ValueError(f"--hidden must be >= 1, got {args.hidden}")
    return args.hidden * dtype_bytes(args.dtype)


def check_workload_args(args: argparse.Namespace, topo: RailTopology) -> None:
    """Reject a workload that cannot be routed before any expensive work."""
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if not 1 <= args.topk <= args.experts:
        raise ValueError(f"--topk must be in 1..--experts ({args.experts}), got {args.topk}")
    if args.experts % topo.world_size:
        raise ValueError(
            f"--experts {args.experts} is not divisible by the world size {topo.world_size} "
            f"({topo.num_nodes} nodes x {topo.gpus_per_node} GPUs); experts are placed E / W per "
            f"rank"
        )


def options_from_args(args: argparse.Namespace, topo: RailTopology) -> PlanOptions:
    """``PlanOptions`` from ``--policy``, ``--rail-mask``, ``--fanin`` and ``--chunks``."""
    if args.fanin < 1:
        raise ValueError(f"--fanin must be >= 1, got {args.fanin}")
    mask_NG = None
    if args.rail_mask is not None:
        bad = [v for v in args.rail_mask if not 0 <= v < topo.gpus_per_node]
        if bad or not args.rail_mask:
            raise ValueError(
                f"--rail-mask {args.rail_mask}: local GPUs must be in 0..{topo.gpus_per_node - 1}"
            )
        mask_NG = torch.zeros(topo.num_nodes, topo.gpus_per_node, dtype=torch.bool)
        mask_NG[:, args.rail_mask] = True
    if args.policy == EligiblePolicy.MASK and mask_NG is None:
        raise ValueError("--policy mask needs --rail-mask GPUS (e.g. --rail-mask 0,1,2,3)")
    return PlanOptions(
        policy=EligiblePolicy(args.policy),
        rail_mask_NG=mask_NG,
        fanin=args.fanin,
        chunks=getattr(args, "chunks", 1),
    )


def json_ready(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no infinity or
    NaN; None marks a quantity that is undefined, e.g. a rail speedup on one node)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as strict JSON (the path was checked up front by ``_outputs``)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_ready(data), indent=1, allow_nan=False) + "\n")
