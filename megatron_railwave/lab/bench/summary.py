"""Run ``bench_worker`` on W loopback gloo processes and reduce its samples into the JSON result
of ``railwave bench-exchange``.

Letters: N nodes, G GPUs per node, R rails, W = N * G ranks, S samples.

Result keys (``SCHEMA``)::

    schema, config (BenchSpec fields), topology, routing, ops ('compiled': the csrc CPU twins
                  of ``make ext``; else 'reference (why)': the pure-torch ops),
    variants      {name: {median_ms, p95_ms, mean_ms, min_ms, samples_ms [S], phases_ms {phase:
                   median over samples of the slowest rank's phase time}, max_abs_err,
                   over_alltoall (median / alltoall median, or null)}}
    bytes         {record_bytes {railwave, alltoall}, railwave {path: railwave_bytes(...)},
                   alltoall: alltoall_bytes(...) | null}
    summary       {native_over_alltoall, native_goal (the bound for this size, or null),
                   native_within_goal (null without a goal), best_path, inter_node_records_ratio
                   (alltoall entries / railwave records), inter_node_payload_ratio,
                   inter_node_wire_ratio (with probs and metadata)}
    alltoall_skipped  reason string, or null when the baseline ran
    profile       cProfile text of rank 0 for ``config.profile_variant``, or null
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

from megatron_railwave.lab.bench.exchange_bench import ALLTOALL, BenchSpec, bench_worker
from megatron_railwave.lab.bench.launch import run_gloo_processes
from megatron_railwave.lab.bench.wire_bytes import (
    alltoall_bytes,
    alltoall_entry_bytes,
    railwave_bytes,
    railwave_record_bytes,
)
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.ops import compiled_for, load_error
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.schedule import RecordWireFormat, compile_schedule
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "SCHEMA",
    "run_bench_exchange",
    "wire_bytes_of",
    "NATIVE_GOALS",
    "native_goal",
    "alltoall_skip_reason",
]

SCHEMA = "railwave.bench_exchange/2"
NATIVE_GOALS = {(256, 512): 1.1, (32, 64): 1.3}
"""Goals: RailWave NATIVE's median within this factor of Megatron alltoall's, per (T, H): the
default size and the small size where fixed per-layer costs dominate (issue 10)."""


def alltoall_skip_reason(no_alltoall: bool) -> str | None:
    """Why the alltoall baseline cannot run (``no_alltoall``: the user skipped it), or None when
    it can."""
    if no_alltoall:
        return "--no-alltoall"
    try:
        have_mcore = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        have_mcore = False
    if not have_mcore:
        return "megatron-core is not installed (pip install megatron-core)"
    return None


def native_goal(spec: BenchSpec) -> float | None:
    """The NATIVE / alltoall bound for ``spec``'s size, or None when no goal is stated for it."""
    return NATIVE_GOALS.get((spec.tokens, spec.hidden))


def wire_bytes_of(spec: BenchSpec, routing_maps: list[torch.Tensor]) -> dict[str, Any]:
    """Per-path and alltoall bytes of one forward dispatch + combine (no communication)."""
    topo = spec.topology()
    elem = torch.empty((), dtype=spec.torch_dtype()).element_size()
    wire = RecordWireFormat(
        hidden=spec.hidden,
        payload_dtype=spec.torch_dtype(),
        probs_dtype=torch.float32,
        experts_per_node=spec.experts // topo.num_nodes,
    )
    rw_rec = railwave_record_bytes(wire)
    a2a_rec = alltoall_entry_bytes(hidden=spec.hidden, elem_bytes=elem)
    demand = DemandCounts.from_routing_maps(routing_maps, topo)
    per_path = {
        p: railwave_bytes(
            compile_schedule(
                build_plan(demand, topo, p, options=PlanOptions()), wire, demand=demand
            )
        )
        for p in spec.paths
    }
    return {
        "record_bytes": {"railwave": rw_rec, "alltoall": a2a_rec},
        "railwave": per_path,
        "alltoall": alltoall_bytes(routing_maps, topo, a2a_rec),
    }


