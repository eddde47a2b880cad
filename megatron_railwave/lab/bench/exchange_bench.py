"""Interleaved CPU benchmark of one dispatch + combine: RailWave's four paths next to Megatron's
``alltoall`` dispatcher, on the same routing, over gloo on loopback.

Letters: N nodes, G GPUs per node, W = N * G ranks (= EP size), T tokens per rank, E experts,
E_loc = E / W local experts, H hidden, n_ent received (token, local expert) entries.

Each rank builds the same inputs for every variant: hidden [T, H], probs [T, E] (float32, zero
off the routing map) and the routing map [T, E] of ``replay.synthetic_routing_maps`` (seeded, so
all ranks agree). The "experts" are the identity weighted by the entry's prob
(``y = tokens * probs``), so every variant's output must equal ``hidden * probs.sum(-1)``;
``max_abs_err`` in the result checks it.

* RailWave variants drive ``TorchDistExchange`` directly: ``gather_demand`` (the one host sync)
  -> ``plan`` -> ``dispatch`` -> experts -> ``combine``.
* ``alltoall`` drives ``MoEAlltoAllTokenDispatcher`` through its six hooks. On a CPU-only torch
  Megatron-Core needs the CPU shims of ``testing.megatron_cpu``, applied before ``megatron.core``
  is imported.

Timing: ``warmups`` rounds of every variant, then ``samples`` rounds; in round i the variants run
in turn, starting at variant i mod V (round-robin, so no variant always runs first). Each variant
call starts after a barrier and is timed on every rank; the parent keeps, per sample, the slowest
rank's time. With ``backward`` the timed region also runs the backward of
``sum(out * grad)``. Planning, index building and metadata are inside the timed region.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_railwave.exchange import TorchDistExchange, build_rail_groups
from megatron_railwave.names import ROUTES, parse_route
from megatron_railwave.planner import PlanOptions
from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
from megatron_railwave.topology import RailTopology

__all__ = ["BenchSpec", "bench_worker", "make_rank_inputs", "RAILWAVE_PATHS", "ALLTOALL"]

RAILWAVE_PATHS = tuple(map(str, ROUTES))
ALLTOALL = "alltoall"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchSpec:
    """One benchmark run (picklable; every rank gets the same spec)."""

    num_nodes: int
    gpus_per_node: int
    tokens: int
    """T, tokens per rank."""
    hidden: int
    experts: int
    topk: int
    dtype: str = "fp32"
    seed: int = 0
    warmups: int = 3
    samples: int = 20
    backward: bool = False
    paths: tuple[str, ...] = RAILWAVE_PATHS
    alltoall: bool = False
    """Also time Megatron's alltoall dispatcher (needs megatron-core; the CPU shims of
    ``testing.megatron_cpu`` are applied in every rank)."""
    profile_variant: str | None = None
    """Profile this variant's timed samples with cProfile on rank 0 (None: no profile)."""
    profile_top: int = 25
    failed_rails: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def topology(self) -> RailTopology:
        return RailTopology(
            num_nodes=self.num_nodes,
            gpus_per_node=self.gpus_per_node,
            failed_rails=frozenset(self.failed_rails),
            name=f"{self.num_nodes}x{self.gpus_per_node}",
        )

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_rank_inputs(spec: BenchSpec, rank: int, routing_maps: list[torch.Tensor]):
    """(hidden [T, H] dtype, probs [T, E] float32, routing_map [T, E] bool, grad [T, H]) of
    ``rank``."""
    gen = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    routing = routing_maps[rank]
    hidden = torch.randn(spec.tokens, spec.hidden, generator=gen).to(spec.torch_dtype())
    probs = torch.rand(spec.tokens, spec.experts, generator=gen) * routing
    grad = torch.randn(spec.tokens, spec.hidden, generator=gen).to(spec.torch_dtype())
    return hidden, probs, routing, grad


class _Phases:
    """Accumulates named wall-clock phases of one call (ms)."""

    __slots__ = ("t", "ms")

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.ms: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = self.ms.get(name, 0.0) + (now - self.t) * 1e3
        self.t = now


Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, _Phases], torch.Tensor]


def _railwave_variant(exchange: TorchDistExchange, path: str) -> Variant:
    calls = [0]
    min_max = parse_route(path).min_max  # its plan reads the delivery counts

    def run(hidden, probs, routing, ph: _Phases) -> torch.Tensor:
        layer = exchange.gather_demand(hidden, probs, routing, delivery_counts=min_max)
        ph.mark("counts")
        plan = exchange.plan(layer, path, phase=calls[0])
        calls[0] += 1
        handle = exchange.prepare(layer, plan, hidden, probs)
        ph.mark("plan")
        out = exchange.dispatch(hidden, probs, routing, handle)
        ph.mark("dispatch")
        y = out.tokens * out.probs.unsqueeze(1).to(out.tokens.dtype)
        ph.mark("experts")
        result = exchange.combine(y, out.handle)
        ph.mark("combine")
        return result

    return run


