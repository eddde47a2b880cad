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
  not a cluster timing).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..exchange import (RankContext, VirtualCluster, combine_backward, combine_forward, dispatch_backward,
                        dispatch_forward, gather_demand, prepare_layer, virtual_rank_groups)
from ..planner import Path, PlanOptions, build_plan
from ..topology import RailTopology
from .sync_audit import SyncAudit

__all__ = ["VirtualSpec", "make_virtual_inputs", "run_virtual_layer", "simulate_exchange", "dense_reference"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    paths: tuple[str, ...] = ("native", "rail", "perm", "joint")
    options: PlanOptions = PlanOptions()

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.experts % self.topology.world_size:
            raise ValueError(f"--experts {self.experts} is not divisible by the {self.topology.world_size} ranks of "
                             f"{self.topology.name!r}; pick a multiple of the world size")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"--topk {self.topk} must be in 1..{self.experts}")
        if self.tokens < 0 or self.hidden < 1:
            raise ValueError(f"need --tokens >= 0 and --hidden >= 1, got {self.tokens}, {self.hidden}")
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
    maps = (torch.randn(spec.experts, spec.hidden, spec.hidden, generator=gen) / spec.hidden ** 0.5).to(dev, dt)
    return {"hidden": hidden, "probs": probs, "routing": routing, "grad_out": grad_out, "maps_EHH": maps}


def _experts(tokens: torch.Tensor, probs: torch.Tensor, counts: list[int], maps: torch.Tensor, g_y: torch.Tensor | None):
    """Local experts on [n_ent, H] rows contiguous per expert: y, and (g_tokens, g_probs) when g_y is given."""
    ys, g_tok, g_p = [], [], []
    start = 0
    for e, c in enumerate(counts):
        x, p = tokens[start:start + c], probs[start:start + c]
        xa = x @ maps[e]
        ys.append(xa * p.to(x.dtype).unsqueeze(1))
        if g_y is not None:
            gy = g_y[start:start + c]
            g_tok.append((gy * p.to(gy.dtype).unsqueeze(1)) @ maps[e].t())
            g_p.append((gy.float() * xa.float()).sum(dim=1).to(probs.dtype))
        start += c
    y = torch.cat(ys) if ys else tokens[:0]
    if g_y is None:
        return y, None, None
    return y, (torch.cat(g_tok) if g_tok else tokens[:0]), (torch.cat(g_p) if g_p else probs[:0])


def run_virtual_layer(spec: VirtualSpec, inputs: dict[str, Any], path: str | Path, *,
                      cluster: VirtualCluster | None = None, phase: int = 0) -> dict[str, list[torch.Tensor]]:
    """One layer forward + backward on every rank, through the rank programs.

    Returns:
        per rank: 'out' [T, H], 'grad_hidden' [T, H], 'grad_probs' [T, E], and 'handles' (the
        ``LayerHandle`` of each rank: schedule, rank view, index maps).
    """
    topo = spec.topology
    w, e_loc = topo.world_size, spec.experts // topo.world_size
    cluster = cluster or VirtualCluster(world_size=w)
    ctxs = [RankContext(topo=topo, groups=virtual_rank_groups(topo, r), num_experts=spec.experts,
                        options=spec.options) for r in range(w)]
    h, p, rm = inputs["hidden"], inputs["probs"], inputs["routing"]
    layers = cluster.run([gather_demand(ctxs[r], h[r], p[r], rm[r]) for r in range(w)])
    handles = []
    for r in range(w):
        plan = build_plan(layers[r].demand, topo, path, options=spec.options, phase=phase)
        handles.append(prepare_layer(ctxs[r], layers[r], plan, hidden_dtype=h[r].dtype, probs_dtype=p[r].dtype,
                                     hidden_size=spec.hidden))
    dispatched = cluster.run([dispatch_forward(ctxs[r], handles[r], h[r], p[r], rm[r]) for r in range(w)])
    maps = inputs["maps_EHH"]
    local_maps = [maps[r * e_loc:(r + 1) * e_loc] for r in range(w)]
    counts = [handles[r].tokens_per_expert.tolist() for r in range(w)]
    ys = [_experts(dispatched[r][0], dispatched[r][1], counts[r], local_maps[r], None)[0] for r in range(w)]
    outs = cluster.run([combine_forward(ctxs[r], handles[r], dispatched[r][2], ys[r]) for r in range(w)])
    g_ys = cluster.run([combine_backward(ctxs[r], handles[r], dispatched[r][2], inputs["grad_out"][r])
                        for r in range(w)])
    grads = [_experts(dispatched[r][0], dispatched[r][1], counts[r], local_maps[r], g_ys[r]) for r in range(w)]
    back = cluster.run([dispatch_backward(ctxs[r], handles[r], dispatched[r][2], grads[r][1], grads[r][2])
                        for r in range(w)])
    return {"out": outs, "grad_hidden": [b[0] for b in back], "grad_probs": [b[1] for b in back],
            "handles": handles}


def dense_reference(spec: VirtualSpec, inputs: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
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
        rows = torch.nonzero(routing[:, e]).flatten()  # the reference is host-side work: syncs are fine
        if rows.numel() == 0:
            continue
        xa = x.index_select(0, rows) @ maps[e]
        p_e = pr.index_select(0, rows)[:, e:e + 1]
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


def _count_syncs(spec: VirtualSpec, inputs: dict[str, Any], path: str) -> float:
    """Host syncs of one layer (fwd + bwd), per rank."""
    w = spec.topology.world_size
    if spec.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run_virtual_layer(spec, inputs, path)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(c.message) for c in caught) / w
    with SyncAudit() as audit:
        audit.mark(*inputs["hidden"], *inputs["probs"], *inputs["routing"], *inputs["grad_out"], inputs["maps_EHH"])
        run_virtual_layer(spec, inputs, path)
    return audit.count / w


def simulate_exchange(spec: VirtualSpec) -> dict[str, Any]:
    """Run every path of ``spec`` (see module docstring); a JSON-ready report."""
    inputs = make_virtual_inputs(spec)
    w = spec.topology.world_size
    results, times = {}, {}
    for path in spec.paths:
        run_virtual_layer(spec, inputs, path)  # warm-up (allocator, kernels)
        if spec.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results[path] = run_virtual_layer(spec, inputs, path)
        if spec.device == "cuda":
            torch.cuda.synchronize()
        times[path] = (time.perf_counter() - t0) * 1e3
    base = spec.paths[0]
    bitwise = {path: all(torch.equal(results[path][k][r], results[base][k][r])
                         for k in ("out", "grad_hidden", "grad_probs") for r in range(w))
               for path in spec.paths}
    errors = {path: {k: 0.0 for k in ("out", "grad_hidden", "grad_probs")} for path in spec.paths}
    for r in range(w):
        ref = dense_reference(spec, inputs, r)
        for path in spec.paths:
            for k in errors[path]:
                errors[path][k] = max(errors[path][k], _rel_error(results[path][k][r], ref[k]))
    syncs = {path: _count_syncs(spec, inputs, path) for path in spec.paths}
    topo = spec.topology
    return {
        "schema": "railwave.simulate_exchange/1",
        "topology": topo.to_dict(),
        "tokens": spec.tokens, "hidden": spec.hidden, "experts": spec.experts, "topk": spec.topk,
        "dtype": spec.dtype, "device": spec.device, "seed": spec.seed,
        "bitwise_equal_to": base,
        "bitwise_equal": bitwise,
        "all_bitwise_equal": all(bitwise.values()),
        "max_rel_error": errors,
        "host_syncs_per_layer": syncs,
        "time_ms": times,
    }
