"""What the CLI commands share after parsing: the package's objects from the parsed flags
(``_args`` defines the flags), checks of their values, and the JSON writer.

Letters: N nodes, G GPUs per node, T tokens per rank, E experts, K top-k, H hidden size.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from megatron_railwave.names import ROUTES, Route, parse_route
from megatron_railwave.planner import EligiblePolicy, PlanOptions
from megatron_railwave.topology import RailTopology, load_topology
from megatron_railwave.traffic import dtype_bytes

__all__ = [
    "check_workload_args",
    "cluster_from_args",
    "glm_layers",
    "load_model",
    "options_from_args",
    "paths_from_choice",
    "record_bytes_from_args",
    "json_ready",
    "write_json",
]


def paths_from_choice(choice: str) -> list[Route]:
    """The routes of a ``--path`` choice (``_args.parse_path_choice``): one, or all for 'all'."""
    return list(ROUTES) if choice == "all" else [parse_route(choice)]


def cluster_from_args(args: argparse.Namespace) -> RailTopology:
    """The cluster named by ``--cluster`` with ``--nodes`` and ``--failed-rail`` applied."""
    try:
        topo = load_topology(args.cluster)
    except ValueError as exc:
        raise ValueError(f"--cluster: {exc}") from None
    # Commands whose cluster group has no --nodes / --failed-rail (``add_cluster_args(overrides=
    # False)``) take the file as it is.
    if getattr(args, "nodes", None) is not None:
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
        topo = topo.with_nodes(args.nodes)
    if getattr(args, "failed_rail", None):
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


def glm_layers(selection: list[int] | None, flag: str, *, default: list[int]) -> list[int]:
    """The GLM-4.5-Air MoE layer numbers of ``--layers K|L,L`` (``_args.layer_count_or_list``:
    ``[-K]`` = the first K layers; None: ``default``), each checked to be one."""
    from megatron_railwave.lab.workloads import GLM45_AIR

    known = GLM45_AIR.layer_numbers
    if selection is None:
        return list(default)
    layers = list(known[: -selection[0]]) if selection[0] < 0 else list(selection)
    bad = [v for v in layers if v not in known]
    if bad:
        raise ValueError(
            f"{flag}: {bad} are not MoE layers of GLM-4.5-Air ({known[0]}..{known[-1]})"
        )
    return layers


def load_model(path: str | None) -> Any:
    """The ``NetModelConfig`` of a ``--model`` file (None: the built-in defaults)."""
    from megatron_railwave.lab.netmodel import NetModelConfig, load_netmodel_config

    return load_netmodel_config(path) if path else NetModelConfig()


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
