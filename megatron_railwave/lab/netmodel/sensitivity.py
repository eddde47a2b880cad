"""Sensitivity of RailWave's gains to the input and the fabric (``railwave sensitivity``).

Letters: N nodes, G GPUs per node, W = N * G ranks, L layers, S seeds.

The gains hinge on two things no single replay pins down: how unequal the ranks' token counts
are (``GlmAirWorkload.token_skew``: 0 = equal counts, 1.46 = the generator's fit to the paper's
NIC shares) and whether a receiver port loses goodput when several senders share it (the incast
alpha). This module runs the grid

    token skew x fabric {max-min, alpha fitted on UltraEP} x arrangement pattern x seed

and reports, per (skew, fabric, pattern), RAIL / JOINT / FLOW / FLOW_WAVES over the baseline
(keys ``<path>_s`` per row, ``<path>_over_baseline`` per cell; flow-waves as ``flow_waves``) over
the seeds
(median, P10, P90), the baseline being DeepEP-like NATIVE (streamed forwarding). Per seed the
ratio is of the sums over its layers (the paper's statistic: sums of per-layer times), each
layer also carrying the two path-independent bounds (`bounds.per_record_bound`, the per-record
routing bound, and `bounds.any_routing_bound`, the bound of every routing) with their binding
resources, and every path's fraction of each (bound / time).

The fabric's alpha is fitted on the paper's UltraEP case only (`fit_alpha_ultraep`: three source
nodes to one destination, balanced rails, no workload generator involved); the paper's +67.1%
NATIVE slowdown from RING to EXTREME is then a *prediction* on the GLM replay
(`predict_incast_slowdown`), reported over seeds with its spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megatron_railwave.lab.netmodel.bounds import BOUNDS, bound_fields
from megatron_railwave.lab.netmodel.calibrate import PAPER_INCAST, PAPER_ULTRAEP, ultraep_check
from megatron_railwave.lab.netmodel.execute import NetModelConfig, execute_plan
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology

__all__ = [
    "UltraepFit",
    "fit_alpha_ultraep",
    "layer_cell",
    "predict_incast_slowdown",
    "summarize_grid",
]

SKEWS = (0.0, 0.5, 1.0, 1.46)
"""Token skews of the grid: equal counts, two intermediate, the generator's default."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UltraepFit:
    """`fit_alpha_ultraep`'s result."""

    alpha: float
    """The fit: geometric mean of the per-payload fits (log-scale midpoint)."""
    alpha_per_payload: dict[float, float]
    """MiB per GPU -> alpha at which PERM / NATIVE's dispatch equals the paper's speedup."""
    speedup_at_fit: dict[float, float]
    """MiB per GPU -> modelled PERM / NATIVE dispatch speedup at ``alpha``."""
    paper: dict[float, float]
    delivery: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "alpha_per_payload": {str(k): v for k, v in self.alpha_per_payload.items()},
            "speedup_at_fit": {str(k): v for k, v in self.speedup_at_fit.items()},
            "paper_perm_over_native": {str(k): v for k, v in self.paper.items()},
            "delivery": self.delivery,
        }


def _ultraep_speedup(topo: RailTopology, model: NetModelConfig, mib: float) -> float:
    return ultraep_check(topo, model, mib_per_gpu=(mib,))[0].dispatch_speedup


