"""Benchmark of the data-movement ops (``railwave ops-bench``): each op of ``megatron_railwave.ops``
against its pure-torch reference and against a plain copy of the same bytes on the same device.

Letters: T tokens of one rank, H hidden, E experts, K top-k, N nodes, G GPUs per node,
M = 2**G masks, C = N * T record capacity, n records of the measured rank, S segments.

The case is one GLM-4.5-Air layer seen from rank 0 of an N x G cluster (default T=4096, H=4096
bf16, E=128, top-8, 4x8): every rank's routing map is drawn (uniform top-K), the JOINT plan is
built from the gathered counts, and rank 0's inputs are:

* records_from_routing: its [T, E] routing map.
* assign_egress / records_per_node_rail: its capacity-padded records ([C], as the exchange passes
  them without a host sync) and the plan's quotas.
* pack_rows: payload [T, H] bf16 and probs [T, K] fp32 gathered by token, int64 metadata [n, 2]
  per record; unpack_rows: the packed rows back (dispatch arrival), and scattered by a
  permutation (``unpack_rows_scatter``).
* segment_sum: one [H] bf16 copy per (record, target GPU), ordered by target GPU as the combine
  receives them, summed per record (S = n), bf16 out.

Timing: warm-up calls, then the median of ``repeats`` calls (CUDA: events around each call; CPU:
wall clock, one thread); the op, its reference and the copy are called in turn, so that on a
shared machine all three see the same background load. Bandwidth = bytes read + written by the op /
time; the copy baseline copies a buffer of the op's read bytes (CUDA: into a preallocated buffer,
``copy_``; CPU:
``clone``, which allocates like the ops do) and its bandwidth counts read + write too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_railwave import ops
from megatron_railwave.ops import reference
from megatron_railwave.planner import build_plan
from megatron_railwave.planner.railbalance import surplus_deficit_bounds
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = ["OpsBenchSpec", "QUICK", "SCHEMA", "run_ops_bench"]

SCHEMA = "railwave.ops_bench/1"

CPU_SPEEDUP_GOAL = 3.0
"""CPU goal: each compiled op at least this many times faster than its reference (one thread)."""
CUDA_COPY_FRACTION_GOALS = {
    "pack_rows": 0.8,
    "unpack_rows": 0.8,
    "unpack_rows_scatter": 0.8,
    "segment_sum": 0.6,
}
"""CUDA goals: bandwidth of the op as a fraction of the measured device-to-device copy."""
CUDA_RECORDS_ASSIGN_US_GOAL = 50.0
"""CUDA goal: records_from_routing + assign_egress per layer, microseconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpsBenchSpec:
    """Sizes and repeats of one ops-bench run."""

    num_tokens: int = 4096
    """T: tokens per rank."""
    hidden: int = 4096
    """H: hidden size (bf16 payload)."""
    num_experts: int = 128
    """E: experts (divisible by N * G)."""
    topk: int = 8
    """K: experts per token."""
    num_nodes: int = 4
    """N: nodes."""
    gpus_per_node: int = 8
    """G: GPUs per node."""
    warmup: int = 1
    """Untimed calls per op."""
    repeats: int = 5
    """Timed calls per op (the median is reported)."""
    seed: int = 0
    """Routing and data seed."""

    def __post_init__(self) -> None:
        for name in (
            "num_tokens",
            "hidden",
            "num_experts",
            "topk",
            "num_nodes",
            "gpus_per_node",
            "repeats",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ops-bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"ops-bench: warmup must be >= 0, got {self.warmup}")
        if self.num_experts % (self.num_nodes * self.gpus_per_node):
            raise ValueError(
                f"ops-bench: E={self.num_experts} experts do not split over {self.num_nodes} x "
                f"{self.gpus_per_node} GPUs; pass --experts as a multiple of "
                f"{self.num_nodes * self.gpus_per_node}"
            )
        if self.topk > self.num_experts:
            raise ValueError(f"ops-bench: topk={self.topk} exceeds E={self.num_experts}")


QUICK = OpsBenchSpec(num_tokens=256, hidden=256, num_experts=64, topk=8, warmup=1, repeats=3)
"""A smoke-test size (seconds on CPU)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Case:
    """One op's timed call, its reference and its byte count."""

    name: str
    run: Callable[[], Any]
    run_reference: Callable[[], Any]
    bytes_read: int
    bytes_written: int


def _routing_maps(spec: OpsBenchSpec, gen: torch.Generator) -> list[torch.Tensor]:
    world = spec.num_nodes * spec.gpus_per_node
    maps = []
    for _ in range(world):
        ids = (
            torch.rand(spec.num_tokens, spec.num_experts, generator=gen)
            .topk(spec.topk, dim=1)
            .indices
        )
        maps.append(
            torch.zeros(spec.num_tokens, spec.num_experts, dtype=torch.bool).scatter_(1, ids, True)
        )
    return maps


