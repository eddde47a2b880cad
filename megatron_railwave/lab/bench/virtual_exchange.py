"""Every path of one layer on the in-process virtual cluster: equality, accuracy, syncs, time.

Letters: W ranks, T tokens per rank, E experts, K top-k, H hidden, E_loc = E / W.

``simulate_exchange`` runs, for each path, one MoE layer forward and backward on all W ranks
of a topology in this process (``exchange.VirtualCluster``), on one device, with the same
seeded routing; the experts are per-expert linear maps ``f_e(x) = x @ A_e`` scaled by the
routing probability. It reports:

* bitwise equality across the paths of every rank's output and input/probs gradients;
* the max relative error of each path against the dense closed form
  ``out[t] = sum_k p_k * x[t] @ A_k`` (and its gradients) computed in float64;
* host syncs per layer per rank (fwd + bwd): ``SyncAudit`` on the CPU,
  ``torch.cuda.set_sync_debug_mode`` on CUDA;
* the wall time of each path (all W ranks one after another: a functional check of cost,
  not a cluster timing);
* the bytes all ranks send over rails and over NVLink per layer (forward + backward), from the
  schedules.

With ``max_tokens_per_rank`` (fixed-capacity mode) every path also runs in the normal mode on
the same inputs, and the report adds bitwise equality of each path to its normal-mode run and
the normal mode's syncs and times next to the fixed mode's.

The experts run on blocks of ``EXPERT_BLOCK_ROWS`` rows (the last of each expert zero-padded) in
one batched GEMM: a GEMM's rounding may depend on its row count (on this CPU a 1- or 2-row
product takes another kernel than a 17-row one), so both modes give every entry row the same
[B, H] x [H, H] product at the same position in its block, and a difference between the modes
can only come from the exchange (checked: the tests compare them bitwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from megatron_railwave.exchange import (
    RankContext,
    VirtualCluster,
    check_capacity,
    combine_backward,
    combine_forward,
    dispatch_backward,
    dispatch_forward,
    gather_demand,
    prepare_capacity_layer,
    prepare_layer,
    virtual_rank_groups,
)
from megatron_railwave.lab.bench.sync_audit import SyncAudit
from megatron_railwave.names import ROUTES, Route, parse_route
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology

__all__ = [
    "VirtualSpec",
    "make_virtual_inputs",
    "run_virtual_layer",
    "simulate_exchange",
    "dense_reference",
    "EXPERT_BLOCK_ROWS",
    "EXPERT_CHUNK_BLOCKS",
    "estimate_peak_bytes",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXPERT_BLOCK_ROWS = 32
"""Rows of every expert GEMM of the harness (see module docstring)."""
EXPERT_CHUNK_BLOCKS = 16
"""Blocks per batched GEMM of the harness: every call is [16, B, H] x [16, H, H] (the last chunk
padded with zero blocks), so the gathered expert maps take 16 * H * H elements at a time instead
of one [H, H] map per block ([4096, 4096, 4096] bf16 = 128 GiB for fixed capacity C = 1024 at
GLM size on 4 x 8), and every block sees the same GEMM shape in both modes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VirtualSpec:
    """One virtual-cluster experiment."""

    topology: RailTopology
    tokens: int
    hidden: int
    experts: int
    topk: int
    dtype: str = "fp32"
    device: str = "cpu"
    seed: int = 0
    paths: tuple[str, ...] = tuple(map(str, ROUTES))
    options: PlanOptions = PlanOptions()
    max_tokens_per_rank: int | None = None
    """Fixed-capacity mode's C (None: the normal mode)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.experts % self.topology.world_size:
            raise ValueError(
                f"--experts {self.experts} is not divisible by the {self.topology.world_size} "
                f"ranks of "
                f"{self.topology.name!r}; pick a multiple of the world size"
            )
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"--topk {self.topk} must be in 1..{self.experts}")
        if self.tokens < 0 or self.hidden < 1:
            raise ValueError(
                f"need --tokens >= 0 and --hidden >= 1, got {self.tokens}, {self.hidden}"
            )
        try:
            check_capacity(self.max_tokens_per_rank)
        except ValueError as exc:
            raise ValueError(f"--max-tokens-per-rank: {exc}") from None
        if self.max_tokens_per_rank is not None and self.tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"--tokens {self.tokens} exceeds --max-tokens-per-rank {self.max_tokens_per_rank}; "
                "give a capacity of at least the tokens per rank"
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch has no CUDA device; use --device cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def make_virtual_inputs(spec: VirtualSpec) -> dict[str, Any]:
    """Seeded per-rank inputs and expert maps (on ``spec.device``).

    Returns:
        hidden / probs / routing / grad_out: lists over ranks of [T, H], [T, E] fp32, [T, E] bool,
        [T, H]; maps_EHH: [E, H, H] expert maps (hidden dtype).
    """
    w = spec.topology.world_size
    gen = torch.Generator().manual_seed(spec.seed)
    dev, dt = torch.device(spec.device), spec.torch_dtype
    hidden, probs, routing, grad_out = [], [], [], []
    for _ in range(w):
        scores = torch.rand(spec.tokens, spec.experts, generator=gen)
        idx = scores.topk(spec.topk, dim=1).indices
        rm = torch.zeros(spec.tokens, spec.experts, dtype=torch.bool).scatter_(1, idx, True)
        p = torch.softmax(torch.randn(spec.tokens, spec.experts, generator=gen), dim=1) * rm
        hidden.append(torch.randn(spec.tokens, spec.hidden, generator=gen).to(dev, dt))
        probs.append(p.to(dev))
        routing.append(rm.to(dev))
        grad_out.append(torch.randn(spec.tokens, spec.hidden, generator=gen).to(dev, dt))
    maps = (
        torch.randn(spec.experts, spec.hidden, spec.hidden, generator=gen) / spec.hidden**0.5
    ).to(dev, dt)
    return {
        "hidden": hidden,
        "probs": probs,
        "routing": routing,
        "grad_out": grad_out,
        "maps_EHH": maps,
    }


def _block_rows(
    spans: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host index maps of the expert blocks: (rows [n_blk * B] (a valid row or 0), valid [n_blk * B]
    bool, expert of each block [n_blk], positions of the valid rows [n]) for ``spans``."""
    b = EXPERT_BLOCK_ROWS
    rows, valid, experts = [], [], []
    for e, (start, count) in enumerate(spans):
        for b0 in range(0, count, b):
            r = min(b, count - b0)
            rows += list(range(start + b0, start + b0 + r)) + [0] * (b - r)
            valid += [True] * r + [False] * (b - r)
            experts.append(e)
    valid_t = torch.tensor(valid, dtype=torch.bool)
    return (
        torch.tensor(rows, dtype=torch.int64),
        valid_t,
        torch.tensor(experts, dtype=torch.int64),
        torch.arange(valid_t.numel())[valid_t],
    )


