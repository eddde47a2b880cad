"""Testbed experiments: the real exchange on replay workloads, timed per path, NIC bytes, faults.

Letters: N nodes, G GPUs per node (= rails R), W = N * G ranks, T tokens per rank, E experts,
K top-k, H hidden size, V windows / waves.

Workloads (``build_workloads``): GLM-4.5-Air routing (``replay.glm``), one layer with balanced
source rails (the layer of lowest skew level) and one with skewed rails (highest skew level),
each under the sending arrangements RING, MODERATE and EXTREME (``replay.arrange_topk_ids``, mode
"even" by default: each source keeps its remote volume and destination-local-GPU histogram, split
over the N - 1 windows so that receivers concentrate as the pattern says). NATIVE / RAIL keep the
windows (``PlanOptions(windows=...)``); PERM / JOINT run the same demand in one-to-one waves.

Timing (``run_study``): every rank times gather_demand + plan + dispatch + combine (the expert
stand-in between them is excluded), between two control barriers; a sample's time is the slowest
rank's. Warm-ups first, then round-robin over the paths per sample. NIC bytes are the kernel's
counters of every rail NIC, read by its own rank before and after each exchange block.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_railwave.lab.bench.wire_bytes import railwave_record_bytes
from megatron_railwave.lab.testbed.launch import run_workers
from megatron_railwave.lab.testbed.netns import TestbedSpec, nic_counters, restore_rail
from megatron_railwave.lab.workloads import (
    GLM45_AIR,
    GlmAirWorkload,
    Pattern,
    arrange_topk_ids,
    demand_from_topk_ids,
    glm_air_layer_ids,
    window_peaks,
)
from megatron_railwave.names import ROUTES, STREAMED_SUFFIX, parse_candidate
from megatron_railwave.planner import PlanOptions, build_plan, schedule_from_windows
from megatron_railwave.schedule import (
    ExecutionSchedule,
    PhaseKind,
    RecordWireFormat,
    compile_schedule,
)
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology

__all__ = [
    "FaultConfig",
    "PATTERNS",
    "RAILS",
    "StudyConfig",
    "build_workloads",
    "cpu_snapshot",
    "goals",
    "incast_sweep",
    "line_rate_Bps",
    "run_fault",
    "run_online",
    "run_study",
    "port_bound",
    "summarize_study",
]

PATTERNS = tuple(p.value for p in Pattern)
RAILS = ("balanced", "skewed")
PATHS = tuple(map(str, ROUTES))
VARIANTS = PATHS + tuple(p + STREAMED_SUFFIX for p in PATHS)
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyConfig:
    """What ``run_study`` measures (defaults: the documented 4 x 2 study)."""

    patterns: tuple[str, ...] = PATTERNS
    """Sending arrangements (ring, moderate, extreme)."""
    rails: tuple[str, ...] = RAILS
    """Source-rail balance of the replayed layer (balanced, skewed)."""
    paths: tuple[str, ...] = PATHS
    tokens: int = 128
    """T, tokens per rank."""
    hidden: int = 4096
    """H (GLM-4.5-Air: 4096)."""
    dtype: str = "bf16"
    """Payload dtype: bf16, fp16 or fp32."""
    warmup: int = 3
    samples: int = 10
    seed: int = 0
    """Seed of the GLM-4.5-Air routing generator (and of the hidden states)."""
    balanced_layer: int | None = None
    """MoE layer replayed as 'balanced'; None: the layer of lowest skew level."""
    skewed_layer: int | None = None
    """MoE layer replayed as 'skewed'; None: the layer of highest skew level."""
    arrange_mode: str = "even"
    """``replay.arrange_topk_ids`` mode: 'even' (split each source over the windows) or
    'relabel'."""
    recv_first: bool = True
    """Post each batch's receives before its sends (``workers.receives_first``: gloo TCP stand-in
    for a full-duplex RDMA rail)."""
    timeout_s: float = 3600.0
    """Hard limit of the whole worker run."""

    def __post_init__(self) -> None:
        for name, allowed in (("patterns", PATTERNS), ("rails", RAILS), ("paths", VARIANTS)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad or not getattr(self, name):
                raise ValueError(
                    f"{name} must be a non-empty subset of {allowed}, got {getattr(self, name)}"
                )
        if self.dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {self.dtype!r}")
        for name in ("tokens", "hidden", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def record_bytes(topo: RailTopology, cfg: StudyConfig) -> dict[str, int]:
    """Bytes of one record on a rail (``bench.wire_bytes``): dispatch (hidden row + the node's probs
    + metadata) and combine (hidden row)."""
    return railwave_record_bytes(wire_format(topo, cfg))


def wire_format(topo: RailTopology, cfg: StudyConfig) -> RecordWireFormat:
    """The exchange's row layout for this study (probs travel in float32)."""
    return RecordWireFormat(
        hidden=cfg.hidden,
        payload_dtype=_TORCH_DTYPES[cfg.dtype],
        probs_dtype=torch.float32,
        experts_per_node=GLM45_AIR.num_experts // topo.num_nodes,
    )


