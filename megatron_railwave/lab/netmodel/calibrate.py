"""Calibration of the incast penalty to the paper's incast experiment.

Letters: N nodes, G GPUs per node, W = N * G ranks, M = 2**G target masks.

The experiment (REFERENCE.md section 1): GLM-4.5-Air, all 45 MoE layers, H800 4 x 8, NATIVE,
the same demand sent in three windows; only which node pairs share a window changes. The sum
over layers of the per-layer P50 dispatch + combine time goes from 1.801 s (pairs one-to-one)
to 3.009 s (concentrated pairs), +67.1%. We replay it with the synthetic GLM-4.5-Air routing
(`workloads.glm_air_demands`) arranged as RING (one-to-one) and EXTREME (peak incast [3, 3, 2]),
and fit one number, `NetModelConfig.alpha`, so that the modelled EXTREME / RING ratio of the
sums is 3.009 / 1.801. The model is deterministic, so a layer's P50 is its modelled time.

Scale: the flow model is linear in bytes except for the fixed per-wave cost, so the record
counts are first multiplied by one factor (``payload_scale``) that makes the RING sum 1.801 s;
``payload_scale * tokens`` is the token count per GPU our workload needs to take the paper's
time, a plausibility check. Nothing else is fitted: ``wave_latency_s``, the per-call costs,
``k_free``, ``k_sat`` and the NVLink / rail speeds are stated (docs/netmodel.md). The experiment
has at most 3 senders per receiver port, so with ``k_sat >= 2`` the fit is the same for the
saturating and the linear law; they differ only beyond k = 3, where nothing was measured.

Cross-check (not fitted): the paper's UltraEP case (appendix A.2; three source nodes send to one
destination node, source rails balanced, about 28 / 42 MiB per GPU) measured PERM 9.694x / 8.670x
faster than NATIVE. Under max-min the two take about the same time (the destination's ports carry
the same bytes either way), so that speedup is a second, independent reading of the same penalty;
``ultraep_check`` replays it on a fitted model.

    railwave netmodel fit-incast --cluster h800_4x8 --max-alpha 8 --write-model
    megatron_railwave/configs/netmodel/h800_4x8_paper_incast.yaml
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from megatron_railwave.lab.netmodel.execute import NetModelConfig, execute_plan
from megatron_railwave.lab.workloads import (
    demand_from_topk_ids,
    one_destination_topk_ids,
    scaled_demand,
)
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions, WaveSchedule, build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "PAPER_INCAST",
    "PAPER_ULTRAEP",
    "IncastCalibration",
    "ConcentrationCheck",
    "arranged_layers",
    "pattern_sum_s",
    "calibrate_incast",
    "is_ultraep_cluster",
    "ultraep_check",
    "write_config",
]

PAPER_INCAST = {
    "low_s": 1.801,
    "high_s": 3.009,
    "low": "ring",
    "high": "extreme",
    "layers": 45,
    "cluster": "H800 4x8",
    "path": "native",
}
"""The paper's incast experiment: sums of per-layer P50 dispatch + combine, NATIVE."""