def _experts(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    spans: list[tuple[int, int]],
    maps: torch.Tensor,
    g_y: torch.Tensor | None,
):
    """Local expert e = per-expert linear map on rows [start_e, start_e + rows_e) of ``tokens``
    (``spans``, host ints), weighted by the entry's prob; returns y [rows, H] and, when g_y is
    given, (g_tokens, g_probs). Rows outside the spans stay zero.

    The rows go in blocks of ``EXPERT_BLOCK_ROWS`` (the last of an expert zero-padded) through
    one batched GEMM: every block is one [B, H] x [H, H] product whatever the mode or the row
    counts (see module docstring)."""
    b, h = EXPERT_BLOCK_ROWS, tokens.shape[1]
    rows, valid, experts, positions = (t.to(tokens.device) for t in _block_rows(spans))
    keep = valid

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [n_blk * B, ...] gathered rows, padding zero
        picked = t.index_select(0, rows)
        return torch.where(keep.view((-1,) + (1,) * (picked.dim() - 1)), picked, 0)

    def scatter(out: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        return out.index_copy_(
            0, rows.index_select(0, positions), blocked.index_select(0, positions)
        )

    x, p = blocks(tokens).view(-1, b, h), blocks(probs).view(-1, b)
    xa = _expert_bmm(x, experts, maps, transpose=False)
    y = scatter(torch.zeros_like(tokens), (xa * p.to(x.dtype).unsqueeze(2)).view(-1, h))
    if g_y is None:
        return y, None, None
    gy = blocks(g_y).view(-1, b, h)
    g_tok = scatter(
        torch.zeros_like(tokens),
        _expert_bmm(gy * p.to(gy.dtype).unsqueeze(2), experts, maps, transpose=True).view(-1, h),
    )
    g_p = scatter(
        torch.zeros_like(probs), (gy.float() * xa.float()).sum(dim=2).to(probs.dtype).view(-1)
    )
    return y, g_tok, g_p


def _expert_bmm(
    x_blk: torch.Tensor, experts: torch.Tensor, maps: torch.Tensor, *, transpose: bool
) -> torch.Tensor:
    """[n_blk, B, H] blocks times their expert's map (transposed for the backward), in chunks of
    ``EXPERT_CHUNK_BLOCKS`` blocks: one [CH, B, H] x [CH, H, H] batched GEMM per chunk."""
    ch, n_blk = EXPERT_CHUNK_BLOCKS, x_blk.shape[0]
    pad = -n_blk % ch
    if pad:
        x_blk = torch.cat([x_blk, x_blk.new_zeros((pad, *x_blk.shape[1:]))])
        experts = torch.cat([experts, experts.new_zeros(pad)])
    out = torch.empty_like(x_blk)
    for i in range(0, x_blk.shape[0], ch):
        a = maps.index_select(0, experts[i : i + ch])
        torch.bmm(x_blk[i : i + ch], a.transpose(1, 2) if transpose else a, out=out[i : i + ch])
    return out[:n_blk]


def run_virtual_layer(
    spec: VirtualSpec,
    inputs: dict[str, Any],
    path: str | Route,
    *,
    cluster: VirtualCluster | None = None,
    phase: int = 0,
    harness: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, list[torch.Tensor]]:
    """One layer forward + backward on every rank, through the rank programs
    (fixed-capacity mode when ``spec.max_tokens_per_rank`` is set). The harness's own work (the
    experts, their index maps and host spans) runs inside ``harness()``: the sync count runs the
    harness with CUDA's sync debug mode off, so that only the exchange's syncs are counted.

    Returns:
        per rank: 'out' [T, H], 'grad_hidden' [T, H], 'grad_probs' [T, E], 'handles' (the
        ``LayerHandle`` of each rank: schedule, rank view, index maps) and 'tokens_per_expert'
        ([E_loc] int64; host in the normal mode, device in fixed-capacity mode).
    """
    topo = spec.topology
    w, e_loc = topo.world_size, spec.experts // topo.world_size
    cluster = cluster or VirtualCluster(world_size=w)
    ctxs = [
        RankContext(
            topo=topo,
            groups=virtual_rank_groups(topo, r),
            num_experts=spec.experts,
            options=spec.options,
        )
        for r in range(w)
    ]
    h, p, rm = inputs["hidden"], inputs["probs"], inputs["routing"]
    capacity = spec.max_tokens_per_rank
    if capacity is None:
        # A min-max plan reads every rank's copies per destination GPU (the delivery counts).
        delivery = parse_route(path).min_max
        layers = cluster.run(
            [gather_demand(ctxs[r], h[r], p[r], rm[r], delivery_counts=delivery) for r in range(w)]
        )
        handles = []
        for r in range(w):
            plan = build_plan(layers[r].demand, topo, path, options=spec.options, phase=phase)
            handles.append(
                prepare_layer(
                    ctxs[r],
                    layers[r],
                    plan,
                    hidden_dtype=h[r].dtype,
                    probs_dtype=p[r].dtype,
                    hidden_size=spec.hidden,
                )
            )
    else:
        handles = [
            prepare_capacity_layer(ctxs[r], h[r], p[r], rm[r], path=path, capacity=capacity)
            for r in range(w)
        ]
    dispatched = cluster.run(
        [dispatch_forward(ctxs[r], handles[r], h[r], p[r], rm[r]) for r in range(w)]
    )
    maps = inputs["maps_EHH"]
    local_maps = [maps[r * e_loc : (r + 1) * e_loc] for r in range(w)]
    with harness():
        spans, tokens_per_expert, ys = _expert_forward(
            dispatched, handles, local_maps, w, e_loc, capacity
        )
    outs = cluster.run(
        [combine_forward(ctxs[r], handles[r], dispatched[r][2], ys[r]) for r in range(w)]
    )
    g_ys = cluster.run(
        [
            combine_backward(ctxs[r], handles[r], dispatched[r][2], inputs["grad_out"][r])
            for r in range(w)
        ]
    )
    with harness():
        grads = [
            _experts(dispatched[r][0], dispatched[r][1], spans[r], local_maps[r], g_ys[r])
            for r in range(w)
        ]
    back = cluster.run(
        [
            dispatch_backward(ctxs[r], handles[r], dispatched[r][2], grads[r][1], grads[r][2])
            for r in range(w)
        ]
    )
    return {
        "out": outs,
        "grad_hidden": [b[0] for b in back],
        "grad_probs": [b[1] for b in back],
        "handles": handles,
        "tokens_per_expert": tokens_per_expert,
    }


def _expert_forward(
    dispatched: list, handles: list, local_maps: list, w: int, e_loc: int, capacity: int | None
):
    """The experts' forward on every rank: (spans, tokens_per_expert, outputs), all by rank."""
    if capacity is None:  # host counts: expert e's rows follow expert e - 1's
        tokens_per_expert = [handles[r].tokens_per_expert for r in range(w)]
        spans = []
        for r in range(w):
            counts = tokens_per_expert[r].tolist()
            starts = [sum(counts[:e]) for e in range(e_loc)]
            spans.append(list(zip(starts, counts)))
    else:  # padded layout: expert e owns rows [e * W * C, (e + 1) * W * C), the padding is zero
        tokens_per_expert = [dispatched[r][2].tokens_per_expert for r in range(w)]
        spans = [[(e * w * capacity, w * capacity) for e in range(e_loc)]] * w
    ys = [
        _experts(dispatched[r][0], dispatched[r][1], spans[r], local_maps[r], None)[0]
        for r in range(w)
    ]
    return spans, tokens_per_expert, ys


def dense_reference(
    spec: VirtualSpec, inputs: dict[str, Any], rank: int
) -> dict[str, torch.Tensor]:
    """The layer in closed form, float64, on one rank's tokens."""
    x = inputs["hidden"][rank].double()
    pr = inputs["probs"][rank].double() * inputs["routing"][rank]
    g = inputs["grad_out"][rank].double()
    maps = inputs["maps_EHH"].double()
    out = torch.zeros_like(x)
    g_x = torch.zeros_like(x)
    g_p = torch.zeros_like(pr)
    routing = inputs["routing"][rank]
    for e in range(spec.experts):
        rows = torch.nonzero(
            routing[:, e]
        ).flatten()  # the reference is host-side work: syncs are fine
        if rows.numel() == 0:
            continue
        xa = x.index_select(0, rows) @ maps[e]
        p_e = pr.index_select(0, rows)[:, e : e + 1]
        g_e = g.index_select(0, rows)
        out.index_add_(0, rows, xa * p_e)
        g_x.index_add_(0, rows, (g_e * p_e) @ maps[e].t())
        g_p[rows, e] = (g_e * xa).sum(dim=1)
    return {"out": out, "grad_hidden": g_x, "grad_probs": g_p}


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not ref.numel():
        return 0.0
    scale = ref.abs().max().item()
    if scale == 0:
        return float((got.double() - ref).abs().max().item()) if got.numel() else 0.0
    return float((got.double() - ref).abs().max().item() / scale)


def _count_cuda_syncs(spec: VirtualSpec, inputs: dict[str, Any], path: str) -> float:
    """Host syncs of the exchange in one layer (fwd + bwd) on CUDA, per rank: CUDA's sync debug
    mode warns at every synchronising call of the exchange; the harness (experts, their
    host-to-device index maps) runs with the mode off, so its own copies are not counted."""

    @contextlib.contextmanager
    def harness():
        torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_virtual_layer(spec, inputs, path, harness=harness)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(c.message) for c in caught) / spec.topology.world_size


