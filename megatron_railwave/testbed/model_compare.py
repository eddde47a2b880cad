"""Flow model (``netmodel.simulate_plan``) configured for a testbed, against the testbed's P50s.

Letters: N nodes, G GPUs per node (= rails), V windows / waves.

What the model is given, all from the testbed and its own probes (nothing fitted to the exchange
timings unless ``fit_wave_latency``):
  * rail rate: ``rail_mbit`` x TCP wire efficiency at the testbed's MTU;
  * incast: ``alpha`` from the k-to-1 goodput probe of the same run (``alpha_from_slowdowns``);
  * NVLink stand-in: loopback at ``loopback_gBps`` (stated; gloo over ``lo`` on this host);
  * per-record extra bytes: the exchange's probs + metadata, averaged over dispatch and combine.
The comparison is against the measured P50 of the slowest rank's dispatch + combine (planning
and the count all-gather are not part of the model) and, for reference, against the total.
Optionally, one free parameter (the fixed cost of a rail phase, ``wave_latency_s``) is fitted on
one workload/path and used for all others.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_railwave.planner import PlanOptions, build_plan, schedule_from_windows
from megatron_railwave.testbed.experiment import StudyConfig, build_workloads, record_bytes, wire_efficiency
from megatron_railwave.topology import RailTopology

__all__ = ["compare_with_netmodel"]


def _alpha(incast: list[dict[str, Any]] | None) -> float | None:
    from megatron_railwave.netmodel import alpha_from_slowdowns

    if not incast:
        return None
    base = next((r["median_s"] for r in incast if r["fan_in"] == 1), None)
    rows = [r for r in incast if r["fan_in"] > 1]
    if base is None or not rows:
        return None
    # Max-min time of k senders = k x the one-sender time.
    return alpha_from_slowdowns([r["fan_in"] for r in rows], [r["median_s"] / (r["fan_in"] * base) for r in rows])


def compare_with_netmodel(study: dict[str, Any], *, incast: list[dict[str, Any]] | None = None,
                          loopback_gBps: float = 1.0, wave_latency_s: float = 2e-3,
                          fit_on: tuple[str, str] | None = ("ring-balanced", "native")) -> dict[str, Any]:
    """Model every (workload, path) of a ``run_study`` result; relative errors against the measurement.

    Args:
        study: the ``run_study`` result (its config and testbed rebuild the same workloads).
        incast: the run's ``incast_sweep`` rows (for alpha); None = no incast penalty.
        loopback_gBps: NVLink stand-in bandwidth (GB/s).
        wave_latency_s: fixed cost of one rail phase when not fitted.
        fit_on: (workload, path) whose measured P50 fixes ``wave_latency_s`` by bisection; None = stated.

    Raises:
        ImportError: the flow model (``netmodel.execute``) is not available in this checkout.
    """
    from megatron_railwave.netmodel.execute import NetModelConfig, simulate_plan

    tb = study["testbed"]
    cfg_data = dict(study["config"])
    for key in ("patterns", "rails", "paths"):
        cfg_data[key] = tuple(cfg_data[key])
    cfg = StudyConfig(**cfg_data)
    eff = wire_efficiency(tb["mtu"])
    topo = RailTopology(num_nodes=tb["nodes"], gpus_per_node=tb["gpus_per_node"],
                        rail_gbps=tb["rail_mbit"] / 1000 * eff, nvlink_gBps=loopback_gBps, name="testbed")
    rb = record_bytes(topo, cfg)
    extra = (rb["dispatch"] + rb["combine"]) // 2 - rb["payload"]
    alpha = _alpha(incast)
    workloads = {w["name"]: w for w in build_workloads(topo, cfg)}
    plans = {}
    for name, wl in workloads.items():
        windows = schedule_from_windows(topo.num_nodes, wl["windows"])
        for path in cfg.paths:
            plans[(name, path)] = build_plan(wl["demand"], topo, path, options=PlanOptions(windows=windows))

    def model(latency: float) -> NetModelConfig:
        return NetModelConfig(alpha=alpha or 0.0, wave_latency_s=latency, metadata_bytes=int(extra),
                              nodes_per_leaf=max(topo.num_nodes, 1))

    def predict(key: tuple[str, str], latency: float) -> float:
        return simulate_plan(plans[key], record_bytes=rb["payload"], model=model(latency),
                             demand=workloads[key[0]]["demand"])

    def measured_comm(name: str, path: str) -> float:
        data = study["workloads"][name]["paths"][path]
        if "comm_slowest_s" in data:
            return data["comm_slowest_s"]["p50"]
        comp = data["components_slowest_s"]  # older results: sum of the per-component P50s
        return comp["dispatch_s"]["p50"] + comp["combine_s"]["p50"]

    fitted = None
    if fit_on is not None and fit_on in plans:
        target = measured_comm(*fit_on)
        lo, hi = 0.0, max(target, 1e-3)
        if predict(fit_on, lo) < target:
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if predict(fit_on, mid) < target else (lo, mid)
            fitted = 0.5 * (lo + hi)
    latency = fitted if fitted is not None else wave_latency_s
    rows = []
    for (name, path) in plans:
        pred = predict((name, path), latency)
        pred_stated = predict((name, path), wave_latency_s)
        comm = measured_comm(name, path)
        total = study["workloads"][name]["paths"][path]["slowest_s"]["p50"]
        rows.append({"workload": name, "path": path, "model_s": pred, "model_stated_latency_s": pred_stated,
                     "measured_comm_p50_s": comm, "measured_total_p50_s": total,
                     "rel_error_comm": pred / comm - 1.0, "rel_error_total": pred / total - 1.0,
                     "rel_error_comm_stated_latency": pred_stated / comm - 1.0})
    errs = np.abs([r["rel_error_comm"] for r in rows])
    return {
        "model": {"alpha": alpha, "rail_gbps_effective": topo.rail_gbps, "loopback_gBps": loopback_gBps,
                  "metadata_bytes": int(extra), "wave_latency_s": latency,
                  "wave_latency_fitted_on": list(fit_on) if fitted is not None else None,
                  "stated_wave_latency_s": wave_latency_s},
        "rows": rows,
        "within_25pct_comm": int((errs <= 0.25).sum()), "cases": len(rows),
        "max_abs_rel_error_comm": float(errs.max()) if len(errs) else None,
    }
