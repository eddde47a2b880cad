"""``railwave bench``: modelled dispatch + combine of every path over GLM-4.5-Air layers.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, K top-k, E experts,
M = 2**G target masks.

Samples: every (layer, step) of the synthetic GLM-4.5-Air routing (`workloads.glm`), arranged into
each ``--pattern``'s sending windows (`workloads.arrange`; ``none`` = all node pairs at once, as a
training step sends). Variants: the baseline ``deepep`` (NATIVE with streamed forwarding, what
DeepEP's normal kernels do), the paths (PERM / JOINT once per ``--fanin`` and ``--chunks``; run
as ``--path-delivery`` says) and the ``--peers`` (`netmodel.peers`; ``deepep-balanced`` is the
baseline on the same step's tokens split equally over the ranks). Per sample and variant:
  * communication: `netmodel.execute_plan` (dispatch + combine, seconds; deterministic);
  * the path-independent bound of the input (`netmodel.bounds.ideal_bound`) and its binding
    resource, beside the path's own busiest-link bound;
  * planning: wall time on this CPU of rank 0's per-layer planning as the exchange runs it
    (``bench.planning.time_rank_planning``: records from its routing, ``build_plan``, the
    schedule and rank view, the index maps; median of ``--plan-repeats`` after one warm-up), added
    unscaled.
Summary per pattern and variant: P50 / P95 / P99 over samples of communication, planning and
their sum; speedup over the baseline (ratio of P50s, and the range of per-sample ratios); the
bound's P50, the fraction of the ideal speedup reached (bound / time, median over samples), the
ideal speedup (baseline / bound) and the share of the baseline's gap to the bound closed; NIC
shares (each node's adapter egress shares sorted descending, mean over nodes and samples).

Experts: E = 128 (GLM-4.5-Air) when W divides 128, else one expert per rank beyond that (E = the
next multiple of W at or above 128). Beyond ``W * T * N`` = 2**24 the demand is built sparsely
(no [W, T, N] masks; `workloads.SparseDemand`), which supports ``--pattern none`` only.

JSON (``--json``): ``config``, ``model`` (NetModelConfig), ``samples`` (one row per sample and
variant) and ``summary`` (per pattern: ``baseline``, per variant the percentiles, speedups,
bounds and NIC shares, plus ``joint_over_best_single`` and ``<peer>_over_joint_p50``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from megatron_railwave.commands import _common, _outputs, _render
from megatron_railwave.names import ROUTES, route_list

__all__ = ["register", "run", "layer_demands", "summarize_samples"]

_PATTERNS = ("none", "ring", "moderate", "extreme")
_PATHS = tuple(map(str, ROUTES))
PEERS = ("deepep-balanced", "deepep-direct", "megatron", "megatron-flat", "fast")
"""Peers beside the paths (`netmodel.peers`): deepep-balanced is the baseline on the token-balanced
input (`layer_demands(balanced_tokens=True)`)."""
_DENSE_MAX = 1 << 24


def _model_spec(topo: Any) -> Any:
    from megatron_railwave.lab.workloads import GLM45_AIR

    world = topo.world_size
    if GLM45_AIR.num_experts % world == 0:
        return GLM45_AIR
    experts = -(-GLM45_AIR.num_experts // world) * world
    return replace(GLM45_AIR, name=f"GLM-4.5-Air-shaped (E={experts})", num_experts=experts)


def layer_demands(
    topo: Any,
    *,
    layer: int,
    step: int,
    tokens: int,
    seed: int,
    token_skew: float | None = None,
    balanced_tokens: bool = False,
) -> Any:
    """One layer's demand: `DemandCounts` when small enough, else `SparseDemand`.

    ``token_skew``: the generator's per-rank token-count spread (None: its default, 1.46).
    ``balanced_tokens``: the same step's total token count split equally over the ranks (every
    rank ``round(sum T_w / W)`` tokens, ``token_skew`` 0): the input of the token-balanced
    baseline, what a job that evens out its micro-batches by token count would send."""
    from megatron_railwave.lab.workloads import (
        GlmAirWorkload,
        demand_from_topk_ids,
        glm_air_layer_ids,
        sparse_demand_from_topk_ids,
    )

    spec = _model_spec(topo)
    skew = {} if token_skew is None else {"token_skew": token_skew}
    work = GlmAirWorkload(
        num_tokens=tokens, seed=seed, step=step, model=spec, layers=(layer,), **skew
    )
    if balanced_tokens:
        mean = int(round(float(work.tokens_per_rank(topo.world_size).mean())))
        work = replace(work, num_tokens=max(1, mean), token_skew=0.0)
    ids = glm_air_layer_ids(topo, layer, work)
    if topo.world_size * tokens * topo.num_nodes <= _DENSE_MAX:
        return demand_from_topk_ids(ids, topo, spec.num_experts)
    return sparse_demand_from_topk_ids(ids, topo, spec.num_experts)


def _rank0_routing(demand: Any, topo: Any, num_experts: int) -> torch.Tensor:
    """[T, E] bool routing map of rank 0 laid out from its counts: per destination node its
    records' target masks, each GPU bit as the first expert of that GPU (token order and which of
    a GPU's experts are hit do not change the planning cost)."""
    n, g = topo.num_nodes, topo.gpus_per_node
    e_node, e_gpu = num_experts // n, num_experts // topo.world_size
    hists = [demand.masks_into(d)[0] for d in range(n)]
    count = [int(h.sum()) for h in hists]
    routing = torch.zeros(max(count + [1]), num_experts, dtype=torch.bool)
    bits = (torch.arange(1 << g).unsqueeze(1) >> torch.arange(g)) & 1  # [M, G]
    for d, h in enumerate(hists):
        masks = torch.repeat_interleave(torch.arange(h.numel()), h)
        routing[: count[d], d * e_node : (d + 1) * e_node : e_gpu] = bits[masks].bool()
    return routing