def _count_syncs(spec: VirtualSpec, inputs: dict[str, Any], path: str) -> float:
    """Host syncs of the exchange in one layer (fwd + bwd), per rank."""
    w = spec.topology.world_size
    if spec.device == "cuda":
        return _count_cuda_syncs(spec, inputs, path)
    with SyncAudit() as audit:
        audit.mark(
            *inputs["hidden"],
            *inputs["probs"],
            *inputs["routing"],
            *inputs["grad_out"],
            inputs["maps_EHH"],
        )
        run_virtual_layer(spec, inputs, path)
    return audit.count / w


def _run_paths(
    spec: VirtualSpec, inputs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, float]]:
    """Every path once for warm-up (allocator, kernels, the capacity plan's cache), once timed."""
    results, times = {}, {}
    for path in spec.paths:
        run_virtual_layer(spec, inputs, path)
        if spec.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results[path] = run_virtual_layer(spec, inputs, path)
        if spec.device == "cuda":
            torch.cuda.synchronize()
        times[path] = (time.perf_counter() - t0) * 1e3
    return results, times


def _wire_bytes(result: dict[str, Any]) -> dict[str, int]:
    """Bytes all ranks send over rails and over NVLink in one layer, forward + backward, from
    each rank's schedule (self copies excluded)."""
    out = {"rail": 0, "nvlink": 0}
    for r, handle in enumerate(result["handles"]):
        sched = handle.schedule
        for backward in (False, True):
            sent = sched.rank_bytes(r, backward=backward)["sent"]
            for p in sched.phases:
                out["rail" if p.group == "rail" else "nvlink"] += sent[p.index]
    return out