def _cases(spec: OpsBenchSpec, device: torch.device) -> tuple[list[_Case], dict[str, int]]:
    gen = torch.Generator().manual_seed(spec.seed)
    topo = RailTopology(num_nodes=spec.num_nodes, gpus_per_node=spec.gpus_per_node)
    maps = _routing_maps(spec, gen)
    plan = build_plan(DemandCounts.from_routing_maps(maps, topo), topo, "joint")
    n_nodes, g = spec.num_nodes, spec.gpus_per_node
    routing = maps[0].to(device)
    token_C, node_C, mask_C, counts_NM = (
        t.to(device) for t in reference.records_from_routing(maps[0], n_nodes, g)
    )
    keep, s_lo, _, _, d_hi = surplus_deficit_bounds(plan.records_NNG[0], plan.quota_NNG[0])
    egress_args = dict(
        owner_gpu=0,
        counts_N=plan.records_NNG[0, :, 0].to(device),
        keep_N=keep[:, 0].to(device),
        surplus_lo_N=s_lo[:, 0].to(device),
        deficit_hi_NG=d_hi.to(device),
        wave_N=plan.pair_wave_NN[0].to(device),
    )
    egress_C, _ = reference.assign_egress(node_C, **egress_args)
    rail_of_gpu = torch.tensor(topo.rail_of_gpu, device=device)
    num_records = int(counts_NM.sum())  # host sync: setup only

    payload = torch.randn(spec.num_tokens, spec.hidden, generator=gen).to(torch.bfloat16).to(device)
    probs = torch.rand(spec.num_tokens, spec.topk, generator=gen).to(device)
    meta = torch.randint(0, 1 << 20, (num_records, 2), generator=gen).to(device)
    token_R = token_C[:num_records]
    tensors, index = [payload, probs, meta], [token_R, token_R, None]
    specs = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
    row_bytes = ops.row_bytes(specs)
    packed = reference.pack_rows(tensors, index)
    scatter = torch.randperm(num_records, generator=gen).to(device)

    # The combine's copies: one per (record, target GPU), grouped by target GPU, summed per record.
    mask_R = mask_C[:num_records].cpu()
    segment_R = torch.cat([torch.nonzero((mask_R >> j) & 1).flatten() for j in range(g)])
    num_copies = int(segment_R.numel())
    copies = torch.randn(num_copies, spec.hidden, generator=gen).to(torch.bfloat16).to(device)
    segment_R = segment_R.to(device)
    longest = (
        int(torch.bincount(segment_R.cpu()).max()) if num_copies else 0
    )  # the reference's bound off CPU

    c, e, t = n_nodes * spec.num_tokens, spec.num_experts, spec.num_tokens
    m, h, i64 = 1 << g, spec.hidden, 8
    cases = [
        _Case(
            name="records_from_routing",
            run=lambda: ops.records_from_routing(routing, n_nodes, g),
            run_reference=lambda: reference.records_from_routing(routing, n_nodes, g),
            bytes_read=t * e,
            bytes_written=3 * c * i64 + n_nodes * m * i64,
        ),
        _Case(
            name="assign_egress",
            run=lambda: ops.assign_egress(node_C, **egress_args),
            run_reference=lambda: reference.assign_egress(node_C, **egress_args),
            bytes_read=c * i64,
            bytes_written=2 * c * i64,
        ),
        _Case(
            name="records_per_node_rail",
            run=lambda: ops.records_per_node_rail(
                node_C, egress_C, rail_of_gpu, n_nodes, topo.num_rails
            ),
            run_reference=lambda: reference.records_per_node_rail(
                node_C, egress_C, rail_of_gpu, n_nodes, topo.num_rails
            ),
            bytes_read=2 * c * i64,
            bytes_written=n_nodes * topo.num_rails * i64,
        ),
        _Case(
            name="pack_rows",
            run=lambda: ops.pack_rows(tensors, index),
            run_reference=lambda: reference.pack_rows(tensors, index),
            bytes_read=num_records * row_bytes,
            bytes_written=num_records * row_bytes,
        ),
        _Case(
            name="unpack_rows",
            run=lambda: ops.unpack_rows(packed, specs),
            run_reference=lambda: reference.unpack_rows(packed, specs),
            bytes_read=num_records * row_bytes,
            bytes_written=num_records * row_bytes,
        ),
        _Case(
            name="unpack_rows_scatter",
            run=lambda: ops.unpack_rows(packed, specs, row_index=scatter, num_rows=num_records),
            run_reference=lambda: reference.unpack_rows(
                packed, specs, row_index=scatter, num_rows=num_records
            ),
            bytes_read=num_records * row_bytes,
            bytes_written=num_records * row_bytes,
        ),
        _Case(
            name="segment_sum",
            run=lambda: ops.segment_sum(copies, segment_R, num_records),
            run_reference=lambda: reference.segment_sum(
                copies, segment_R, num_records, max_segment_len=longest
            ),
            bytes_read=num_copies * (h * 2 + i64),
            bytes_written=num_records * h * 2,
        ),
    ]
    sizes = dict(
        records=num_records,
        capacity=c,
        copies=num_copies,
        row_bytes=row_bytes,
        longest_segment=longest,
    )
    return cases, sizes