PAPER_ULTRAEP = {
    "mib_per_gpu": (28, 42),
    "perm_over_native": (9.694, 8.670),
    "hidden": 7168,
    "cluster": "H800 4x8",
    "nodes": 4,
    "gpus_per_node": 8,
    "sources": 3,
    "source_rails": "balanced",
}
"""The paper's UltraEP case (appendix A.2, Table 2, source-node skew with locally balanced rails):
PERM's speedup over NATIVE per all-to-all at about 28 and 42 MiB per GPU, BF16, hidden 7168."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IncastCalibration:
    """Result of `calibrate_incast`."""

    model: NetModelConfig
    """The base model with the fitted alpha."""
    target_ratio: float
    """3.009 / 1.801 (paper)."""
    ratio_at_zero: float
    """EXTREME / RING of the pure max-min model (alpha = 0): what concentration costs without
    any penalty (receiver ports shared by several senders in one window)."""
    fitted_ratio: float
    low_s: float
    """Sum over layers of the RING times at the fitted alpha (seconds, after payload scaling)."""
    high_s: float
    payload_scale: float
    tokens: int
    implied_tokens: float
    """tokens * payload_scale."""
    layers: tuple[int, ...]
    curve: tuple[tuple[float, float], ...]
    """(alpha, EXTREME / RING ratio) at a few alphas, for the docs."""
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "target_ratio": self.target_ratio,
            "ratio_at_zero": self.ratio_at_zero,
            "fitted_ratio": self.fitted_ratio,
            "low_s": self.low_s,
            "high_s": self.high_s,
            "payload_scale": self.payload_scale,
            "tokens": self.tokens,
            "implied_tokens": self.implied_tokens,
            "layers": list(self.layers),
            "curve": [list(c) for c in self.curve],
            "seconds": self.seconds,
        }


def arranged_layers(
    topo: RailTopology,
    pattern: str,
    *,
    tokens: int,
    seed: int = 0,
    step: int = 0,
    layers: Sequence[int] | None = None,
) -> dict[int, tuple[DemandCounts, WaveSchedule]]:
    """The synthetic GLM-4.5-Air layers arranged into ``pattern``'s windows."""
    from megatron_railwave.lab.workloads import GlmAirWorkload, arrange, glm_air_demands

    work = GlmAirWorkload(
        num_tokens=tokens, seed=seed, step=step, layers=tuple(layers) if layers else None
    )
    return {
        layer: arrange(demand, pattern, topo)
        for layer, demand in glm_air_demands(topo, work).items()
    }


def pattern_sum_s(
    arranged: dict[int, tuple[DemandCounts, WaveSchedule]],
    topo: RailTopology,
    model: NetModelConfig,
    *,
    record_bytes: int,
    path: Route | str = Route.NATIVE,
    scale: float = 1.0,
) -> float:
    """Sum over layers of the modelled dispatch + combine seconds of ``path``."""
    total = 0.0
    for demand, windows in arranged.values():
        demand = scaled_demand(demand, scale)
        plan = build_plan(demand, topo, path, options=PlanOptions(windows=windows))
        total += execute_plan(plan, record_bytes=record_bytes, model=model, demand=demand).total_s
    return total