def _alltoall_variant(spec: BenchSpec, world: int) -> Variant:
    """Megatron's MoEAlltoAllTokenDispatcher, EP = W, TP = 1, driven through its six hooks."""
    apply_megatron_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    config = TransformerConfig(
        num_layers=1,
        hidden_size=spec.hidden,
        num_attention_heads=1,
        ffn_hidden_size=spec.hidden,
        num_moe_experts=spec.experts,
        moe_router_topk=spec.topk,
        moe_token_dispatcher_type=ALLTOALL,
        expert_model_parallel_size=world,
        tensor_model_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=spec.torch_dtype(),
        moe_permute_fusion=False,
        moe_grouped_gemm=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        add_bias_linear=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    e_loc = spec.experts // world
    rank = dist.get_rank()
    dispatcher = MoEAlltoAllTokenDispatcher(
        e_loc, list(range(rank * e_loc, (rank + 1) * e_loc)), config=config, pg_collection=pgs
    )

    def run(hidden, probs, routing, ph: _Phases) -> torch.Tensor:
        x, p = dispatcher.dispatch_preprocess(hidden, routing, probs)
        ph.mark("counts")  # preprocess: count all-gather, host sync, permutation 1
        x, p = dispatcher.token_dispatch(x, p)
        x, tokens_per_expert, p = dispatcher.dispatch_postprocess(x, p)
        ph.mark("dispatch")
        y = x * p.unsqueeze(1).to(x.dtype)
        ph.mark("experts")
        y = dispatcher.combine_preprocess(y)
        y = dispatcher.token_combine(y)
        result = dispatcher.combine_postprocess(y)
        ph.mark("combine")
        return result

    return run


def _run_once(fn: Variant, inputs, backward: bool) -> tuple[torch.Tensor, dict[str, float]]:
    hidden, probs, routing, grad = inputs
    if backward:
        hidden = hidden.detach().requires_grad_(True)
        probs = probs.detach().requires_grad_(True)
    ph = _Phases()
    out = fn(hidden, probs, routing, ph)
    if backward:
        (out * grad).sum().backward()
        ph.mark("backward")
    return out, ph.ms


def bench_worker(
    rank: int, world: int, spec: BenchSpec, routing_maps: list[np.ndarray]
) -> dict[str, Any]:
    """One rank of the benchmark (inside a gloo process group of W ranks).

    Args:
        routing_maps: W arrays [T, E] bool (global; this rank uses its own). numpy, not tensors:
            spawned processes receive them pickled.

    Returns:
        ``times_ms`` {variant: [samples] float}, ``phases_ms`` {variant: {phase: [samples]}},
        ``max_abs_err`` {variant: float}, ``profile`` (rank 0 text or None), ``order`` [variants].
    """
    # Deprecation notices from Megatron and torch.distributed would repeat once per rank.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    topo = spec.topology()
    groups = build_rail_groups(None, topo)
    exchange = TorchDistExchange(topo, groups, num_experts=spec.experts, options=PlanOptions())
    variants: dict[str, Variant] = {p: _railwave_variant(exchange, p) for p in spec.paths}
    if spec.alltoall:
        variants[ALLTOALL] = _alltoall_variant(spec, world)
    names = list(variants)
    inputs = make_rank_inputs(spec, rank, [torch.from_numpy(m) for m in routing_maps])
    hidden, probs = inputs[0], inputs[1]
    expected = hidden.float() * probs.sum(dim=1, keepdim=True)

    errors = {}
    for _ in range(spec.warmups):
        for name in names:
            dist.barrier()
            out, _ = _run_once(variants[name], inputs, spec.backward)
            errors[name] = (
                float((out.detach().float() - expected).abs().max()) if out.numel() else 0.0
            )

    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    profiler = cProfile.Profile() if rank == 0 and spec.profile_variant in names else None
    for i in range(spec.samples):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            prof = profiler if name == spec.profile_variant else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            _, ms = _run_once(variants[name], inputs, spec.backward)
            if prof is not None:
                prof.disable()
            times[name].append((time.perf_counter() - t0) * 1e3)
            for key, value in ms.items():
                phases[name].setdefault(key, []).append(value)
    dist.barrier()
    profile_text = None
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(spec.profile_top)
        buf.write("\n--- by own time ---\n")
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(spec.profile_top)
        profile_text = buf.getvalue()
    if spec.alltoall:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return {
        "times_ms": times,
        "phases_ms": phases,
        "max_abs_err": errors,
        "profile": profile_text,
        "order": names,
    }
