"""``railwave demo``: one GLM-4.5-Air-shaped layer on the H800 4x8 preset, all four paths.

GLM-4.5-Air MoE layer: 128 routed experts, top-8, hidden 4096, bf16 payload; 4096 tokens per GPU
of seeded synthetic routing (hot experts plus per-rank locality, so source rails are skewed).
Prints, per path, the per-rail egress, the waves and the descriptors (``make demo``).
"""

from __future__ import annotations

import argparse

import torch

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.commands.plan import print_planned_layer
from megatron_railwave.lab.bench.plan_bench import plan_layer
from megatron_railwave.planner import PlanOptions
from megatron_railwave.topology import RailTopology

__all__ = ["register", "run"]

_PRESET = "h800_4x8"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="plan a GLM-4.5-Air-shaped layer on H800 4x8 with every path",
        description="Plan one GLM-4.5-Air-shaped MoE layer (128 experts, top-8, hidden 4096, bf16, "
        "4096 tokens per GPU) on the H800 4x8 preset and print each path's rails, "
        "waves and descriptors.",
    )
    _args.add_workload_args(parser, tokens=4096)
    _args.add_output_args(parser, json="every plan")
    parser.set_defaults(handler=run)


def _preset() -> RailTopology:
    from megatron_railwave.topology import load_topology

    return load_topology(_PRESET)  # package data: found in a checkout and an installed wheel


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    topo = _preset()
    _render.print_text(
        f"RailWave demo: GLM-4.5-Air-shaped layer (E=128, K=8, H=4096, bf16, T={args.tokens} per "
        f"GPU) on "
        f"{topo.name} ({topo.num_nodes} nodes x {topo.gpus_per_node} GPUs, {topo.rail_gbps:g} "
        f"Gb/s rails)"
    )
    layer = plan_layer(
        topo,
        paths=_common.paths_from_choice("all"),
        num_tokens=args.tokens,
        num_experts=128,
        topk=8,
        seed=args.seed,
        record_bytes=4096 * 2,
        options=PlanOptions(),
    )
    print_planned_layer(layer)
    if args.json:
        _common.write_json(args.json, layer.to_json())
        _render.print_text(f"wrote {args.json}")
    return 0