def build_workloads(topo: RailTopology, cfg: StudyConfig) -> list[dict[str, Any]]:
    """One workload per (rails, pattern): routing ids [W, T, K], windows and descriptors."""
    # Rails differ mostly through the ranks' token counts (``GlmAirWorkload.token_skew``): the
    # balanced workload gives every rank T tokens, the skewed one keeps the generator's defaults.
    work_of = {
        "balanced": GlmAirWorkload(num_tokens=cfg.tokens, seed=cfg.seed, token_skew=0.0),
        "skewed": GlmAirWorkload(num_tokens=cfg.tokens, seed=cfg.seed),
    }
    skew = work_of["skewed"].skew_of_layer()
    layer_of = {
        "balanced": cfg.balanced_layer
        if cfg.balanced_layer is not None
        else min(skew, key=skew.get),
        "skewed": cfg.skewed_layer if cfg.skewed_layer is not None else max(skew, key=skew.get),
    }
    for rails, layer in layer_of.items():
        if layer not in skew:
            raise ValueError(
                f"{rails}_layer={layer} is not a MoE layer of GLM-4.5-Air "
                f"({min(skew)}..{max(skew)})"
            )
    num_experts = GLM45_AIR.num_experts
    rec_bytes = record_bytes(topo, cfg)["dispatch"]
    out = []
    for rails in cfg.rails:
        base = glm_air_layer_ids(topo, layer_of[rails], work_of[rails])
        for pattern in cfg.patterns:
            ids, schedule = arrange_topk_ids(
                base, pattern, topo, num_experts=num_experts, mode=cfg.arrange_mode
            )
            demand = demand_from_topk_ids(ids, topo, num_experts)
            stats = demand_stats(demand, topo, record_bytes=rec_bytes)
            out.append(
                {
                    "name": f"{pattern}-{rails}",
                    "pattern": pattern,
                    "rails": rails,
                    "layer": layer_of[rails],
                    "skew_level": skew[layer_of[rails]],
                    "windows": schedule.to_list(),
                    "peak_fanin": window_peaks(schedule),
                    "ids_WTK": ids,
                    "demand": demand,
                    "native_stats": stats.to_dict(),
                }
            )
    return out


def wire_efficiency(mtu: int) -> float:
    """TCP payload per byte the shaper counts: (MTU - IP/TCP headers with timestamps) / (MTU +
    Ethernet)."""
    return (mtu - 52) / (mtu + 14)


def line_rate_Bps(spec: TestbedSpec) -> float:
    """TCP payload bytes per second one shaped NIC direction carries at line rate."""
    return spec.rail_mbit * 1e6 / 8 * wire_efficiency(spec.mtu)


