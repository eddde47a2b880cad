"""Flow model (``netmodel.simulate_plan``, public API only) configured for a testbed, against the
testbed's P50s.

Letters: N nodes, G GPUs per node (= rails), V windows / waves.

What the model is given, all from the testbed and its own probes (nothing fitted to the exchange
timings unless ``fit_on``), on the routing the study recorded:
  * rail rate: ``rail_mbit`` x TCP wire efficiency at the testbed's MTU;
  * incast: ``alpha`` from the k-to-1 goodput probe of the same run (``alpha_from_slowdowns``);
  * NVLink stand-in: loopback at ``loopback_gBps`` (stated; gloo over ``lo`` on this host);
  * bytes per row: the exchange's wire format (``testbed.experiment.wire_format``), as the
    compiled schedule the model simulates uses it (dispatch rows: payload + probs + metadata).
  * phase dependencies per rank (``phase_sync='rank'``), as the exchange runs: each rank posts
    its next phase once its own sends and receives of the phases it depends on are done.
The comparison is against the measured P50 of the slowest rank's dispatch + combine (planning
and the count all-gather are not part of the model) and, for reference, against the total.
Optionally, one free parameter is fitted on one workload/path and used for all others: the fixed
cost of a rail phase (``wave_latency_s``) or the rails' effective goodput (a rate scale).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_railwave.lab.testbed.experiment import (
    StudyConfig,
    build_workloads,
    wire_efficiency,
    wire_format,
)
from megatron_railwave.lab.workloads import GLM45_AIR, demand_from_topk_ids
from megatron_railwave.names import parse_candidate
from megatron_railwave.planner import PlanOptions, build_plan, schedule_from_windows
from megatron_railwave.topology import RailTopology

__all__ = ["compare_with_netmodel"]


def _study_workloads(
    study: dict[str, Any], topo: RailTopology, cfg: StudyConfig
) -> dict[str, dict[str, Any]]:
    """The measured workloads: the routing and windows the study recorded (``topk_ids_WTK``), or,
    for results that lack them, the same config rebuilt by the current generator."""
    recorded = study["workloads"]
    if all("topk_ids_WTK" in wl for wl in recorded.values()):
        return {
            name: {
                "demand": demand_from_topk_ids(
                    np.asarray(wl["topk_ids_WTK"], dtype=np.int64), topo, GLM45_AIR.num_experts
                ),
                "windows": wl["windows"],
            }
            for name, wl in recorded.items()
        }
    return {w["name"]: w for w in build_workloads(topo, cfg)}


def _alpha(incast: list[dict[str, Any]] | None) -> float | None:
    from megatron_railwave.lab.netmodel import alpha_from_slowdowns

    if not incast:
        return None
    base = next((r["median_s"] for r in incast if r["fan_in"] == 1), None)
    rows = [r for r in incast if r["fan_in"] > 1]
    if base is None or not rows:
        return None
    # Max-min time of k senders = k x the one-sender time.
    return alpha_from_slowdowns(
        [r["fan_in"] for r in rows], [r["median_s"] / (r["fan_in"] * base) for r in rows]
    )


def compare_with_netmodel(
    study: dict[str, Any],
    *,
    incast: list[dict[str, Any]] | None = None,
    loopback_gBps: float = 1.0,
    wave_latency_s: float = 2e-3,
    fit_on: tuple[str, str] | None = ("ring-balanced", "native"),
    fit_param: str = "wave_latency",
    phase_sync: str = "rank",
) -> dict[str, Any]:
    """Model every (workload, path) of a ``run_study`` result; relative errors against the
    measurement.

    Args:
        study: the ``run_study`` result (its config and testbed rebuild the same workloads).
        incast: the run's ``incast_sweep`` rows (for alpha); None = no incast penalty.
        loopback_gBps: NVLink stand-in bandwidth (GB/s).
        wave_latency_s: fixed cost of one rail phase when not fitted.
        fit_on: (workload, path) whose measured P50 fixes one parameter by bisection; None = stated.
        fit_param: the parameter fitted: "wave_latency" (fixed cost per rail phase) or "rail_rate"
            (the rails' effective goodput for the exchange, as a fraction of the shaped rate).
        phase_sync: `NetModelConfig.phase_sync`: 'rank' (what the exchange does) or 'global' (a
            phase starts when the phases before it are complete on every rank).

    Raises:
        ImportError: the flow model (``netmodel.execute``) is not available in this checkout.
    """
    from megatron_railwave.lab.netmodel import NetModelConfig, simulate_plan

    tb = study["testbed"]
    cfg_data = dict(study["config"])
    for key in ("patterns", "rails", "paths"):
        cfg_data[key] = tuple(cfg_data[key])
    cfg = StudyConfig(**cfg_data)
    eff = wire_efficiency(tb["mtu"])
    if fit_param not in ("wave_latency", "rail_rate"):
        raise ValueError(f"fit_param must be 'wave_latency' or 'rail_rate', got {fit_param!r}")

    def testbed_topo(rate_scale: float) -> RailTopology:
        return RailTopology(
            num_nodes=tb["nodes"],
            gpus_per_node=tb["gpus_per_node"],
            rail_gbps=tb["rail_mbit"] / 1000 * eff * rate_scale,
            nvlink_gBps=loopback_gBps,
            name="testbed",
        )

    topo = testbed_topo(1.0)
    wire = wire_format(topo, cfg)
    alpha = _alpha(incast)
    workloads = _study_workloads(study, topo, cfg)
    keys = [(name, path) for name in workloads for path in cfg.paths]

    def model(latency: float) -> NetModelConfig:
        # The probe's alpha is a linear fit over its own k (no saturation); the count all-gather is
        # outside the measured dispatch + combine, RailBalance's steps are host-side here.
        return NetModelConfig(
            alpha=alpha or 0.0,
            k_sat=None,
            wave_latency_s=latency,
            count_exchange_s=0.0,
            railbalance_barrier_s=0.0,
            railbalance_quota_s=0.0,
            nodes_per_leaf=max(topo.num_nodes, 1),
            phase_sync=phase_sync,
        )

    def predict(key: tuple[str, str], value: float) -> float:
        """Model seconds with the fitted parameter at ``value``."""
        latency, scale = (value, 1.0) if fit_param == "wave_latency" else (wave_latency_s, value)
        wl = workloads[key[0]]
        path, streamed = parse_candidate(key[1])
        plan = build_plan(
            wl["demand"],
            testbed_topo(scale),
            path,
            options=PlanOptions(
                windows=schedule_from_windows(topo.num_nodes, wl["windows"]), streamed=streamed
            ),
        )
        return simulate_plan(plan, wire=wire, model=model(latency), demand=wl["demand"])

    def measured_comm(name: str, path: str) -> float:
        data = study["workloads"][name]["paths"][path]
        if "comm_slowest_s" in data:
            return data["comm_slowest_s"]["p50"]
        comp = data["components_slowest_s"]  # older results: sum of the per-component P50s
        return comp["dispatch_s"]["p50"] + comp["combine_s"]["p50"]

    stated = wave_latency_s if fit_param == "wave_latency" else 1.0
    fitted = None
    if fit_on is not None and fit_on in keys:
        target = measured_comm(*fit_on)
        # predict() grows with the latency and falls with the rate scale.
        lo, hi = (0.0, max(target, 1e-3)) if fit_param == "wave_latency" else (0.05, 1.0)
        sign = 1.0 if fit_param == "wave_latency" else -1.0
        if sign * (predict(fit_on, lo) - target) < 0 < sign * (predict(fit_on, hi) - target):
            for _ in range(30):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if sign * (predict(fit_on, mid) - target) < 0 else (lo, mid)
            fitted = 0.5 * (lo + hi)
    value = fitted if fitted is not None else stated
    rows = []
    for name, path in keys:
        pred = predict((name, path), value)
        pred_stated = predict((name, path), stated)
        comm = measured_comm(name, path)
        total = study["workloads"][name]["paths"][path]["slowest_s"]["p50"]
        rows.append(
            {
                "workload": name,
                "path": path,
                "model_s": pred,
                "model_unfitted_s": pred_stated,
                "measured_comm_p50_s": comm,
                "measured_total_p50_s": total,
                "rel_error_comm": pred / comm - 1.0,
                "rel_error_total": pred / total - 1.0,
                "rel_error_comm_unfitted": pred_stated / comm - 1.0,
            }
        )
    errs = np.abs([r["rel_error_comm"] for r in rows])
    return {
        "model": {
            "alpha": alpha,
            "rail_gbps_shaped_x_tcp_efficiency": topo.rail_gbps,
            "loopback_gBps": loopback_gBps,
            "wire": wire.to_dict(),
            "fit_param": fit_param,
            "fitted_value": fitted,
            "fitted_on": list(fit_on) if fitted is not None else None,
            "stated_wave_latency_s": wave_latency_s,
            "phase_sync": phase_sync,
        },
        "rows": rows,
        "within_25pct_comm": int((errs <= 0.25).sum()),
        "cases": len(rows),
        "max_abs_rel_error_comm": float(errs.max()) if len(errs) else None,
    }