def fit_alpha_ultraep(
    topo: RailTopology, base: NetModelConfig, *, max_alpha: float = 16.0, tol: float = 1e-3
) -> UltraepFit:
    """Fit alpha on the paper's UltraEP case alone (no workload generator): per payload (28, 42
    MiB per GPU) the alpha at which the modelled PERM / NATIVE dispatch speedup equals the
    paper's (9.694x, 8.670x), by bisection (the speedup grows with alpha); the preset takes their
    geometric mean.

    Args:
        topo: a 4 x 8 cluster (the paper's shape; `calibrate.is_ultraep_cluster`).
        base: every other parameter (delivery, per-call costs, k_sat).

    Raises:
        ValueError: ``topo`` is not 4 x 8, or the paper's speedup is not reached at ``max_alpha``.
    """
    if (topo.num_nodes, topo.gpus_per_node) != (
        PAPER_ULTRAEP["nodes"],
        PAPER_ULTRAEP["gpus_per_node"],
    ):
        raise ValueError(
            f"the UltraEP fit needs the paper's 4 x 8 cluster, got {topo.num_nodes} x "
            f"{topo.gpus_per_node}; pass --alpha to set the fabric's alpha by hand"
        )
    paper = dict(zip(PAPER_ULTRAEP["mib_per_gpu"], PAPER_ULTRAEP["perm_over_native"]))
    per: dict[float, float] = {}
    for mib, target in paper.items():
        lo, hi = 0.0, max_alpha
        if _ultraep_speedup(topo, replace(base, alpha=hi), mib) < target:
            raise ValueError(
                f"UltraEP at {mib} MiB: PERM / NATIVE stays below the paper's {target}x up to "
                f"alpha {max_alpha}; raise max_alpha"
            )
        while hi - lo > tol:
            mid = 0.5 * (lo + hi)
            if _ultraep_speedup(topo, replace(base, alpha=mid), mib) < target:
                lo = mid
            else:
                hi = mid
        per[float(mib)] = round(0.5 * (lo + hi), 4)
    alpha = round(math.exp(float(np.mean(np.log(list(per.values()))))), 4)
    at_fit = {float(m): _ultraep_speedup(topo, replace(base, alpha=alpha), m) for m in paper}
    return UltraepFit(
        alpha=alpha,
        alpha_per_payload=per,
        speedup_at_fit=at_fit,
        paper={float(k): v for k, v in paper.items()},
        delivery=base.delivery,
    )


def layer_cell(
    demand: Any,
    windows: Any,
    topo: RailTopology,
    *,
    baseline: NetModelConfig,
    paths_model: NetModelConfig,
    record_bytes: int,
    paths: Sequence[str] = ("rail", "joint", "flow", "flow-waves"),
    peers: Sequence[str] = (),
    balanced: tuple[Any, Any] | None = None,
    chunks: int = 1,
    streamed: bool = False,
) -> dict[str, Any]:
    """One layer of one grid cell: seconds of the baseline (NATIVE under ``baseline``, e.g.
    streamed), of each of ``paths`` (under ``paths_model``, planned with ``chunks`` rail chunks
    and a ``streamed`` relay where the path takes them; key ``<path>_s``, '-' as '_'), of
    each of ``peers`` (`peers.model_peer` under ``baseline``'s fabric; 'deepep-balanced': the
    baseline on ``balanced``, the (demand, windows) of the same tokens split equally over the
    ranks) and the two path-independent bounds of ``demand`` with their binding resources
    (`bound_fields`)."""
    from megatron_railwave.lab.netmodel.peers import model_peer

    out: dict[str, Any] = bound_fields(
        demand, topo, record_bytes=record_bytes, phase_sync=baseline.phase_sync
    )
    path_options = PlanOptions(windows=windows, chunks=chunks, streamed=streamed)
    for name, path, model, options in [
        ("baseline", "native", baseline, PlanOptions(windows=windows))
    ] + [(p.replace("-", "_"), p, paths_model, path_options) for p in paths]:
        plan = build_plan(demand, topo, path, options=options)
        out[f"{name}_s"] = execute_plan(
            plan, record_bytes=record_bytes, model=model, demand=demand
        ).total_s
    for peer in peers:
        key = f"{peer.replace('-', '_')}_s"
        if peer == "deepep-balanced":
            if balanced is None:
                raise ValueError(
                    "the deepep-balanced peer needs the token-balanced (demand, windows)"
                )
            plan = build_plan(balanced[0], topo, "native", options=PlanOptions(windows=balanced[1]))
            out[key] = execute_plan(
                plan, record_bytes=record_bytes, model=baseline, demand=balanced[0]
            ).total_s
        else:
            out[key] = model_peer(
                peer, demand, topo, record_bytes=record_bytes, model=baseline, repeats=0
            )["comm_s"]
    return out


