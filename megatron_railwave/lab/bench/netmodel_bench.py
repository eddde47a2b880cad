"""The modelled benchmark of ``railwave bench``: dispatch + combine of every path over synthetic
GLM-4.5-Air layers on the flow model, and its summary.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, K top-k, E experts,
M = 2**G target masks.

Samples: every (layer, step) of the synthetic GLM-4.5-Air routing (`workloads.glm`), arranged into
each ``--pattern``'s sending windows (`workloads.arrange`; ``none`` = all node pairs at once, as a
training step sends). Variants: the baseline ``deepep`` (NATIVE with streamed forwarding, what
DeepEP's normal kernels do), the paths (PERM / JOINT once per ``--fanin`` and ``--chunks``; run
as ``--path-delivery`` says) and the ``--peers`` (`netmodel.peers`; ``deepep-balanced`` is the
baseline on the same step's tokens split equally over the ranks). Per sample and variant:
  * communication: `netmodel.execute_plan` (dispatch + combine, seconds; deterministic);
  * the two path-independent bounds of the input (`netmodel.bounds`: the per-record routing
    bound and the any-routing bound) and their binding resources, beside the path's own
    busiest-link bound;
  * planning: wall time on this CPU of rank 0's per-layer planning as the exchange runs it
    (``bench.planning.time_rank_planning``: records from its routing, ``build_plan``, the
    schedule and rank view, the index maps; median of ``--plan-repeats`` after one warm-up), added
    unscaled.
Summary per pattern and variant: P50 / P95 / P99 over samples of communication, planning and
their sum; speedup over the baseline (ratio of P50s, and the range of per-sample ratios); per
bound its P50, the fraction of it reached (bound / time, median over samples), the largest
speedup it allows (baseline / bound) and the share of the baseline's gap to it closed; NIC
shares (each node's adapter egress shares sorted descending, mean over nodes and samples).

Experts: E = 128 (GLM-4.5-Air) when W divides 128, else one expert per rank beyond that (E = the
next multiple of W at or above 128). Beyond ``W * T * N`` = 2**24 the demand is built sparsely
(no [W, T, N] masks; `workloads.SparseDemand`), which supports ``--pattern none`` only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from megatron_railwave.lab.workloads import GLM45_AIR
from megatron_railwave.names import STREAMED_SUFFIX, parse_route

__all__ = [
    "BASELINE",
    "PEERS",
    "RECORD_BYTES",
    "bench_samples",
    "bench_variants",
    "is_sparse",
    "layer_demands",
    "model_spec",
    "summarize_samples",
]

PEERS = ("deepep-balanced", "deepep-direct", "megatron", "megatron-flat", "fast")
"""Peers beside the paths (`netmodel.peers`): deepep-balanced is the baseline on the token-balanced
input (`layer_demands(balanced_tokens=True)`)."""
_DENSE_MAX = 1 << 24

RECORD_BYTES = GLM45_AIR.hidden_size * 2
"""Bytes of one record (token row) of the GLM-4.5-Air layers: hidden 4096, bf16."""


def model_spec(topo: Any) -> Any:
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

    spec = model_spec(topo)
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


def rank0_routing(demand: Any, topo: Any, num_experts: int) -> torch.Tensor:
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


def plan_timed(
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
    present, else ``native``), both path-independent bounds (`bounds.BOUNDS`) and the fraction
    of each reached, NIC shares."""
    from megatron_railwave.lab.netmodel.bounds import BOUNDS

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
            for b in BOUNDS:
                # Path-independent (netmodel.bounds; tests/unit/netmodel/test_any_routing_bound.py):
                # comm / bound >= 1; bound / comm is the fraction of the bound reached (of the
                # largest speedup a routing of that class allows: (T_base / T) / (T_base / bound)).
                bound_ms = [s.get(f"{b}_bound_s", 0.0) * 1e3 for s in sel]
                entry[f"{b}_bound_p50_ms"] = _pct(bound_ms)[0]
                resources = [s.get(f"{b}_resource", "-") for s in sel]
                entry[f"{b}_resource"] = max(set(resources), key=resources.count)
                over = [c / x for c, x in zip(comm, bound_ms) if x > 0]
                entry[f"comm_over_{b}_min"] = min(over) if over else None
                fractions = [x / c for c, x in zip(comm, bound_ms) if c > 0 and x > 0]
                entry[f"{b}_fraction_p50"] = float(np.median(fractions)) if fractions else None
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
                for b in BOUNDS:
                    bound_ms = entry[f"{b}_bound_p50_ms"]
                    entry[f"{b}_speedup_p50"] = _ratio(base["comm_p50_ms"], bound_ms)
                    # Share of the baseline's distance to the bound that the variant closes.
                    gap = base["comm_p50_ms"] - bound_ms
                    entry[f"{b}_gap_closed_p50"] = (
                        (base["comm_p50_ms"] - entry["comm_p50_ms"]) / gap
                        if gap > 0 and bound_ms > 0
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


def bench_variants(
    paths: list[str], fanins: list[int], chunks: list[int], *, streamed: bool = False
) -> list[tuple[str, str, int, int, bool]]:
    """(name, path, fan-in, rail chunks, streamed relay): PERM / JOINT once per fan-in and chunk
    count, e.g. 'joint/f4' or 'joint/c2'; NATIVE / RAIL once; with ``streamed`` every variant of a
    relaying route (RAIL, JOINT, FLOW, FLOW_WAVES) also with its relay streamed into its rail
    phases ('joint+streamed', ``PlanOptions.streamed``)."""
    out = []
    for path in paths:
        route = parse_route(path)
        waved = path in ("perm", "joint")
        for f in fanins if waved else [1]:
            for c in chunks if waved else [1]:
                name = path + ("" if f == 1 else f"/f{f}") + ("" if c == 1 else f"/c{c}")
                out.append((name, path, f, c, False))
                if streamed and (route.balanced or route.min_max):
                    out.append((name + STREAMED_SUFFIX, path, f, c, True))
    return out


def is_sparse(topo: Any, tokens: int) -> bool:
    """Whether the demand at ``tokens`` per GPU is built sparsely (``workloads.SparseDemand``:
    beyond ``W * T * N`` = 2**24), which supports the all-pairs arrangement ``none`` only."""
    return topo.world_size * tokens * topo.num_nodes > _DENSE_MAX


def bench_samples(
    topo: Any,
    model: Any,
    *,
    layers: list[int],
    steps: int,
    tokens: int,
    seed: int,
    patterns: list[str],
    payload_scale: float,
    paths: list[str],
    fanins: list[int],
    chunks: list[int],
    peers: list[str],
    path_delivery: str,
    plan_repeats: int,
    progress: bool = True,
    streamed: bool = False,
) -> list[dict[str, Any]]:
    """One row per (step, layer, pattern) sample and variant (module docstring): the baseline
    ``deepep``, NATIVE, each path once per fan-in and chunk count (``bench_variants``) and the
    ``peers`` (none on a sparse demand: they need the dense masks)."""
    from tqdm.auto import tqdm

    from megatron_railwave.lab.netmodel import execute_plan
    from megatron_railwave.lab.netmodel.bounds import bound_fields
    from megatron_railwave.lab.netmodel.peers import model_peer
    from megatron_railwave.lab.workloads import arrange, scaled_demand
    from megatron_railwave.planner import PlanOptions

    if is_sparse(topo, tokens):
        peers = []  # the peers need experts_WE / dense masks
    variants = bench_variants(paths, fanins, chunks, streamed=streamed)
    if "native" not in paths:
        variants.insert(
            0, ("native", "native", 1, 1, False)
        )  # store and forward, as the exchange runs NATIVE
    variants.insert(
        0, (BASELINE, "native", 1, 1, False)
    )  # the speedup baseline: DeepEP-like streamed NATIVE
    path_model = replace(model, delivery=path_delivery)
    base_model = replace(model, delivery="streamed")
    record_bytes = RECORD_BYTES
    samples: list[dict[str, Any]] = []
    total = len(layers) * steps * len(patterns) * (len(variants) + len(peers))
    with tqdm(total=total, desc="bench", unit="plan", disable=not progress, leave=False) as bar:
        for step in range(steps):
            for layer in layers:
                base = layer_demands(topo, layer=layer, step=step, tokens=tokens, seed=seed)
                balanced = (
                    layer_demands(
                        topo,
                        layer=layer,
                        step=step,
                        tokens=tokens,
                        seed=seed,
                        balanced_tokens=True,
                    )
                    if "deepep-balanced" in peers
                    else None
                )
                for pattern in patterns:
                    demand, windows = (
                        (base, None) if pattern == "none" else arrange(base, pattern, topo)
                    )
                    demand = scaled_demand(demand, payload_scale)
                    cell = {
                        "pattern": pattern,
                        "layer": layer,
                        "step": step,
                        **bound_fields(
                            demand, topo, record_bytes=record_bytes, phase_sync=model.phase_sync
                        ),
                    }
                    routing = (
                        rank0_routing(demand, topo, model_spec(topo).num_experts)
                        if plan_repeats
                        else None
                    )
                    for variant, path, fanin, chunks, relay_streamed in variants:
                        options = PlanOptions(
                            fanin=fanin, windows=windows, chunks=chunks, streamed=relay_streamed
                        )
                        plan, plan_s = plan_timed(
                            demand, topo, path, options, routing, plan_repeats, layer
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
                                "streamed": relay_streamed,
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
                            bal = scaled_demand(bal, payload_scale)
                            plan, plan_s = plan_timed(
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
                            samples.append(
                                {
                                    **cell,
                                    **bound_fields(
                                        bal,
                                        topo,
                                        record_bytes=record_bytes,
                                        phase_sync=model.phase_sync,
                                    ),
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
                            repeats=plan_repeats,
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
    return samples
