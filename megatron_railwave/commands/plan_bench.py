"""``railwave plan-bench``: one rank's CPU planning time per layer at several cluster sizes.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, E experts, K top-k,
M = 2**G target masks.

What is timed, per layer, on one thread (``torch.set_num_threads(1)``), for the measured rank
(``bench.planning``): its records (``ops.records_from_routing``), ``build_plan`` from the node view
of the gathered ``DemandCounts``, ``compile_schedule`` + ``rank_view``, and the device index maps
(``exchange.layout.build_layout``, here on the CPU); warm-up runs, then the median of ``--repeats``
runs (``ms_per_layer``, wall time), with the median CPU time of the thread (``cpu_ms_per_layer``: on
a shared machine it leaves out the time slices given to other processes) and the fastest run
(``min_ms_per_layer``). Not timed: the count gather (a collective) and the data movement.

Demand: up to ``--full-routing-max-ranks`` ranks every rank's routing map comes from
``workloads.synthetic_routing_maps``. Beyond that, generating W routing maps is too slow, so a few
prototype ranks of node 0 get real synthetic routing maps (same model: log-normal expert popularity,
a per-rank bonus for its own node's experts) and every other rank w of node s copies the counts of
prototype ``w mod P`` with destinations shifted by s (node n -> node (n + s) mod N). The measured
rank 0 is prototype 0, so the records it routes are real and match the gathered counts.

Experts: E must divide by W; when ``--experts`` does not, the next multiple of W is used
(128 experts on 32x8 -> 256, on 128x8 -> 1024: one expert per rank) and the JSON says so.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from megatron_railwave.commands import _common, _outputs, _render
from megatron_railwave.lab.bench.planning import time_rank_planning
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import route_list
from megatron_railwave.planner import PlanOptions
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, local_demand

__all__ = ["register", "run", "bench_config"]

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
    parser.add_argument(
        "--tokens", type=int, default=4096, metavar="T", help="tokens per GPU (default 4096)"
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=128,
        metavar="E",
        help="experts; raised to the next multiple of the world size (default 128)",
    )
    parser.add_argument(
        "--topk", type=int, default=8, metavar="K", help="experts per token (default 8)"
    )
    parser.add_argument(
        "--path",
        type=_common.parse_path_choice,
        default="joint",
        metavar="PATH",
        help=f"{route_list(extra=('all',))} (default joint)",
    )
    parser.add_argument(
        "--fanin", type=int, default=1, metavar="F", help="wave fan-in for perm/joint"
    )
    parser.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per config (default 3)")
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed runs per config (default 20)"
    )
    parser.add_argument(
        "--full-routing-max-ranks",
        type=int,
        default=32,
        metavar="W",
        help="largest world that gets a routing map per rank (default 32)",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("json",))


def _parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--configs: expected NxG entries such as 4x8, got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


def _prototype_demand(
    topo: RailTopology, *, num_tokens: int, num_experts: int, topk: int, seed: int, num_protos: int
) -> tuple[DemandCounts, torch.Tensor]:
    """Counts of W ranks from ``num_protos`` real routing maps of node-0 ranks (module docstring).

    Returns:
        (demand, routing_map_TE of rank 0).
    """
    n, g = topo.num_nodes, topo.gpus_per_node
    # Real routing of the first P ranks of a one-node-wider slice: same model and seed as the
    # full generator, on a cluster whose first node is what the prototypes see.
    protos = _node0_routing_maps(
        topo, num_tokens=num_tokens, num_experts=num_experts, topk=topk, seed=seed, count=num_protos
    )
    parts = [local_demand(r, topo) for r in protos]
    rec_PNM = torch.stack([p[0] for p in parts])
    exp_PE = torch.stack([p[1] for p in parts])
    w = torch.arange(topo.world_size)
    proto_W = w % num_protos
    src_W = w // g
    dst_N = torch.arange(n)
    # Rank w on node s sends to node (n + s) mod N what its prototype (on node 0) sends to node n.
    shifted_WN = (dst_N.unsqueeze(0) - src_W.unsqueeze(1)) % n  # prototype's destination index
    records_WNM = rec_PNM[proto_W.unsqueeze(1), shifted_WN]
    experts_WE = exp_PE[proto_W]
    return DemandCounts(records_WNM=records_WNM, experts_WE=experts_WE), protos[0]


def _node0_routing_maps(
    topo: RailTopology, *, num_tokens: int, num_experts: int, topk: int, seed: int, count: int
) -> list[torch.Tensor]:
    """[T, E] bool routing maps of ``count`` ranks on node 0 of ``topo``.

    The model of ``workloads.synthetic_routing_maps`` (log-normal expert popularity with max/mean
    about 8, Gumbel top-k, a per-rank bonus uniform in [0, 6] for the rank's own node's experts)
    drawn for these ranks only, so that the cost does not grow with W.
    """
    gen = torch.Generator().manual_seed(int(seed))
    sigma = math.sqrt(2 * math.log(8.0)) / max(math.sqrt(2 * math.log(num_experts)), 1.0) * 1.6
    log_pop = torch.randn(num_experts, generator=gen) * sigma
    own_node = (torch.arange(num_experts) < num_experts // topo.num_nodes).to(torch.float32)
    out = []
    for _ in range(count):
        bonus = float(torch.rand((), generator=gen)) * 6.0
        u = torch.rand(num_tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
        scores = -torch.log(-torch.log(u)) + log_pop + bonus * own_node
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        routing.scatter_(1, scores.topk(topk, dim=1).indices, True)
        out.append(routing)
    return out


def _experts_for(num_experts: int, world: int) -> int:
    return num_experts if num_experts % world == 0 else world * math.ceil(num_experts / world)


def bench_config(
    num_nodes: int,
    gpus_per_node: int,
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    path_choice: str,
    fanin: int,
    seed: int,
    warmup: int,
    repeats: int,
    full_routing_max_ranks: int,
) -> list[dict[str, Any]]:
    """Time rank 0's per-layer planning on an N x G cluster; one result row per path."""
    topo = RailTopology(
        num_nodes=num_nodes, gpus_per_node=gpus_per_node, name=f"{num_nodes}x{gpus_per_node}"
    )
    world = topo.world_size
    experts = _experts_for(num_experts, world)
    if topk > experts:
        raise ValueError(f"--topk {topk} exceeds the {experts} experts of config {topo.name}")
    if world <= full_routing_max_ranks:
        maps = synthetic_routing_maps(
            topo, num_tokens=num_tokens, num_experts=experts, topk=topk, seed=seed
        )
        demand, routing_TE = DemandCounts.from_routing_maps(maps, topo), maps[0]
        source = "synthetic_routing_maps (every rank)"
    else:
        protos = min(world, 8)
        demand, routing_TE = _prototype_demand(
            topo,
            num_tokens=num_tokens,
            num_experts=experts,
            topk=topk,
            seed=seed,
            num_protos=protos,
        )
        source = f"{protos} prototype routing maps, node-shifted counts"
    # Rank 0 plans from what the exchange gathers: per-node totals of every rank and the masks
    # of the records into its own node (not the full W x N x M table).
    demand = DemandCounts(
        records_WN=demand.records_WN, view_node=0, view_masks_WM=demand.masks_into(0)
    )
    options = PlanOptions(fanin=fanin)
    rows = []
    for path in _common.paths_from_choice(path_choice):
        plan, timing = time_rank_planning(
            demand,
            topo,
            path,
            rank=0,
            routing_TE=routing_TE,
            options=options,
            warmup=warmup,
            repeats=repeats,
        )
        rows.append(
            {
                "nodes": num_nodes,
                "gpus_per_node": gpus_per_node,
                "world_size": world,
                "path": str(path),
                "tokens_per_gpu": num_tokens,
                "experts": experts,
                "experts_note": (
                    f"--experts {num_experts} does not divide W={world}; used {experts} "
                    f"({experts // world} per rank)"
                )
                if experts != num_experts
                else "",
                "topk": topk,
                "num_waves": plan.num_waves,
                "rank_records": int(plan.records_NNG[0, :, 0].sum()),
                "demand_source": source,
                "demand_view": "node 0: records_WN + masks into node 0 (what the exchange gathers)",
                **timing.to_dict(),
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    configs = _parse_configs(args.configs)
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError(
            f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup}, {args.repeats}"
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
            path_choice=args.path,
            fanin=args.fanin,
            seed=args.seed,
            warmup=args.warmup,
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