def predict_incast_slowdown(
    topo: RailTopology,
    model: NetModelConfig,
    *,
    seeds: Sequence[int],
    layer_sets: Callable[[int], Sequence[tuple[Any, Any, Any, Any]]],
    record_bytes: int,
) -> dict[str, Any]:
    """The paper's incast experiment as a prediction: per seed, NATIVE's sum over layers of
    EXTREME / RING under ``model``; ``layer_sets(seed)`` yields (ring demand, ring windows,
    extreme demand, extreme windows) per layer."""
    ratios = []
    for seed in seeds:
        ring = extreme = 0.0
        for ring_d, ring_w, ext_d, ext_w in layer_sets(seed):
            for demand, windows, acc in ((ring_d, ring_w, "ring"), (ext_d, ext_w, "extreme")):
                plan = build_plan(demand, topo, Route.NATIVE, options=PlanOptions(windows=windows))
                t = execute_plan(
                    plan, record_bytes=record_bytes, model=model, demand=demand
                ).total_s
                if acc == "ring":
                    ring += t
                else:
                    extreme += t
        ratios.append(extreme / ring)
    target = PAPER_INCAST["high_s"] / PAPER_INCAST["low_s"]
    return {
        "paper": target,
        "per_seed": dict(zip((int(s) for s in seeds), ratios)),
        "median": float(np.median(ratios)),
        "p10": float(np.percentile(ratios, 10)),
        "p90": float(np.percentile(ratios, 90)),
        "min": float(min(ratios)),
        "max": float(max(ratios)),
    }


def summarize_grid(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (skew, fabric, pattern): per seed the ratio of layer sums baseline / path (and
    baseline / bound for both bounds, the largest speedup a routing of that class could have),
    then median, P10 and P90 over the seeds; every path's fraction of each bound (sum of the
    bound / sum of the path's time, per seed; median, P10, P90) and each bound's binding resource
    (the one most layers name)."""
    keys = list(dict.fromkeys((r["skew"], r["fabric"], r["pattern"]) for r in rows))
    bound_keys = {f"{b}_bound_s": b for b in BOUNDS}
    out = []
    for skew, fabric, pattern in keys:
        sel = [r for r in rows if (r["skew"], r["fabric"], r["pattern"]) == (skew, fabric, pattern)]
        per_seed: dict[int, dict[str, float]] = {}
        for r in sel:
            acc = per_seed.setdefault(r["seed"], {})
            for k, v in r.items():
                if k.endswith("_s"):
                    acc[k] = acc.get(k, 0.0) + v
        entry: dict[str, Any] = {
            "skew": skew,
            "fabric": fabric,
            "pattern": pattern,
            "seeds": len(per_seed),
            "layers_per_seed": len(sel) // max(1, len(per_seed)),
        }
        first = next(iter(per_seed.values()))
        names = [k[:-2] for k in first if k.endswith("_s") and k not in ("baseline_s",)]
        for name in names:
            ratio = [
                acc["baseline_s"] / acc[f"{name}_s"]
                for acc in per_seed.values()
                if acc[f"{name}_s"] > 0
            ]
            label = bound_keys.get(f"{name}_s", name)
            entry[f"{label}_over_baseline"] = _stats(ratio)
        # Every path's fraction of each bound: bound / time, per seed (the token-balanced peer
        # runs another input, so its ratio is to the baseline only).
        paths = [k[:-2] for k in first if k.endswith("_s") and k not in bound_keys]
        for bound_key, bound in bound_keys.items():
            if bound_key not in first:
                continue
            for name in paths:
                if name == "deepep_balanced":
                    continue
                frac = [
                    acc[bound_key] / acc[f"{name}_s"]
                    for acc in per_seed.values()
                    if acc[f"{name}_s"] > 0
                ]
                if not frac:
                    continue
                stats = _stats(frac)
                entry[f"{name}_{bound}_fraction_median"] = stats["median"]
                entry[f"{name}_{bound}_fraction"] = stats
            resources = [r[f"{bound}_resource"] for r in sel if f"{bound}_resource" in r]
            if resources:
                entry[f"{bound}_resource"] = max(set(resources), key=resources.count)
        out.append(entry)
    return out


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "median": float(np.median(values)),
        "p10": float(np.percentile(values, 10)),
        "p90": float(np.percentile(values, 90)),
        "per_seed": [float(x) for x in values],
    }