def _reduce_times(per_rank: list[list[float]]) -> dict[str, Any]:
    slowest_S = np.asarray(per_rank, dtype=np.float64).max(axis=0)  # [W, S] -> [S]
    return {
        "median_ms": float(np.median(slowest_S)),
        "p95_ms": float(np.percentile(slowest_S, 95)),
        "mean_ms": float(slowest_S.mean()),
        "min_ms": float(slowest_S.min()),
        "samples_ms": [round(float(v), 4) for v in slowest_S],
    }


def run_bench_exchange(
    spec: BenchSpec, *, timeout_s: float = 900.0, alltoall_skipped: str | None = None
) -> dict[str, Any]:
    """Run the benchmark and return the result dict (see the module docstring).

    Args:
        spec: sizes, sample counts and whether to time the alltoall baseline.
        timeout_s: wall-clock limit of the whole multi-process run.
        alltoall_skipped: why the baseline is absent (recorded when ``spec.alltoall`` is False).
    """
    topo = spec.topology()
    world = topo.world_size
    if spec.experts % world:
        raise ValueError(
            f"--experts {spec.experts} must be a multiple of the world size {world} "
            f"({topo.num_nodes} nodes x {topo.gpus_per_node} GPUs)"
        )
    if not 1 <= spec.topk <= spec.experts:
        raise ValueError(f"--topk {spec.topk} must be in 1..{spec.experts}")
    if spec.samples < 1 or spec.warmups < 0:
        raise ValueError(
            f"need --samples >= 1 and --warmups >= 0, got {spec.samples}, {spec.warmups}"
        )
    maps = synthetic_routing_maps(
        topo, num_tokens=spec.tokens, num_experts=spec.experts, topk=spec.topk, seed=spec.seed
    )
    wire = wire_bytes_of(spec, maps)
    ranks = run_gloo_processes(
        bench_worker, world, spec, [m.numpy() for m in maps], timeout_s=timeout_s
    )

    names = ranks[0]["order"]
    variants: dict[str, Any] = {}
    for name in names:
        entry = _reduce_times([r["times_ms"][name] for r in ranks])
        phase_names = ranks[0]["phases_ms"][name].keys()
        entry["phases_ms"] = {
            ph: float(np.median(np.max([r["phases_ms"][name][ph] for r in ranks], axis=0)))
            for ph in phase_names
        }
        entry["max_abs_err"] = max(r["max_abs_err"].get(name, 0.0) for r in ranks)
        variants[name] = entry
    base = variants.get(ALLTOALL)
    for entry in variants.values():
        entry["over_alltoall"] = entry["median_ms"] / base["median_ms"] if base else None

    if base is None:
        wire["alltoall_timed"] = False
    rw_paths = [p for p in names if p != ALLTOALL]
    native = variants.get("native")
    a2a_bytes = wire["alltoall"]
    rw_native = wire["railwave"].get("native") or next(iter(wire["railwave"].values()))
    goal = native_goal(spec)
    summary = {
        "native_over_alltoall": native["over_alltoall"] if native and base else None,
        "native_goal": goal,
        "native_within_goal": (native["over_alltoall"] <= goal)
        if native and base and goal
        else None,
        "best_path": min(rw_paths, key=lambda p: variants[p]["median_ms"]) if rw_paths else None,
        "inter_node_records_ratio": _ratio(
            a2a_bytes["inter_node_entries"], rw_native["inter_node_records"]
        ),
        "inter_node_payload_ratio": _ratio(
            a2a_bytes["inter_node_payload_bytes"], rw_native["inter_node_payload_bytes"]
        ),
        "inter_node_wire_ratio": _ratio(
            a2a_bytes["inter_node_bytes"], rw_native["inter_node_bytes"]
        ),
    }
    return {
        "schema": SCHEMA,
        "config": spec.to_dict(),
        "topology": topo.to_dict(),
        "routing": "workloads.synthetic_routing_maps (seeded; hot experts and per-rank locality)",
        "ops": "compiled" if compiled_for(torch.device("cpu")) else f"reference ({load_error()})",
        "variants": variants,
        "bytes": wire,
        "summary": summary,
        "alltoall_skipped": None if base else (alltoall_skipped or "BenchSpec.alltoall is False"),
        "profile": ranks[0]["profile"],
    }


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None