def _plan_timed(
    demand: Any,
    topo: Any,
    path: str,
    options: Any,
    routing_TE: torch.Tensor | None,
    repeats: int,
    phase: int,
) -> tuple[Any, float]:
    """(plan, seconds): rank 0's per-layer planning as the exchange runs it (``bench.planning``:
    records, ``build_plan``, ``schedule.compile_for_rank``, index maps), median of ``repeats``
    after one warm-up; ``repeats`` 0: the plan alone, untimed."""
    from megatron_railwave.lab.bench.planning import time_rank_planning
    from megatron_railwave.planner import build_plan

    if not repeats:
        return build_plan(demand.records_NGN(), topo, path, options=options, phase=phase), 0.0
    plan, timing = time_rank_planning(
        demand,
        topo,
        path,
        rank=0,
        routing_TE=routing_TE,
        options=options,
        phase=phase,
        warmup=1,
        repeats=repeats,
    )
    return plan, timing.total_ms / 1e3


def _pct(values: list[float]) -> tuple[float, float, float]:
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99])
    return float(p50), float(p95), float(p99)


def _ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is 0 (e.g. rail time on one node)."""
    return a / b if b > 0 else None


BASELINE = "deepep"
"""The speedup baseline: NATIVE with streamed forwarding (DeepEP's normal kernels, what users
run)."""


def summarize_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pattern and variant: percentiles (ms), speedups over the baseline (``deepep`` when
    present, else ``native``), the path-independent bound and the fraction of the ideal speedup,
    NIC shares."""
    out: dict[str, Any] = {}
    for pattern in dict.fromkeys(s["pattern"] for s in samples):
        rows = [s for s in samples if s["pattern"] == pattern]
        per: dict[str, Any] = {}
        names = list(dict.fromkeys(s["variant"] for s in rows))
        baseline = BASELINE if BASELINE in names else "native"
        names = [baseline] + [v for v in names if v != baseline]
        base_of = {(s["layer"], s["step"]): s for s in rows if s["variant"] == baseline}
        for variant in names:
            sel = [s for s in rows if s["variant"] == variant]
            comm = [s["comm_s"] * 1e3 for s in sel]
            plan = [s["plan_s"] * 1e3 for s in sel]
            total = [c + p for c, p in zip(comm, plan)]
            entry: dict[str, Any] = {"samples": len(sel)}
            for name, vals in (("comm", comm), ("plan", plan), ("total", total)):
                entry[f"{name}_p50_ms"], entry[f"{name}_p95_ms"], entry[f"{name}_p99_ms"] = _pct(
                    vals
                )
            entry["nic_shares"] = np.mean([s["nic_shares"] for s in sel], axis=0).tolist()
            bounds = [s.get("bound_s", 0.0) * 1e3 for s in sel]
            entry["bound_p50_ms"], entry["bound_p95_ms"], entry["bound_p99_ms"] = _pct(bounds)
            # >= 1 always (tests/unit/netmodel/test_bound.py); how far above its own bound the path
            # is.
            over = [c / b for c, b in zip(comm, bounds) if b > 0]
            entry["comm_over_bound_min"] = min(over) if over else None
            ideal = [s.get("ideal_bound_s", 0.0) * 1e3 for s in sel]
            entry["ideal_bound_p50_ms"] = _pct(ideal)[0]
            resources = [s.get("ideal_resource", "-") for s in sel]
            entry["ideal_resource"] = max(set(resources), key=resources.count)
            # Path-independent (netmodel.bounds; tests/unit/netmodel/test_ideal_bound.py): >= 1.
            over_ideal = [c / b for c, b in zip(comm, ideal) if b > 0]
            entry["comm_over_ideal_min"] = min(over_ideal) if over_ideal else None
            # Fraction of the ideal speedup: (T_base / T) / (T_base / bound) = bound / T.
            fractions = [b / c for c, b in zip(comm, ideal) if c > 0 and b > 0]
            entry["ideal_fraction_p50"] = float(np.median(fractions)) if fractions else None
            entry["rail_p50_ms"] = _pct([s["rail_s"] * 1e3 for s in sel])[0]
            if base_of:
                ratios = [
                    _ratio(base_of[(s["layer"], s["step"])]["comm_s"], s["comm_s"]) for s in sel
                ]
                ratios = [r for r in ratios if r is not None]
                base = per.get(baseline, entry)
                for key in ("p50", "p95", "p99"):
                    entry[f"speedup_{key}"] = _ratio(
                        base[f"comm_{key}_ms"], entry[f"comm_{key}_ms"]
                    )
                entry["speedup_total_p50"] = _ratio(base["total_p50_ms"], entry["total_p50_ms"])
                entry["speedup_min"], entry["speedup_max"] = (
                    (min(ratios), max(ratios)) if ratios else (None, None)
                )
                # None on one node: no rail traffic, so no rail time to compare.
                entry["rail_speedup_p50"] = _ratio(base["rail_p50_ms"], entry["rail_p50_ms"])
                entry["ideal_speedup_p50"] = _ratio(
                    base["comm_p50_ms"], entry["ideal_bound_p50_ms"]
                )
                # Share of the baseline's distance to the bound that the variant closes.
                gap = base["comm_p50_ms"] - entry["ideal_bound_p50_ms"]
                entry["gap_closed_p50"] = (
                    (base["comm_p50_ms"] - entry["comm_p50_ms"]) / gap
                    if gap > 0 and entry["ideal_bound_p50_ms"] > 0
                    else None
                )
            per[variant] = entry
        summary: dict[str, Any] = {"baseline": baseline, "variants": per}
        if {"rail", "perm", "joint"} <= set(per):
            best = min(per["rail"]["comm_p50_ms"], per["perm"]["comm_p50_ms"])
            summary["joint_over_best_single"] = _ratio(best, per["joint"]["comm_p50_ms"])
            for key in ("p50", "p95", "p99"):
                best_k = min(per["rail"][f"comm_{key}_ms"], per["perm"][f"comm_{key}_ms"])
                summary[f"joint_over_best_single_{key}"] = _ratio(
                    best_k, per["joint"][f"comm_{key}_ms"]
                )
        if "joint" in per:
            for peer in (BASELINE, "native", "deepep-balanced") + PEERS:
                if peer in per:
                    summary[f"{peer}_over_joint_p50"] = _ratio(
                        per[peer]["comm_p50_ms"], per["joint"]["comm_p50_ms"]
                    )
                    summary[f"{peer}_plan_over_joint_plan_p50"] = _ratio(
                        per[peer]["plan_p50_ms"], per["joint"]["plan_p50_ms"]
                    )
                    for name in per:  # JOINT's other variants (fan-in, chunks)
                        if name.startswith("joint/"):
                            summary[f"{peer}_over_{name}_p50"] = _ratio(
                                per[peer]["comm_p50_ms"], per[name]["comm_p50_ms"]
                            )
        out[pattern] = summary
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="per-path dispatch+combine percentiles over GLM-4.5-Air layers on the network model",
        description="Model every path on the synthetic GLM-4.5-Air routing under replay "
        "arrangements: "
        "P50/P95/P99 of dispatch+combine over layers and steps, CPU planning time, "
        "speedup over NATIVE and NIC shares.",
    )
    _common.add_cluster_args(parser)
    parser.add_argument(
        "--backend", choices=["netmodel"], default="netmodel", help="what times the paths"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="YAML",
        help="netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8; default: the "
        "built-in NetModelConfig, max-min: alpha 0)",
    )
    parser.add_argument(
        "--alpha", type=float, default=None, help="override the incast alpha of --model"
    )
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload", choices=["glm45-air"], default="glm45-air", help="routing generator"
    )
    group.add_argument(
        "--pattern",
        type=_choices(_PATTERNS),
        default=["ring", "moderate", "extreme"],
        metavar="P,P",
        help="arrangements: none, ring, moderate, extreme (default ring,moderate,extreme)",
    )
    group.add_argument(
        "--layers",
        type=_layers,
        default="45",
        metavar="K|L,L",
        help="one number K: the first K MoE layers; a list: those layer numbers (default 45)",
    )
    group.add_argument("--steps", type=int, default=1, help="training steps per layer (default 1)")
    group.add_argument(
        "--tokens", type=int, default=2048, metavar="T", help="tokens per GPU (default 2048)"
    )
    group.add_argument(
        "--payload-scale",
        type=_payload_scale,
        default=1.0,
        metavar="X|paper",
        help="multiply every record count; 'paper': workloads.PAPER_PAYLOAD_SCALE (1.895: the "
        "paper's layer times, NATIVE RING on H800); default 1",
    )
    group.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    group = parser.add_argument_group("paths")
    group.add_argument(
        "--paths",
        type=_choices(_PATHS),
        default=list(_PATHS),
        metavar="P,P",
        help=f"{route_list()} (default all)",
    )
    group.add_argument(
        "--fanin",
        type=_ints,
        default=[1],
        metavar="F,F",
        help="wave fan-ins for perm/joint (default 1: cyclic, N-1 waves)",
    )
    group.add_argument(
        "--chunks",
        type=_ints,
        default=[1],
        metavar="C,C",
        help="rail chunks per wave for perm/joint (default 1: whole waves)",
    )
    group.add_argument(
        "--peers",
        type=_choices(PEERS + ("none",)),
        default=["deepep-balanced", "deepep-direct", "megatron", "fast"],
        metavar="P,P",
        help="peers on the same demand and model: deepep-balanced (the baseline on equal tokens "
        "per "
        "rank), deepep-direct (PXN-like, one copy per target GPU), megatron (NCCL all-to-all "
        "in its rotating node rounds, PXN), megatron-flat (all pairs at once), fast (per-layer "
        "BvN waves); none (default deepep-balanced,deepep-direct,megatron,fast)",
    )
    group.add_argument(
        "--path-delivery",
        choices=["after_rail", "streamed"],
        default="after_rail",
        help="stage 3 of RailWave's paths: after_rail (store and forward, as the exchange runs; "
        "default) or streamed (as DeepEP's forwarders; the baseline is always streamed)",
    )
    group.add_argument(
        "--plan-repeats",
        type=int,
        default=3,
        help="timed planning runs per sample after one warm-up (0: do not time; default 3)",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write samples and summary")
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="bar chart of P50/P95/P99 per path"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("json", "plot"))


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip().lower() for v in text.split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(
                f"expected some of {','.join(allowed)} separated by commas, got {text!r}"
            )
        return values

    return parse


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        )
    return values


