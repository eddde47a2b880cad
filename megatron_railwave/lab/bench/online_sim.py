"""The online selector on the flow model as the clock (``railwave online-sim``).

Letters: S steps, L MoE layers, P paths (the base's ``variants``: every route, and with
``streamed`` every route again with its relay streamed, 'joint+streamed'), X routing epochs.

What runs: the synthetic GLM-4.5-Air routing (``workloads.glm``), one demand per layer and
routing epoch (epoch e = steps [e * routing_every, (e + 1) * routing_every): the workload's
``step`` e, so the descriptors move during the run and the selector meets new neighbourhoods);
every path's time of every (epoch, layer) from the flow model (``netmodel.simulate_plan``, exact
deliveries), once; then per call a multiplicative noise exp(noise * z), z ~ N(0, 1) drawn per
(step, layer, path) from ``seed``, the same draw for every policy. The online selector (one
``OnlineSelector`` per layer, as in the dispatcher) sees each call's time at the layer's next
call, as the count exchange would bring it. Policies compared on the same draws: online,
always-X for each path, the per-layer oracle (the best fixed path of each layer in hindsight,
the issue's reference) and the per-call oracle (a lower bound no selector reaches: the best path
of every call, noise included).

Cost: the host work of the online selector per layer call, as the dispatcher does it after the
count exchange, part by part on this machine's clock (thread CPU time; per call, then summarised):
the timing words (this rank's ``encode_timing`` and ``exchange.layer.pack_status``, and the W
received words' ``TimingWords``, as ``gather_demand`` reads them), ``observe`` (every rank's timing
word, W of them), the descriptors from the gathered [W, N] counts (``fast_descriptors``) and
``decide``; next to it, on the same counts, the descriptors of the statistics
(``stats.demand_stats``, torch); the bytes the selector adds to the count message
(``exchange.layer.count_row_words`` with and without the timing word: 0, it shares the status word).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from megatron_railwave.config import OnlineSettings
from megatron_railwave.exchange.layer import TimingWords, count_row_words, pack_status
from megatron_railwave.names import ROUTES, Candidate, parse_candidate
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.selector.learned import learned_paths
from megatron_railwave.selector.online import (
    OnlineSelector,
    SharedNeighbourhoods,
    encode_timing,
    fast_descriptors,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, SelectorScales

__all__ = [
    "BaseTimes",
    "base_times",
    "base_to_json",
    "base_from_json",
    "simulate_online",
    "charged_totals",
    "learned_report",
    "PATHS",
    "base_variants",
]

PATHS: tuple[Candidate, ...] = tuple(Candidate(r) for r in ROUTES)
"""The base's paths without ``streamed``: every route, whole relay."""


def base_variants(*, streamed: bool) -> tuple[Candidate, ...]:
    """The paths a base times: every route, and with ``streamed`` every route again with its
    relay streamed into its rail phases (the online selector's '+streamed' candidates)."""
    return PATHS + (tuple(Candidate(r, streamed=True) for r in ROUTES) if streamed else ())


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseTimes:
    """Noise-free flow-model times and the layers' counts.

    Attributes:
        layers: [L] layer numbers.
        seconds_XLP: [X, L, P] seconds of one dispatch + combine (``variants`` order).
        records_XL: [X][L] gathered [W, N] records (what the dispatcher's selector reads).
        record_bytes: payload bytes per record.
        plan_s_XLP: [X, L, P] host seconds of ``build_plan`` per (epoch, layer, path) (measured
            perf_counter on this host; charged to the online selector for each path it probes),
            or None when not measured (an older JSON).
    """

    layers: tuple[int, ...]
    seconds_XLP: np.ndarray
    records_XL: list[list[np.ndarray]]
    record_bytes: int
    wall_s: float
    plan_s_XLP: np.ndarray | None = None
    variants: tuple[Candidate, ...] = PATHS
    """The paths timed (the P axis)."""