def _equal(a: dict[str, Any], b: dict[str, Any], w: int) -> bool:
    return all(
        torch.equal(a[k][r], b[k][r])
        for k in ("out", "grad_hidden", "grad_probs")
        for r in range(w)
    )


def estimate_peak_bytes(spec: VirtualSpec) -> int:
    """Estimated peak device memory of ``simulate_exchange(spec)``, bytes (a model of this
    harness, not a measurement; the report adds the measured peak on CUDA). Terms: the inputs
    and the [E, H, H] maps; per rank, about six [rows, H] tensors alive at once (dispatched
    tokens, received copies, expert outputs, their gradients), where rows is twice the mean
    entries per rank (T * K; skew) in the normal mode and E_loc * W * C in fixed-capacity mode;
    the results of every path kept for the equality check (twice in fixed-capacity mode, which
    also runs the normal mode); one chunk of gathered maps; plus a quarter for the allocator."""
    w, t, h, e, k = spec.topology.world_size, spec.tokens, spec.hidden, spec.experts, spec.topk
    elt = spec.torch_dtype.itemsize
    inputs = w * (2 * t * h * elt + t * e * 5) + e * h * h * elt
    rows = 2 * t * k
    if spec.max_tokens_per_rank is not None:
        rows = max(rows, (e // w) * w * spec.max_tokens_per_rank)
    layer = 6 * w * rows * h * elt
    results = (
        len(spec.paths) * w * t * (2 * h * elt + e * 4) * (2 if spec.max_tokens_per_rank else 1)
    )
    gemm = 2 * EXPERT_CHUNK_BLOCKS * h * h * elt
    return int(1.25 * (inputs + layer + results + gemm))


def simulate_exchange(spec: VirtualSpec) -> dict[str, Any]:
    """Run every path of ``spec`` (see module docstring); a JSON-ready report."""
    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    inputs = make_virtual_inputs(spec)
    w = spec.topology.world_size
    results, times = _run_paths(spec, inputs)
    base = spec.paths[0]
    bitwise = {path: _equal(results[path], results[base], w) for path in spec.paths}
    errors = {path: {k: 0.0 for k in ("out", "grad_hidden", "grad_probs")} for path in spec.paths}
    for r in range(w):
        ref = dense_reference(spec, inputs, r)
        for path in spec.paths:
            for k in errors[path]:
                errors[path][k] = max(errors[path][k], _rel_error(results[path][k][r], ref[k]))
    syncs = {path: _count_syncs(spec, inputs, path) for path in spec.paths}
    topo = spec.topology
    report = {
        "schema": "railwave.simulate_exchange/1",
        "topology": topo.to_dict(),
        "tokens": spec.tokens,
        "hidden": spec.hidden,
        "experts": spec.experts,
        "topk": spec.topk,
        "dtype": spec.dtype,
        "device": spec.device,
        "seed": spec.seed,
        "max_tokens_per_rank": spec.max_tokens_per_rank,
        "bitwise_equal_to": base,
        "bitwise_equal": bitwise,
        "all_bitwise_equal": all(bitwise.values()),
        "max_rel_error": errors,
        "host_syncs_per_layer": syncs,
        "time_ms": times,
        "wire_bytes": {path: _wire_bytes(results[path]) for path in spec.paths},
        "estimated_peak_bytes": estimate_peak_bytes(spec),
    }
    if spec.max_tokens_per_rank is not None:
        normal_spec = dataclasses.replace(spec, max_tokens_per_rank=None)
        normal, normal_times = _run_paths(normal_spec, inputs)
        report["bitwise_equal_to_normal_mode"] = {
            path: _equal(results[path], normal[path], w) for path in spec.paths
        }
        report["all_bitwise_equal"] = report["all_bitwise_equal"] and all(
            report["bitwise_equal_to_normal_mode"].values()
        )
        report["normal_mode"] = {
            "host_syncs_per_layer": {
                path: _count_syncs(normal_spec, inputs, path) for path in spec.paths
            },
            "time_ms": normal_times,
            "wire_bytes": {path: _wire_bytes(normal[path]) for path in spec.paths},
        }
    if spec.device == "cuda":
        report["measured_peak_bytes"] = torch.cuda.max_memory_allocated()
    return report