def calibrate_incast(
    topo: RailTopology,
    *,
    base: NetModelConfig | None = None,
    tokens: int = 2048,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    record_bytes: int = 4096 * 2,
    bounds: tuple[float, float] = (0.0, 8.0),
    tol: float = 1e-3,
    log: Callable[[str], None] | None = print,
) -> IncastCalibration:
    """Fit ``alpha`` to the paper's incast experiment (see the module docstring).

    Args:
        topo: the H800 4 x 8 cluster (the experiment's).
        base: every other parameter; default `NetModelConfig()`.
        tokens: tokens per GPU of the synthetic routing before payload scaling.
        record_bytes: GLM-4.5-Air hidden 4096 in bf16.
        bounds, tol: alpha search interval and precision.
    """
    t0 = time.perf_counter()
    base = base or NetModelConfig()
    say = log or (lambda _msg: None)
    low = arranged_layers(topo, PAPER_INCAST["low"], tokens=tokens, seed=seed, layers=layers)
    high = arranged_layers(topo, PAPER_INCAST["high"], tokens=tokens, seed=seed, layers=layers)
    zero = replace(base, alpha=0.0)
    # Fixed cost of a RING layer: 3 windows x (dispatch + combine) rail phases, one count exchange.
    fixed = sum(
        2 * w.num_waves * base.wave_cost_s(topo.world_size) + base.count_exchange_s
        for _, w in low.values()
    )
    ring_s = pattern_sum_s(low, topo, zero, record_bytes=record_bytes)
    scale = (PAPER_INCAST["low_s"] - fixed) / (ring_s - fixed)
    # Not exactly linear (the fixed costs sit on some critical paths only): one secant step.
    ring_scaled = pattern_sum_s(low, topo, zero, record_bytes=record_bytes, scale=scale)
    scale *= (PAPER_INCAST["low_s"] - fixed) / (ring_scaled - fixed)
    say(
        f"RING sum at {tokens} tokens/GPU: {ring_s:.4f} s; payload scale {scale:.3f} "
        f"(~{tokens * scale:.0f} tokens/GPU) for {PAPER_INCAST['low_s']} s"
    )

    def ratio(alpha: float) -> float:
        model = replace(base, alpha=alpha)
        lo = pattern_sum_s(low, topo, model, record_bytes=record_bytes, scale=scale)
        hi = pattern_sum_s(high, topo, model, record_bytes=record_bytes, scale=scale)
        return hi / lo

    target = PAPER_INCAST["high_s"] / PAPER_INCAST["low_s"]
    at_zero = ratio(0.0)
    say(f"EXTREME / RING at alpha = 0: {at_zero:.4f} (paper {target:.4f})")

    # The ratio grows with alpha: bracketed secant (Illinois) on ratio(alpha) - target, a few
    # model runs instead of a golden-section search's dozen.
    seen = {0.0: at_zero}
    lo, hi = bounds
    f_lo = (seen[lo] if lo in seen else ratio(lo)) - target
    if f_lo >= 0:
        alpha = lo
    else:
        f_hi = ratio(hi) - target
        seen[hi] = f_hi + target
        if f_hi <= 0:
            alpha = hi
        else:
            side = 0
            alpha = lo
            while hi - lo > tol:
                alpha = hi - f_hi * (hi - lo) / (f_hi - f_lo)
                f = ratio(alpha) - target
                seen[alpha] = f + target
                say(f"  alpha {alpha:.4f}: ratio {f + target:.4f}")
                if abs(f) < 1e-4:
                    break
                if f > 0:
                    hi, f_hi = alpha, f
                    if side == 1:
                        f_lo /= 2
                    side = 1
                else:
                    lo, f_lo = alpha, f
                    if side == -1:
                        f_hi /= 2
                    side = -1
    model = replace(base, alpha=round(alpha, 4))
    lo_s = pattern_sum_s(low, topo, model, record_bytes=record_bytes, scale=scale)
    hi_s = pattern_sum_s(high, topo, model, record_bytes=record_bytes, scale=scale)
    curve = tuple(sorted(seen.items()))
    return IncastCalibration(
        model=model,
        target_ratio=target,
        ratio_at_zero=at_zero,
        fitted_ratio=hi_s / lo_s,
        low_s=lo_s,
        high_s=hi_s,
        payload_scale=scale,
        tokens=tokens,
        implied_tokens=tokens * scale,
        layers=tuple(low),
        curve=curve,
        seconds=time.perf_counter() - t0,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ConcentrationCheck:
    """One payload of `ultraep_check`: NATIVE (all sources at once) against PERM (one source
    node per wave) on three source nodes sending to one destination node."""

    mib_per_gpu: float
    records_per_gpu: int
    """Tokens a source GPU of weight 1 sends (``mib_per_gpu`` MiB of ``record_bytes`` rows)."""
    native_dispatch_s: float
    native_total_s: float
    """Dispatch + combine (combine sends back from one node: one sender per receiver port)."""
    perm_dispatch_s: float
    perm_total_s: float
    paper_speedup: float | None
    """The paper's PERM / NATIVE speedup at this payload (None where the replay is not the paper's
    case: another payload, unequal sources, or not 4 nodes x 8 GPUs)."""

    @property
    def dispatch_speedup(self) -> float:
        return self.native_dispatch_s / self.perm_dispatch_s

    @property
    def total_speedup(self) -> float:
        return self.native_total_s / self.perm_total_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "mib_per_gpu": self.mib_per_gpu,
            "records_per_gpu": self.records_per_gpu,
            "native_dispatch_s": self.native_dispatch_s,
            "native_total_s": self.native_total_s,
            "perm_dispatch_s": self.perm_dispatch_s,
            "perm_total_s": self.perm_total_s,
            "dispatch_speedup": self.dispatch_speedup,
            "total_speedup": self.total_speedup,
            "paper_speedup": self.paper_speedup,
        }