def _payload_scale(text: str) -> float:
    """argparse type of --payload-scale: a positive number, or 'paper'
    (workloads.PAPER_PAYLOAD_SCALE)."""
    from megatron_railwave.lab.workloads import PAPER_PAYLOAD_SCALE

    if text.strip().lower() == "paper":
        return PAPER_PAYLOAD_SCALE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'paper', got {text!r}")
    return value


def _layers(text: str) -> list[int]:
    values = _ints(text)
    return values if "," in text else [-values[0]]  # negative: "the first K layers"


def _variants(
    paths: list[str], fanins: list[int], chunks: list[int]
) -> list[tuple[str, str, int, int]]:
    """(name, path, fan-in, rail chunks): PERM / JOINT once per fan-in and chunk count, e.g.
    'joint/f4' or 'joint/c2'; NATIVE / RAIL once."""
    out = []
    for path in paths:
        waved = path in ("perm", "joint")
        for f in fanins if waved else [1]:
            for c in chunks if waved else [1]:
                name = path + ("" if f == 1 else f"/f{f}") + ("" if c == 1 else f"/c{c}")
                out.append((name, path, f, c))
    return out


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from megatron_railwave.lab.netmodel import NetModelConfig, execute_plan, load_netmodel_config
    from megatron_railwave.lab.netmodel.bounds import ideal_bound
    from megatron_railwave.lab.netmodel.peers import model_peer
    from megatron_railwave.lab.workloads import GLM45_AIR, arrange, scaled_demand
    from megatron_railwave.planner import PlanOptions

    topo = _common.cluster_from_args(args)
    model = load_netmodel_config(args.model) if args.model else NetModelConfig()
    if args.alpha is not None:
        model = replace(model, alpha=args.alpha)
    if args.steps < 1 or args.tokens < 1 or args.plan_repeats < 0 or not args.payload_scale > 0:
        raise ValueError(
            f"need --steps >= 1, --tokens >= 1, --plan-repeats >= 0 and --payload-scale > 0, got "
            f"{args.steps}, {args.tokens}, {args.plan_repeats}, {args.payload_scale}"
        )
    known = GLM45_AIR.layer_numbers
    layers = list(known[: -args.layers[0]]) if args.layers[0] < 0 else args.layers
    bad = [v for v in layers if v not in known]
    if bad:
        raise ValueError(
            f"--layers: {bad} are not MoE layers of GLM-4.5-Air ({known[0]}..{known[-1]})"
        )
    sparse = topo.world_size * args.tokens * topo.num_nodes > _DENSE_MAX
    if sparse and set(args.pattern) != {"none"}:
        raise ValueError(
            f"--pattern {','.join(args.pattern)} needs the dense demand, which is too large at "
            f"{topo.num_nodes} nodes x {args.tokens} tokens; use --pattern none"
        )
    peers = [p for p in args.peers if p != "none"]
    if sparse:
        peers = []  # the peers need experts_WE / dense masks
    if any(c < 1 for c in args.chunks):
        raise ValueError(f"--chunks must be >= 1, got {args.chunks}")
    variants = _variants(args.paths, args.fanin, args.chunks)
    if "native" not in args.paths:
        variants.insert(
            0, ("native", "native", 1, 1)
        )  # store and forward, as the exchange runs NATIVE
    variants.insert(
        0, (BASELINE, "native", 1, 1)
    )  # the speedup baseline: DeepEP-like streamed NATIVE
    path_model = replace(model, delivery=args.path_delivery)
    base_model = replace(model, delivery="streamed")
    record_bytes = GLM45_AIR.hidden_size * 2
    samples: list[dict[str, Any]] = []
    total = len(layers) * args.steps * len(args.pattern) * (len(variants) + len(peers))
    torch.set_num_threads(1)
    with tqdm(total=total, desc="bench", unit="plan", disable=args.no_progress, leave=False) as bar:
        for step in range(args.steps):
            for layer in layers:
                base = layer_demands(
                    topo, layer=layer, step=step, tokens=args.tokens, seed=args.seed
                )
                balanced = (
                    layer_demands(
                        topo,
                        layer=layer,
                        step=step,
                        tokens=args.tokens,
                        seed=args.seed,
                        balanced_tokens=True,
                    )
                    if "deepep-balanced" in peers
                    else None
                )
                for pattern in args.pattern:
                    demand, windows = (
                        (base, None) if pattern == "none" else arrange(base, pattern, topo)
                    )
                    demand = scaled_demand(demand, args.payload_scale)
                    ideal = ideal_bound(
                        demand, topo, payload_bytes=record_bytes, phase_sync=model.phase_sync
                    )
                    cell = {
                        "pattern": pattern,
                        "layer": layer,
                        "step": step,
                        "ideal_bound_s": ideal.bound_s,
                        "ideal_resource": ideal.resource,
                    }
                    routing = (
                        _rank0_routing(demand, topo, _model_spec(topo).num_experts)
                        if args.plan_repeats
                        else None
                    )
                    for variant, path, fanin, chunks in variants:
                        options = PlanOptions(fanin=fanin, windows=windows, chunks=chunks)
                        plan, plan_s = _plan_timed(
                            demand, topo, path, options, routing, args.plan_repeats, layer
                        )
                        timing = execute_plan(
                            plan,
                            record_bytes=record_bytes,
                            demand=demand,
                            model=base_model if variant == BASELINE else path_model,
                        )
                        stats = plan.stats(record_bytes=record_bytes)
                        samples.append(
                            {
                                **cell,
                                "bound_s": timing.bound_s,
                                "bound_link": timing.bound_link,
                                "variant": variant,
                                "path": path,
                                "fanin": fanin,
                                "chunks": chunks,
                                "comm_s": timing.total_s,
                                "dispatch_s": timing.dispatch_s,
                                "combine_s": timing.combine_s,
                                "rail_s": sum(timing.rail_s_V),
                                "plan_s": plan_s,
                                "nic_shares": timing.nic_shares().tolist(),
                                "rho_g": stats.rho_g,
                                "kappa": stats.kappa,
                                "waves": plan.num_waves,
                                "model_wall_s": timing.wall_s,
                            }
                        )
                        bar.update(1)
                    for peer in peers:
                        if peer == "deepep-balanced":
                            # Its own input (equal tokens per rank), so its own bound as well.
                            bal, bal_windows = (
                                (balanced, None)
                                if pattern == "none"
                                else arrange(balanced, pattern, topo)
                            )
                            bal = scaled_demand(bal, args.payload_scale)
                            plan, plan_s = _plan_timed(
                                bal,
                                topo,
                                "native",
                                PlanOptions(windows=bal_windows),
                                None,
                                0,
                                layer,
                            )
                            timing = execute_plan(
                                plan, record_bytes=record_bytes, demand=bal, model=base_model
                            )
                            bal_ideal = ideal_bound(
                                bal, topo, payload_bytes=record_bytes, phase_sync=model.phase_sync
                            )
                            samples.append(
                                {
                                    **cell,
                                    "ideal_bound_s": bal_ideal.bound_s,
                                    "ideal_resource": bal_ideal.resource,
                                    "variant": peer,
                                    "path": peer,
                                    "fanin": 1,
                                    "comm_s": timing.total_s,
                                    "dispatch_s": timing.dispatch_s,
                                    "combine_s": timing.combine_s,
                                    "bound_s": timing.bound_s,
                                    "rail_s": sum(timing.rail_s_V),
                                    "plan_s": 0.0,
                                    "nic_shares": timing.nic_shares().tolist(),
                                    "waves": plan.num_waves,
                                }
                            )
                            bar.update(1)
                            continue
                        got = model_peer(
                            peer,
                            demand,
                            topo,
                            record_bytes=record_bytes,
                            model=model,
                            repeats=args.plan_repeats,
                        )
                        samples.append(
                            {
                                **cell,
                                "variant": peer,
                                "path": peer,
                                "fanin": 1,
                                "comm_s": got["comm_s"],
                                "dispatch_s": got["dispatch_s"],
                                "combine_s": got["combine_s"],
                                "bound_s": got["bound_s"],
                                "rail_s": 0.0,
                                "plan_s": got["plan_s"],
                                "bvn_s": got["bvn_s"],
                                "nic_shares": [0.0] * topo.num_rails,
                                "waves": got["waves"],
                            }
                        )
                        bar.update(1)
    summary = summarize_samples(samples)
    _print(summary, topo, args)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "handler"}
        config.update(
            layers=layers,
            topology=topo.to_dict(),
            record_bytes=record_bytes,
            model_spec=_model_spec(topo).name,
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
                    v["ideal_bound_p50_ms"],
                    _times(v.get("ideal_fraction_p50"), ""),
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
                "ideal bound P50",
                "of ideal",
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
        _render.print_text(
            f"{pattern}: path-independent bound P50 {base['ideal_bound_p50_ms']:.2f} ms, binding "
            f"resource (most samples) {base['ideal_resource']}; ideal speedup over "
            f"{entry['baseline']} "
            f"{_times(base.get('ideal_speedup_p50'))}; 'of ideal' = bound / time (the fraction of "
            "the ideal speedup reached)"
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