def port_bound(schedule: ExecutionSchedule, rate_Bps: float) -> dict[str, Any]:
    """The strict port bound of a schedule (``docs/testbed.md``): the busiest NIC direction's
    bytes over the whole layer (dispatch + combine rail phases, max over ranks of what it sends or
    receives, ``ExecutionSchedule.transfers`` x the phase's row bytes) / ``rate_Bps``. No incast
    loss, no software cost, node phases (loopback, the NVLink stand-in) free: no schedule of these
    bytes can finish sooner. (The former "window bound", the rail phases back to back at line rate,
    is gone: it is not a lower bound, a rank's next window overlaps the previous one's stragglers,
    and NATIVE was measured below it.)

    Returns:
        {"port_bound_s", "nic_bytes_NR": [[egress + ingress]]}.
    """
    topo = schedule.plan.topology
    w = topo.num_nodes * topo.gpus_per_node
    egress_W, ingress_W = np.zeros(w), np.zeros(w)
    for phase in schedule.phases:
        if phase.kind != PhaseKind.RAIL:
            continue
        src, dst, rows = (t.numpy() for t in schedule.transfers(phase))
        off = src != dst
        nbytes = rows[off].astype(np.float64) * schedule.row_bytes(phase)
        egress_W += np.bincount(src[off], nbytes, w)
        ingress_W += np.bincount(dst[off], nbytes, w)
    return {
        "port_bound_s": float(max(egress_W.max(initial=0), ingress_W.max(initial=0))) / rate_Bps,
        "nic_bytes_NR": (egress_W + ingress_W).reshape(topo.num_nodes, topo.gpus_per_node).tolist(),
    }


def _plan_info(
    wl: dict[str, Any],
    topo: RailTopology,
    paths: tuple[str, ...],
    wire: RecordWireFormat,
    spec: TestbedSpec,
) -> dict[str, Any]:
    """Per path: the global plan (JSON), its compiled schedule's port bound (``port_bound``)
    and the bytes it puts on each NIC (egress + ingress, dispatch + combine)."""
    windows = schedule_from_windows(topo.num_nodes, wl["windows"])
    info = {}
    for path in paths:
        route, streamed = parse_candidate(path)
        plan = build_plan(
            wl["demand"],
            topo,
            route,
            options=PlanOptions(windows=windows, streamed=streamed),
        )
        bound = port_bound(compile_schedule(plan, wire), line_rate_Bps(spec))
        info[path] = {
            "plan": plan.to_json(record_bytes=wire.dispatch_bytes),
            "planned_nic_bytes": bound["nic_bytes_NR"],
            "port_bound_s": bound["port_bound_s"],
        }
    return info