def is_ultraep_cluster(topo: RailTopology) -> bool:
    """Whether ``topo`` has the shape of the paper's UltraEP runs (4 nodes x 8 GPUs)."""
    return (topo.num_nodes, topo.gpus_per_node) == (
        PAPER_ULTRAEP["nodes"],
        PAPER_ULTRAEP["gpus_per_node"],
    )


def ultraep_check(
    topo: RailTopology,
    model: NetModelConfig,
    *,
    record_bytes: int = PAPER_ULTRAEP["hidden"] * 2,
    mib_per_gpu: Sequence[float] = PAPER_ULTRAEP["mib_per_gpu"],
    source_weights: Sequence[float] | None = None,
) -> list[ConcentrationCheck]:
    """Replay the paper's UltraEP case on ``model``: every node but node 0 sends to node 0
    (`workloads.one_destination_topk_ids`), NATIVE with all sources at once against PERM's
    one-to-one waves, at each payload of ``mib_per_gpu`` (MiB each source GPU sends).

    Args:
        topo: the cluster (the paper's: H800 4 x 8, three source nodes).
        model: the flow model, e.g. a fitted ``megatron_railwave/configs/netmodel/*.yaml``.
        record_bytes: one token's row (hidden 7168 in BF16, the paper's).
        source_weights: per source node (source-node skew; the paper does not publish its
            size); default equal sources, where the destination's ports see every sender for
            the whole dispatch.
    """
    same_case = is_ultraep_cluster(topo) and (
        source_weights is None or len(set(source_weights)) == 1
    )
    paper = (
        dict(zip(PAPER_ULTRAEP["mib_per_gpu"], PAPER_ULTRAEP["perm_over_native"]))
        if same_case
        else {}
    )
    rows = []
    for mib in mib_per_gpu:
        records = int(round(mib * 2**20 / record_bytes))
        ids = one_destination_topk_ids(
            topo,
            records_per_gpu=records,
            source_weights=None if source_weights is None else tuple(source_weights),
        )
        demand = demand_from_topk_ids(ids, topo, topo.world_size)
        native, perm = (
            execute_plan(
                build_plan(demand, topo, path),
                record_bytes=record_bytes,
                model=model,
                demand=demand,
            )
            for path in (Route.NATIVE, Route.PERM)
        )
        rows.append(
            ConcentrationCheck(
                mib_per_gpu=float(mib),
                records_per_gpu=records,
                native_dispatch_s=native.dispatch_s,
                native_total_s=native.total_s,
                perm_dispatch_s=perm.dispatch_s,
                perm_total_s=perm.total_s,
                paper_speedup=paper.get(mib),
            )
        )
    return rows


def write_config(
    path: str,
    calib: IncastCalibration,
    *,
    cluster: str,
    cross_check: Sequence[ConcentrationCheck] = (),
) -> None:
    """``megatron_railwave/configs/netmodel/<cluster>.yaml``: the model and how it was fitted."""
    data = {
        "model": calib.model.to_dict(),
        "calibration": {
            "experiment": dict(PAPER_INCAST),
            "cluster_file": cluster,
            "workload": f"synthetic GLM-4.5-Air (workloads.glm_air_demands), seed 0, "
            f"{calib.tokens} tokens/GPU "
            f"x payload scale {calib.payload_scale:.3f}",
            **{k: v for k, v in calib.to_dict().items() if k not in ("model", "layers")},
        },
    }
    if cross_check:
        data["calibration"]["ultraep_check"] = [row.to_dict() for row in cross_check]
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# Network model parameters (NetModelConfig, "
            "megatron_railwave/lab/netmodel/execute.py).\n"
            "# Written by: railwave netmodel fit-incast; see docs/netmodel.md.\n"
        )
        yaml.safe_dump(data, f, sort_keys=False)