def base_times(
    topo: RailTopology,
    models: list[Any],
    *,
    epochs: int,
    tokens: int,
    workload_seed: int,
    layers: tuple[int, ...] | None,
    record_bytes: int,
    options: PlanOptions | None = None,
    variants: tuple[Candidate, ...] = PATHS,
    progress: bool = False,
) -> list[BaseTimes]:
    """Every variant's flow-model time per (routing epoch, layer) under each of ``models`` (one
    ``BaseTimes`` each; the routing is generated once); epoch e is the workload's step e. A
    variant plans with ``options``, its relay streamed as it says."""
    from megatron_railwave.lab.netmodel import simulate_plan
    from megatron_railwave.lab.workloads import GlmAirWorkload, glm_air_demands

    t0 = time.perf_counter()
    seconds: list[list[list[list[float]]]] = [[] for _ in models]
    plan_s: list[list[list[float]]] = []
    records = []
    numbers: tuple[int, ...] = ()
    for e in range(epochs):
        work = GlmAirWorkload(num_tokens=tokens, seed=workload_seed, step=e, layers=layers)
        per_layer = glm_air_demands(topo, work)
        numbers = tuple(per_layer)
        rows: list[list[list[float]]] = [[] for _ in models]
        recs, plan_row = [], []
        for demand in per_layer.values():
            plans, plan_times = [], []
            for v in variants:
                t_plan = time.perf_counter()
                v_options = replace(options or PlanOptions(), streamed=v.streamed)
                plans.append(build_plan(demand, topo, v.route, options=v_options))
                plan_times.append(time.perf_counter() - t_plan)
            plan_row.append(plan_times)
            for k, model in enumerate(models):
                rows[k].append(
                    [
                        simulate_plan(plan, record_bytes=record_bytes, model=model, demand=demand)
                        for plan in plans
                    ]
                )
            recs.append(demand.records_WN.numpy().copy())
        if progress:
            print(
                f"  routing epoch {e + 1}/{epochs}: {len(per_layer)} layers x {len(variants)} "
                f"paths x {len(models)} model(s) "
                f"simulated ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        for k in range(len(models)):
            seconds[k].append(rows[k])
        records.append(recs)
        plan_s.append(plan_row)
    wall = time.perf_counter() - t0
    return [
        BaseTimes(
            layers=numbers,
            seconds_XLP=np.asarray(sec, dtype=np.float64),
            records_XL=records,
            record_bytes=record_bytes,
            wall_s=wall,
            plan_s_XLP=np.asarray(plan_s, dtype=np.float64),
            variants=tuple(variants),
        )
        for sec in seconds
    ]


def base_to_json(base: BaseTimes) -> dict[str, Any]:
    """The JSON ``models[...]['base']`` of ``railwave online-sim`` (``base_from_json`` reads it):
    the layers, the flow model's seconds per epoch, layer and path, the counts and the planning
    times."""
    return {
        "layers": list(base.layers),
        "seconds_XLP": base.seconds_XLP.tolist(),
        "paths": list(map(str, base.variants)),
        "records_XLWN": [[r.tolist() for r in row] for row in base.records_XL],
        "plan_s_XLP": None if base.plan_s_XLP is None else base.plan_s_XLP.tolist(),
    }


def base_from_json(data: dict[str, Any], record_bytes: int) -> BaseTimes:
    """A ``BaseTimes`` from an earlier run's JSON ``models[...]['base']``."""
    return BaseTimes(
        layers=tuple(data["layers"]),
        seconds_XLP=np.asarray(data["seconds_XLP"], dtype=np.float64),
        records_XL=[[np.asarray(r, dtype=np.int64) for r in row] for row in data["records_XLWN"]],
        record_bytes=record_bytes,
        wall_s=0.0,
        plan_s_XLP=(
            None
            if data.get("plan_s_XLP") is None
            else np.asarray(data["plan_s_XLP"], dtype=np.float64)
        ),
        variants=tuple(parse_candidate(p) for p in data.get("paths", map(str, PATHS))),
    )


def simulate_online(
    base: BaseTimes,
    topo: RailTopology,
    *,
    steps: int,
    routing_every: int,
    seed: int,
    noise: float,
    settings: OnlineSettings | None = None,
    scales: tuple[float, float, float] | None = None,
) -> dict[str, Any]:
    """One run of ``steps`` steps (module docstring). Returns the JSON-ready result, plus the
    selectors under ``"_selectors"`` (for the learned-paths report, ``learned_report``)."""
    if steps < 1 or routing_every < 1:
        raise ValueError(f"steps ({steps}) and routing_every ({routing_every}) must be >= 1")
    if not (noise >= 0 and math.isfinite(noise)):
        raise ValueError(
            f"noise must be a finite number >= 0 (log-normal sigma per call), got {noise}"
        )
    variants = base.variants
    x, num_layers, _ = base.seconds_XLP.shape
    epoch_S = np.minimum(np.arange(steps) // routing_every, x - 1)
    rng = np.random.default_rng([seed, 0x0511])
    t_SLP = base.seconds_XLP[epoch_S] * np.exp(
        noise * rng.standard_normal((steps, num_layers, len(variants)))
    )
    scales = scales or SelectorScales().resolve(topo)
    settings = settings or OnlineSettings()
    untimed = [c for c in settings.candidates if parse_candidate(c) not in variants]
    if untimed:
        raise ValueError(
            f"the candidates {untimed} have no times in this base (it timed "
            f"{[str(v) for v in variants]}); time the '+streamed' variants with --streamed"
        )
    shared = SharedNeighbourhoods()  # one process's layers, as in the dispatcher
    selectors = [
        OnlineSelector(settings, scales=scales, layer=layer, shared=shared) for layer in base.layers
    ]
    chosen_SL = np.zeros((steps, num_layers), dtype=np.int64)
    modes: list[list[str]] = [[] for _ in base.layers]
    cpu_ns_SL4 = np.zeros(
        (steps, num_layers, 4), dtype=np.int64
    )  # words, observe, descriptors, decide
    wall_ns = 0
    host_ns_SL = np.zeros((steps, num_layers), dtype=np.int64)  # perf_counter, observe..decide
    world = topo.world_size
    prev: list[float | None] = [None] * num_layers
    # The first call loads the compiled library (once per process): outside the timed calls.
    fast_descriptors(base.records_XL[0][0], topo, record_bytes=base.record_bytes, scales=scales)
    for s in range(steps):
        e = int(epoch_S[s])
        for li, sel in enumerate(selectors):
            t0, cw = time.perf_counter_ns(), time.thread_time_ns()
            status = [
                pack_status(0, encode_timing(prev[li], expected=sel.expects_timing()))
            ] * world  # every rank's
            words = TimingWords(status, max(status))  # as gather_demand reads them
            c0 = time.thread_time_ns()
            sel.observe(words)
            c1 = time.thread_time_ns()
            descr = fast_descriptors(
                base.records_XL[e][li], topo, record_bytes=base.record_bytes, scales=scales
            )
            c2 = time.thread_time_ns()
            d = sel.decide("train", descr)
            c3 = time.thread_time_ns()
            host_ns_SL[s, li] = time.perf_counter_ns() - t0
            wall_ns += int(host_ns_SL[s, li])
            cpu_ns_SL4[s, li] = (c0 - cw, c1 - c0, c2 - c1, c3 - c2)
            k = variants.index(d.candidate)
            chosen_SL[s, li] = k
            modes[li].append(d.mode)
            prev[li] = float(t_SLP[s, li, k])
    online_SL = np.take_along_axis(t_SLP, chosen_SL[..., None], axis=2)[..., 0]
    per_layer_path_LP = t_SLP.sum(axis=0)  # [L, P] each fixed path's total per layer
    oracle_L = per_layer_path_LP.min(axis=1)
    oracle_path_L = per_layer_path_LP.argmin(axis=1)
    totals = {
        "online": float(online_SL.sum()),
        "oracle_per_layer": float(oracle_L.sum()),
        "oracle_per_call": float(t_SLP.min(axis=2).sum()),
        **{f"always_{p}": float(per_layer_path_LP[:, k].sum()) for k, p in enumerate(variants)},
    }
    probe_SL = np.array(
        [[m in ("probe", "reprobe") for m in ms] for ms in modes], dtype=bool
    ).T  # [S, L]
    totals.update(
        charged_totals(t_SLP, chosen_SL, epoch_S, host_ns_SL * 1e-9, probe_SL, base.plan_s_XLP)
    )
    oracle = totals["oracle_per_layer"]
    calls = steps * num_layers
    probe_calls = sum(m.count("probe") + m.count("reprobe") for m in modes)
    layers_out = []
    for li, layer in enumerate(base.layers):
        counts = np.bincount(chosen_SL[:, li], minlength=len(variants))
        row = {
            "layer": int(layer),
            "chosen": {str(p): int(counts[k]) for k, p in enumerate(variants)},
            "final_path": str(variants[chosen_SL[-1, li]]),
            "oracle_path": str(variants[oracle_path_L[li]]),
            "online_s": float(online_SL[:, li].sum()),
            "oracle_s": float(oracle_L[li]),
            "regret": float(online_SL[:, li].sum() / oracle_L[li] - 1.0),
            "fixed_s": {str(p): float(per_layer_path_LP[li, k]) for k, p in enumerate(variants)},
            "probes": sum(m in ("probe", "reprobe") for m in modes[li]),
            "neighbourhoods": len(selectors[li]._tables.get("train", [])),
            "path_per_step": [str(variants[k]) for k in chosen_SL[:, li]],
            "mode_per_step": modes[li],
        }
        layers_out.append(row)
    cost = decision_cost(cpu_ns_SL4, wall_ns, base, topo, scales)
    experts = topo.world_size  # any multiple of W: the timing word's share does not depend on it
    extra_words = count_row_words(topo, experts, timing=True) - count_row_words(
        topo, experts, timing=False
    )
    epoch_oracle = totals["oracle_per_epoch"]
    summary = {
        "totals_s": totals,
        "ratio_to_oracle": {k: v / oracle for k, v in totals.items()},
        "ratio_to_epoch_oracle": {k: v / epoch_oracle for k, v in totals.items()},
        "planning_measured": base.plan_s_XLP is not None,
        "goals": {
            "within_1.03x_oracle": totals["online"] <= 1.03 * oracle,
            "charged_within_1.02x_epoch_oracle": totals["online_charged"] <= 1.02 * epoch_oracle,
            "below_always_native": totals["online"] < totals["always_native"],
            "below_always_joint": totals["online"] < totals["always_joint"],
        },
        "probe_calls": probe_calls,
        "calls": calls,
        "layers_final_on_oracle_path": sum(r["final_path"] == r["oracle_path"] for r in layers_out),
        "num_layers": num_layers,
        "cost": {
            **cost,
            "extra_bytes_per_peer_message": extra_words * 8,
            "extra_bytes_per_rank_per_layer_call": extra_words * 8 * topo.world_size,
        },
    }
    summary["goals"]["all_met"] = all(summary["goals"].values())
    return {"summary": summary, "layers": layers_out, "_selectors": selectors}


def charged_totals(
    t_SLP: np.ndarray,
    chosen_SL: np.ndarray,
    epoch_S: np.ndarray,
    host_s_SL: np.ndarray,
    probe_SL: np.ndarray,
    plan_s_XLP: np.ndarray | None,
) -> dict[str, float]:
    """The online selector's totals with its costs counted in, and the per-epoch hindsight oracle.

    Args:
        t_SLP: [S, L, P] float seconds of every path per (step, layer) (the base's variants).
        chosen_SL: [S, L] int index into the variants of the path the selector ran.
        epoch_S: [S] int routing epoch of each step.
        host_s_SL: [S, L] float host seconds of the selector per call (perf_counter around
            observe + descriptors + decide).
        probe_SL: [S, L] bool, True where the call was a probe or re-probe.
        plan_s_XLP: [X, L, P] float host seconds of ``build_plan`` per (epoch, layer, path), or
            None (not measured: planning counts 0).

    Returns: ``online`` (exchange seconds of the chosen paths), ``host_s``, ``probe_planning_s``
    (``build_plan`` seconds of each probed path at its epoch), ``online_charged`` (their sum) and
    ``oracle_per_epoch`` (the best fixed path of each (epoch, layer) in hindsight, summed).
    """
    online = float(np.take_along_axis(t_SLP, chosen_SL[..., None], axis=2).sum())
    planning = 0.0
    if plan_s_XLP is not None:
        plan_SLP = plan_s_XLP[epoch_S]
        planning = float(
            np.take_along_axis(plan_SLP, chosen_SL[..., None], axis=2)[..., 0][probe_SL].sum()
        )
    host = float(host_s_SL.sum())
    epoch_oracle = 0.0
    for e in np.unique(epoch_S):
        epoch_oracle += float(t_SLP[epoch_S == e].sum(axis=0).min(axis=1).sum())
    return {
        "host_s": host,
        "probe_planning_s": planning,
        "online_charged": online + host + planning,
        "oracle_per_epoch": epoch_oracle,
    }


def decision_cost(
    cpu_ns_SL4: np.ndarray,
    wall_ns: int,
    base: BaseTimes,
    topo: RailTopology,
    scales: tuple[float, float, float],
) -> dict[str, Any]:
    """The online selector's host cost per layer call from the per-call thread CPU times of
    ``simulate_online`` ([S, L, 4]: words, observe, descriptors, decide): mean / p50 / p90 / p99 /
    max microseconds of each part and of their sum, the mean wall time of the sum, and the reference
    descriptors (``stats.demand_stats``, torch) timed on the same counts."""
    from megatron_railwave.telemetry.stats import demand_stats

    def summary(ns: np.ndarray) -> dict[str, float]:
        us = ns.reshape(-1) / 1e3
        p50, p90, p99 = np.percentile(us, [50, 90, 99])
        return {
            "mean": float(us.mean()),
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "max": float(us.max()),
        }

    records = [r for row in base.records_XL for r in row]
    reps = max(50, len(records))
    demands = [
        DemandCounts(records_WN=torch.from_numpy(records[i % len(records)])) for i in range(reps)
    ]
    c0 = time.thread_time_ns()
    for demand in demands:
        demand_stats(demand, topo, record_bytes=base.record_bytes)
    reference_us = (time.thread_time_ns() - c0) / reps / 1e3
    reads = []
    for _ in range(1000):  # what one read of the clock adds to each part (reads back to back)
        c0 = time.thread_time_ns()
        reads.append(time.thread_time_ns() - c0)
    calls = cpu_ns_SL4.shape[0] * cpu_ns_SL4.shape[1]
    return {
        "cpu_us_per_call": {
            "words": summary(cpu_ns_SL4[..., 0]),
            "observe": summary(cpu_ns_SL4[..., 1]),
            "descriptors": summary(cpu_ns_SL4[..., 2]),
            "decide": summary(cpu_ns_SL4[..., 3]),
            "total": summary(cpu_ns_SL4.sum(axis=2)),
        },
        "wall_us_per_call_total_mean": wall_ns / calls / 1e3,
        "reference_descriptors_cpu_us_per_call": reference_us,
        "clock_read_us": float(np.median(reads)) / 1e3,
        # means of words + observe + decide and of the descriptors (the split the earlier runs
        # reported)
        "decision_cpu_us_per_call": float((cpu_ns_SL4[..., [0, 1, 3]].sum(axis=2)).mean() / 1e3),
        "descriptors_cpu_us_per_call": float(cpu_ns_SL4[..., 2].mean() / 1e3),
        "note": "thread CPU time of this process on the machine that ran this, per call; each "
        "part includes "
        "about one clock read (clock_read_us), the total about four; max includes Python's garbage "
        "collector when it runs inside a call; wall is inflated on a loaded machine",
    }


def learned_report(result: dict[str, Any], topo: RailTopology) -> dict[str, Any]:
    """What the online selectors of a ``simulate_online`` run learned (``selector.learned``'s
    report, as ``online_out`` writes it in a training job)."""
    return learned_paths(result["_selectors"], topo)