def cpu_snapshot() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [float(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _pct(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)} | {
        "mean": float(arr.mean()),
        "min": float(arr.min()),
        "max": float(arr.max()),
        "n": int(arr.size),
    }


def _shares(nic_NR: np.ndarray) -> dict[str, Any]:
    """Per node: each NIC's share of the node's bytes and the largest deviation from the mean."""
    node_tot = nic_NR.sum(axis=1, keepdims=True)
    share = np.where(node_tot > 0, nic_NR / np.maximum(node_tot, 1), 0.0)
    mean = nic_NR.mean(axis=1, keepdims=True)
    dev = np.where(mean > 0, np.abs(nic_NR - mean) / np.maximum(mean, 1), 0.0)
    gmean = nic_NR[nic_NR > 0].mean() if (nic_NR > 0).any() else 1.0
    return {
        "share_NR": share.round(4).tolist(),
        "max_dev_from_node_mean": float(dev.max()),
        "max_over_global_mean": float(nic_NR.max() / gmean),
    }


def summarize_study(
    results: list[dict[str, Any]],
    workloads: list[dict[str, Any]],
    spec: TestbedSpec,
    cfg: StudyConfig,
    cores: int,
) -> dict[str, Any]:
    """Per workload and path: slowest-rank percentiles, components, CPU, NIC bytes and shares."""
    g = spec.gpus_per_node
    by_key: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for res in results:
        for rec in res["records"]:
            by_key.setdefault((rec["workload"], rec["path"], rec["sample"]), []).append(
                {**rec, "rank": res["rank"]}
            )
    topo = RailTopology(num_nodes=spec.nodes, gpus_per_node=g, rail_gbps=spec.rail_mbit / 1000)
    wire = wire_format(topo, cfg)
    out: dict[str, Any] = {}
    for wl in workloads:
        name = wl["name"]
        per_path: dict[str, Any] = {}
        plans = _plan_info(wl, topo, cfg.paths, wire, spec)
        for path in cfg.paths:
            rows = [by_key[(name, path, s)] for s in range(cfg.samples)]
            slowest = [max(r["total_s"] for r in ranks) for ranks in rows]
            comp = {
                k: _pct([max(r[k] for r in ranks) for ranks in rows])
                for k in ("gather_s", "plan_s", "dispatch_s", "combine_s")
            }
            planning = _pct([max(r["gather_s"] + r["plan_s"] for r in ranks) for ranks in rows])
            comm = _pct([max(r["dispatch_s"] + r["combine_s"] for r in ranks) for ranks in rows])
            cpu_util = [
                sum(r["cpu_s"] for r in ranks) / (max(r["total_s"] for r in ranks) * cores)
                for ranks in rows
            ]
            nic = np.zeros((spec.nodes, g))
            for ranks in rows:
                for r in ranks:
                    nic[r["rank"] // g, r["rank"] % g] += r["tx"] + r["rx"]
            nic /= cfg.samples
            per_path[path] = {
                "slowest_s": _pct(slowest),
                "samples_s": slowest,
                "planning_slowest_s": planning,
                "comm_slowest_s": comm,
                "components_slowest_s": comp,
                "worker_cpu_over_wall": _pct(cpu_util),
                "nic_bytes_per_sample_NR": nic.round(0).tolist(),
                "nic_shares": _shares(nic),
                "planned_nic_bytes_NR": plans[path]["planned_nic_bytes"],
                "planned_nic_shares": _shares(
                    np.asarray(plans[path]["planned_nic_bytes"], dtype=float)
                ),
                "port_bound_s": plans[path]["port_bound_s"],
                "measured_p50_over_bound": float(np.percentile(slowest, 50))
                / max(plans[path]["port_bound_s"], 1e-9),
                "plan": plans[path]["plan"],
                "max_rel_error_vs_dense": max(res["errors"][f"{name}/{path}"] for res in results),
            }
        native = per_path.get("native")
        if native is not None:
            for data in per_path.values():
                data["speedup_vs_native"] = {
                    q: native["slowest_s"][q] / data["slowest_s"][q] for q in ("p50", "p95", "p99")
                }
                data["bound_speedup_vs_native"] = native["port_bound_s"] / data["port_bound_s"]
                data["speedup_over_bound_speedup"] = (
                    data["speedup_vs_native"]["p50"] / data["bound_speedup_vs_native"]
                )
                # Without planning (gather + plan), which the port bound does not hold.
                data["comm_speedup_vs_native_p50"] = (
                    native["comm_slowest_s"]["p50"] / data["comm_slowest_s"]["p50"]
                )
        # Bitwise: on every rank, every path and sample gave the same output.
        same = all(
            len({d for p in cfg.paths for d in res["digests"][name][p]}) == 1 for res in results
        )
        out[name] = {
            "pattern": wl["pattern"],
            "rails": wl["rails"],
            "layer": wl["layer"],
            "skew_level": wl["skew_level"],
            "windows": wl["windows"],
            "peak_fanin": wl["peak_fanin"],
            "native_demand_stats": wl["native_stats"],
            "all_paths_bitwise_equal": same,
            # The routing itself, so that tools (model_compare) replay exactly what was measured
            # even after the workload generator changes.
            "topk_ids_WTK": np.asarray(wl["ids_WTK"]).tolist(),
            "paths": per_path,
        }
    return out


NIC_TOLERANCE = 0.05
"""Goal: RAIL and JOINT bring every NIC within this fraction of its node's mean."""
BOUND_FRACTION = 0.85
"""Goal: skewed EXTREME JOINT reaches this fraction of its port-bound speedup over NATIVE."""


def goals(summary: dict[str, Any], model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The issue's goals, evaluated on what was measured (None where not measured).

    ``model``: a ``model_compare.compare_with_netmodel`` result (the flow-model goal).
    """
    res: dict[str, Any] = {}
    ext = summary.get("extreme-skewed", {}).get("paths", {})
    if "joint" in ext and "native" in ext:
        s, b = ext["joint"]["speedup_vs_native"]["p50"], ext["joint"]["bound_speedup_vs_native"]
        res["extreme_skewed_joint_p50_over_bound"] = {
            "speedup": s,
            "bound_speedup": b,
            "ratio": s / b,
            "comm_only_ratio": ext["joint"]["comm_speedup_vs_native_p50"] / b,
            "target": f">= {BOUND_FRACTION} x bound speedup",
            "met": s >= BOUND_FRACTION * b,
        }
        res["extreme_skewed_joint_p50_2x"] = {
            "speedup": s,
            "bound_speedup": b,
            "target": ">= 2.0 where the bound allows >= 2.5",
            "met": (s >= 2.0) if b >= 2.5 else None,
        }
    nic = []
    for name, wl in summary.items():
        paths = wl["paths"]
        if (
            "native" not in paths
            or paths["native"]["nic_shares"]["max_dev_from_node_mean"] <= NIC_TOLERANCE
        ):
            continue
        for path in ("rail", "joint"):
            if path in paths:
                dev = paths[path]["nic_shares"]["max_dev_from_node_mean"]
                nic.append(
                    {
                        "workload": name,
                        "path": path,
                        "native_dev": paths["native"]["nic_shares"]["max_dev_from_node_mean"],
                        "dev": dev,
                        "met": dev <= NIC_TOLERANCE,
                    }
                )
    res["nic_within_5pct_where_native_skewed"] = {
        "cases": nic,
        "met": all(c["met"] for c in nic) if nic else None,
    }
    ring = summary.get("ring-balanced", {}).get("paths", {})
    if "native" in ring:
        worst = {p: 1.0 / d["speedup_vs_native"]["p50"] for p, d in ring.items()}
        res["ring_balanced_p50_over_native"] = {
            "value": worst,
            "target": "<= 1.05",
            "met": all(v <= 1.05 for v in worst.values()),
        }
    if model is not None and "rows" in model:
        need = max(1, -(-20 * model["cases"] // 24))  # 20 of 24, scaled to the cells measured
        res["model_within_25pct"] = {
            "value": model["within_25pct_comm"],
            "cases": model["cases"],
            "target": f">= {need} of {model['cases']}",
            "met": model["within_25pct_comm"] >= need,
        }
    return res


def run_study(spec: TestbedSpec, cfg: StudyConfig) -> dict[str, Any]:
    """Run the exchange study on a testbed that is up; returns the JSON-able result."""
    topo = RailTopology(
        num_nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, rail_gbps=spec.rail_mbit / 1000
    )
    workloads = build_workloads(topo, cfg)
    args = {
        "workloads": [
            {"name": w["name"], "ids_WTK": w["ids_WTK"], "windows": w["windows"]} for w in workloads
        ],
        "paths": list(cfg.paths),
        "warmup": cfg.warmup,
        "samples": cfg.samples,
        "hidden": cfg.hidden,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "num_experts": GLM45_AIR.num_experts,
        "recv_first": cfg.recv_first,
    }
    cores = _cores()
    load0 = os.getloadavg()
    busy0, tot0 = cpu_snapshot()
    nic0 = nic_counters(spec)
    t0 = time.perf_counter()
    results = run_workers(
        spec, "megatron_railwave.lab.testbed.workers:study_worker", args, cfg.timeout_s
    )
    wall = time.perf_counter() - t0
    nic1 = nic_counters(spec)
    busy1, tot1 = cpu_snapshot()
    summary = summarize_study(results, workloads, spec, cfg, cores)
    in_blocks = sum(r["tx"] + r["rx"] for res in results for r in res["records"])
    whole_run = sum(nic1[k][0] - nic0[k][0] + nic1[k][1] - nic0[k][1] for k in nic0)
    return {
        "config": asdict(cfg),
        "testbed": _spec_json(spec),
        "record_bytes": record_bytes(topo, cfg),
        "run_wall_s": wall,
        "machine_cpu_busy_fraction": (busy1 - busy0) / max(tot1 - tot0, 1.0),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "cores": cores,
        "nic_bytes_check": {
            "measured_blocks": in_blocks,
            "whole_run_all_nics": whole_run,
            "note": "whole run = measured blocks + warm-ups + group set-up",
        },
        "workloads": summary,
        "goals": goals(summary),
    }


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _spec_json(spec: TestbedSpec) -> dict[str, Any]:
    return {**asdict(spec), "name": spec.name}


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """The mid-run rail failure experiment (``run_fault``)."""

    fail: tuple[int, int] = (1, 1)
    """(node, rail) whose NIC goes down after the healthy exchanges."""
    pattern: str = "ring"
    rails: str = "skewed"
    paths: tuple[str, ...] = PATHS
    samples: int = 3
    """Rounds over the paths after the fault, with the failed rail in the topology."""
    exchange_timeout_s: float = 5.0
    """TorchDistExchange(timeout_s=...) of the run that does not know about the failure."""
    unaware_path: str = "joint"
    tokens: int = 128
    hidden: int = 4096
    dtype: str = "bf16"
    seed: int = 0
    recv_first: bool = True
    timeout_s: float = 600.0


def run_fault(spec: TestbedSpec, cfg: FaultConfig) -> dict[str, Any]:
    """Fail one rail NIC mid-run; check the failure-aware exchange and the timeout error.

    The rail is restored afterwards (also on errors).
    """
    node, rail = cfg.fail
    topo = RailTopology(num_nodes=spec.nodes, gpus_per_node=spec.gpus_per_node)
    topo.with_failed_rails({(node, rail)})  # validates the rail and that every pair keeps a path
    if "native" not in cfg.paths:
        raise ValueError(f"paths must include 'native' (the reference), got {cfg.paths}")
    study = StudyConfig(
        patterns=(cfg.pattern,),
        rails=(cfg.rails,),
        tokens=cfg.tokens,
        hidden=cfg.hidden,
        dtype=cfg.dtype,
        seed=cfg.seed,
    )
    wl = build_workloads(topo, study)[0]
    state_dir = Path(tempfile.mkdtemp(prefix=f"{spec.name}-fault-"))
    args = {
        "workload": {"ids_WTK": wl["ids_WTK"], "windows": wl["windows"]},
        "paths": list(cfg.paths),
        "fail": [node, rail],
        "samples": cfg.samples,
        "exchange_timeout_s": cfg.exchange_timeout_s,
        "unaware_path": cfg.unaware_path,
        "state_dir": str(state_dir),
        "hidden": cfg.hidden,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "num_experts": GLM45_AIR.num_experts,
        "recv_first": cfg.recv_first,
    }
    launcher_error = None
    t0 = time.perf_counter()
    try:
        try:
            run_workers(
                spec, "megatron_railwave.lab.testbed.workers:fault_worker", args, cfg.timeout_s
            )
        except (RuntimeError, TimeoutError) as exc:
            launcher_error = f"{type(exc).__name__}: {exc}"
        wall = time.perf_counter() - t0
        states = [json.loads(p.read_text()) for p in sorted(state_dir.glob("rank*.json"))]
        errors = [json.loads(p.read_text()) for p in sorted(state_dir.glob("error*.json"))]
    finally:
        restore_rail(spec, node, rail)
        shutil.rmtree(state_dir, ignore_errors=True)
    return _summarize_fault(spec, cfg, wl, states, errors, launcher_error, wall)


def _summarize_fault(
    spec: TestbedSpec,
    cfg: FaultConfig,
    wl: dict[str, Any],
    states: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    launcher_error: str | None,
    wall: float,
) -> dict[str, Any]:
    g = spec.gpus_per_node
    node, rail = cfg.fail
    out: dict[str, Any] = {
        "config": asdict(cfg),
        "workload": wl["name"],
        "run_wall_s": wall,
        "ranks_reporting": len(states),
    }
    healthy = {p: {s["healthy"][p]["digest"] for s in states} for p in cfg.paths}
    out["healthy_paths_bitwise_equal"] = all(
        s["healthy"][p]["digest"] == s["healthy"]["native"]["digest"]
        for s in states
        for p in cfg.paths
    )
    out["healthy_max_rel_error_vs_dense"] = max(
        s["healthy"][p]["error"] for s in states for p in cfg.paths
    )
    aware = [r | {"rank": s["rank"]} for s in states for r in s["aware"]]
    out["aware"] = {
        "all_equal_to_healthy_native": bool(aware)
        and all(r["equal_to_healthy_native"] for r in aware),
        "max_rel_error_vs_dense": max((r["error"] for r in aware), default=None),
        "failed_nic_bytes": sum(r["tx"] + r["rx"] for r in aware if r["rank"] == node * g + rail),
        "slowest_s": {},
        "nic_bytes_per_sample_NR": {},
    }
    for path in cfg.paths:
        rows: dict[int, list[dict[str, Any]]] = {}
        for r in aware:
            if r["path"] == path:
                rows.setdefault(r["sample"], []).append(r)
        if not rows:
            continue
        out["aware"]["slowest_s"][path] = _pct(
            [max(x["total_s"] for x in v) for v in rows.values()]
        )
        nic = np.zeros((spec.nodes, g))
        for v in rows.values():
            for x in v:
                nic[x["rank"] // g, x["rank"] % g] += x["tx"] + x["rx"]
        out["aware"]["nic_bytes_per_sample_NR"][path] = (nic / len(rows)).round(0).tolist()
    for e in errors:
        e["names_failed_rail"] = bool(
            e["is_exchange_timeout"]
            and f"rail {rail} " in e["message"]
            and f"node {node}" in e["message"]
        )
    errors.sort(key=lambda e: (not e["names_failed_rail"], e["after_s"]))
    out["unaware"] = {
        "launcher_error_head": (launcher_error or "none: the run completed")[:400],
        "raised": launcher_error is not None,
        "errors": [
            {
                k: e[k]
                for k in (
                    "rank",
                    "type",
                    "is_exchange_timeout",
                    "names_failed_rail",
                    "after_s",
                    "message",
                )
            }
            for e in errors
        ],
        "names_failed_rail": any(e["names_failed_rail"] for e in errors),
    }
    out["healthy_digests"] = {p: sorted(v) for p, v in healthy.items()}
    return out


def incast_sweep(
    spec: TestbedSpec, fan_ins: tuple[int, ...], *, nbytes: int, repeats: int
) -> list[dict[str, Any]]:
    """``probes.incast_goodput`` for each fan-in on this testbed (rail 0 into node 0)."""
    from megatron_railwave.lab.testbed.probes import incast_goodput

    return [incast_goodput(spec, f, nbytes=nbytes, repeats=repeats) for f in fan_ins]


def run_online(spec: TestbedSpec, cfg: StudyConfig, *, steps: int) -> dict[str, Any]:
    """Issue 33, goal 2: ``steps`` training steps over the study's workloads as MoE layers (a
    mix of balanced and skewed ones), each step running every layer under the online selector
    and under each fixed path of ``cfg.paths`` (``workers.online_worker``). A call's time is the
    slowest rank's gather + decision + plan + dispatch + combine (the expert stand-in excluded),
    the online calls' probes included; the per-layer oracle is each layer's best fixed-path total
    in this same run."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    topo = RailTopology(
        num_nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, rail_gbps=spec.rail_mbit / 1000
    )
    workloads = build_workloads(topo, cfg)
    args = {
        "workloads": [
            {"name": w["name"], "ids_WTK": w["ids_WTK"], "windows": w["windows"]} for w in workloads
        ],
        "paths": list(cfg.paths),
        "steps": steps,
        "warmup": cfg.warmup,
        "hidden": cfg.hidden,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "num_experts": GLM45_AIR.num_experts,
        "recv_first": cfg.recv_first,
    }
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    results = run_workers(
        spec, "megatron_railwave.lab.testbed.workers:online_worker", args, cfg.timeout_s
    )
    wall = time.perf_counter() - t0
    by_key: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for res in results:
        for rec in res["records"]:
            by_key.setdefault((rec["workload"], rec["step"], rec["policy"]), []).append(rec)
    policies = ("online",) + tuple(cfg.paths)
    layers: dict[str, Any] = {}
    agree = True
    for wl in workloads:
        name = wl["name"]
        slowest = {
            p: [max(r["total_s"] for r in by_key[(name, s, p)]) for s in range(steps)]
            for p in policies
        }
        online_recs = [by_key[(name, s, "online")] for s in range(steps)]
        decisions = [
            {(r["path"], r["mode"], r["neighbourhood"]) for r in ranks} for ranks in online_recs
        ]
        agree = agree and all(len(d) == 1 for d in decisions)
        totals = {p: float(sum(v)) for p, v in slowest.items()}
        fixed = {p: totals[p] for p in cfg.paths}
        oracle_path = min(fixed, key=fixed.get)
        modes = [r[0]["mode"] for r in online_recs]
        layers[name] = {
            "rails": wl["rails"],
            "pattern": wl["pattern"],
            "layer": wl["layer"],
            "native_demand_stats": wl["native_stats"],
            "totals_s": totals,
            "oracle_path": oracle_path,
            "oracle_s": fixed[oracle_path],
            "online_over_oracle": totals["online"] / fixed[oracle_path],
            "online_over_native": totals["online"] / fixed["native"] if "native" in fixed else None,
            "path_per_step": [r[0]["path"] for r in online_recs],
            "mode_per_step": modes,
            "probe_calls": sum(m in ("probe", "reprobe") for m in modes),
            "decision_s_max_rank_mean": float(
                np.mean([max(r["decision_s"] for r in ranks) for ranks in online_recs])
            ),
            "slowest_s_per_step": slowest,
            "max_rel_error_vs_dense": max(
                res["errors"][f"{name}/{p}"] for res in results for p in policies
            ),
        }
    online_total = sum(v["totals_s"]["online"] for v in layers.values())
    oracle_total = sum(v["oracle_s"] for v in layers.values())
    balanced = {k: v["online_over_native"] for k, v in layers.items() if v["rails"] == "balanced"}
    summary = {
        "online_s": online_total,
        "per_layer_oracle_s": oracle_total,
        "online_over_oracle": online_total / oracle_total,
        **{
            f"always_{p}_over_oracle": sum(v["totals_s"][p] for v in layers.values()) / oracle_total
            for p in cfg.paths
        },
        "balanced_online_over_native": balanced,
        "goals": {
            "within_1.05x_oracle": online_total <= 1.05 * oracle_total,
            "balanced_within_1.03x_native": all(
                r is not None and r <= 1.03 for r in balanced.values()
            )
            if balanced
            else None,
        },
        "ranks_decide_the_same": agree,
        "all_policies_bitwise_equal": all(res["digests_equal"] for res in results),
    }
    return {
        "config": asdict(cfg),
        "steps": steps,
        "testbed": _spec_json(spec),
        "run_wall_s": wall,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "summary": summary,
        "layers": layers,
    }