def _same_outputs(a: Any, b: Any) -> bool:
    """True when two op results (a tensor, or tuples / lists of them, or None) are equal: same
    structure, and per tensor the same dtype, shape and values (``torch.equal``; every op here is
    specified bitwise equal to its reference)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e-3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _median_seconds(
    fns: list[Callable[[], Any]], device: torch.device, *, warmup: int, repeats: int
) -> list[float]:
    """Median time of each function. Calls are interleaved (f0, f1, ..., f0, f1, ...) so that all
    of them see the same background load on a shared machine."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples, strict=True):
            out.append(_call_seconds(fn, device))
    return [statistics.median(s) for s in samples]


def _copy_fn(num_bytes: int, device: torch.device) -> Callable[[], Any]:
    """A plain copy of ``num_bytes``: CUDA copy_ into a preallocated buffer; CPU clone
    (allocates)."""
    src = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device=device).fill_(1)
    if device.type == "cuda":
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    return src.clone


def _goal(device: torch.device, name: str, row: dict[str, Any]) -> dict[str, Any] | None:
    if device.type == "cpu":
        return {
            "what": f"speedup vs reference >= {CPU_SPEEDUP_GOAL:g}",
            "met": row["speedup_vs_reference"] >= CPU_SPEEDUP_GOAL,
        }
    if name in CUDA_COPY_FRACTION_GOALS:
        goal = CUDA_COPY_FRACTION_GOALS[name]
        return {
            "what": f"bandwidth >= {goal:g} of the copy",
            "met": row["fraction_of_copy"] >= goal,
        }
    return None


def run_ops_bench(spec: OpsBenchSpec, device: torch.device | str) -> dict[str, Any]:
    """Time every op, its reference and the copy baseline; returns the JSON-ready result.

    On CPU the run uses one thread (``torch.set_num_threads(1)``), restored afterwards.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("ops-bench --device cuda: torch sees no CUDA device; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"ops-bench: device must be cpu or cuda, got {device.type!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled = ops.compiled_for(device)
        cases, sizes = _cases(spec, device)
        rows = []
        for case in cases:
            op_s, ref_s, copy_s = _median_seconds(
                [case.run, case.run_reference, _copy_fn(case.bytes_read, device)],
                device,
                warmup=spec.warmup,
                repeats=spec.repeats,
            )
            moved = case.bytes_read + case.bytes_written
            row = {
                "op": case.name,
                "ms": op_s * 1e3,
                "reference_ms": ref_s * 1e3,
                "speedup_vs_reference": ref_s / op_s,
                "bytes": moved,
                "GBps": moved / op_s / 1e9,
                "copy_ms": copy_s * 1e3,
                "copy_GBps": 2 * case.bytes_read / copy_s / 1e9,
            }
            row["fraction_of_copy"] = row["GBps"] / row["copy_GBps"]
            # Checked after the timing, on fresh calls: a kernel that times well but writes the
            # wrong bytes fails the bench.
            row["equal_to_reference"] = _same_outputs(case.run(), case.run_reference())
            row["goal"] = _goal(device, case.name, row)
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    by_name = {r["op"]: r for r in rows}
    records_assign_us = (
        by_name["records_from_routing"]["ms"] + by_name["assign_egress"]["ms"]
    ) * 1e3
    result = {
        "schema": SCHEMA,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": 1,
        "compiled": compiled,
        "compiled_unavailable_reason": None if compiled else ops.load_error(),
        "spec": asdict(spec),
        "sizes": sizes,
        "ops": rows,
        "records_plus_assign_us": records_assign_us,
        "all_equal_to_reference": all(r["equal_to_reference"] for r in rows),
    }
    if device.type == "cuda":
        result["records_plus_assign_goal"] = {
            "what": f"<= {CUDA_RECORDS_ASSIGN_US_GOAL:g} us",
            "met": records_assign_us <= CUDA_RECORDS_ASSIGN_US_GOAL,
        }
    return result
