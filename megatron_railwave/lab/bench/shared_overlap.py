"""``railwave bench-exchange --shared-expert``: how much of the shared expert's compute hides
behind the exchange, RailWave's paths next to Megatron's ``alltoall``, on CPU gloo.

Letters: W ranks, T tokens per rank, H hidden, F the shared expert's FFN size, E experts.

Every variant is a Megatron token dispatcher driven through its six hooks with identity experts
(``y = tokens * probs``), in two forms, plus the shared expert alone:

* ``exchange``: the dispatcher without a shared expert;
* ``overlapped``: the dispatcher with ``moe_shared_expert_overlap`` and a Megatron
  ``SharedExpertMLP`` (fc1 [H, 2F] SwiGLU, fc2 [F, H]) handed over by ``set_shared_experts``, as
  MoELayer does: RailWave runs fc1 while the dispatch phases travel and fc2 while the combine's
  do (``exchange.pending``); ``alltoall`` runs them where Megatron puts them (after its
  all-to-all calls, which on gloo return only when complete);
* ``shared``: the shared expert's forward alone, on the same [T, 1, H] input.

Hidden share of a variant = (median exchange + median shared - median overlapped) / median
shared: 1 = the shared expert was free, 0 = it added its whole time, < 0 = worse than serial.
Times are forward passes with autograd recording (no backward); each call starts after a
barrier; per sample the slowest rank's time; variants round-robin per sample. The overlapped
output is checked against exchange + shared (``max_abs_err``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_railwave.lab.bench.exchange_bench import ALLTOALL, BenchSpec, make_rank_inputs
from megatron_railwave.lab.bench.launch import run_gloo_processes
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

__all__ = ["SharedOverlapSpec", "shared_overlap_worker", "run_shared_overlap", "SHARED_SCHEMA"]

SHARED_SCHEMA = "railwave.bench_shared_overlap/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedOverlapSpec:
    """The exchange benchmark's sizes plus the shared expert's FFN size F."""

    bench: BenchSpec
    shared_ffn: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.bench.to_dict(), "shared_ffn": self.shared_ffn}


def _config(spec: BenchSpec, world: int, dispatcher: str, *, shared_ffn: int | None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
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
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=shared_ffn,
        moe_shared_expert_overlap=shared_ffn is not None,
    )
    cfg.moe_token_dispatcher_type = (
        dispatcher  # after Megatron's checks, which ran as for 'alltoall'
    )
    return cfg


def _dispatcher(spec: BenchSpec, world: int, name: str, pgs: Any, *, shared_ffn: int | None):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_railwave.config import RailWaveConfig
    from megatron_railwave.dispatcher import RailWaveTokenDispatcher

    e_loc, rank = spec.experts // world, dist.get_rank()
    local = list(range(rank * e_loc, (rank + 1) * e_loc))
    if name == ALLTOALL:
        return MoEAlltoAllTokenDispatcher(
            e_loc,
            local,
            config=_config(spec, world, ALLTOALL, shared_ffn=shared_ffn),
            pg_collection=pgs,
        )
    cfg = _config(spec, world, "railwave", shared_ffn=shared_ffn)
    return RailWaveTokenDispatcher(
        e_loc,
        local,
        cfg,
        pgs,
        railwave=RailWaveConfig(
            gpus_per_node=spec.gpus_per_node,
            path=name,
            failed_rails=[list(f) for f in spec.failed_rails],
        ),
    )


def _hooks(
    dispatcher: Any, hidden_SBH: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor
) -> torch.Tensor:
    x, p = dispatcher.dispatch_preprocess(hidden_SBH, routing, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, _, p = dispatcher.dispatch_postprocess(x, p)
    y = dispatcher.combine_preprocess(x * p.unsqueeze(1).to(x.dtype))
    return dispatcher.combine_postprocess(dispatcher.token_combine(y))


def shared_overlap_worker(
    rank: int, world: int, spec: SharedOverlapSpec, routing_maps: list[np.ndarray]
) -> dict[str, Any]:
    """One rank: returns ``times_ms`` {slot: [samples]} (slots '<variant>/exchange',
    '<variant>/overlapped', 'shared'), ``max_abs_err`` {variant: float} and ``order``."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    apply_megatron_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    bench = spec.bench
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(bench.seed)
        shared = SharedExpertMLP(
            _config(bench, world, ALLTOALL, shared_ffn=spec.shared_ffn),
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            gate=False,
            pg_collection=pgs,
        )
        variants = list(bench.paths) + ([ALLTOALL] if bench.alltoall else [])
        plain = {v: _dispatcher(bench, world, v, pgs, shared_ffn=None) for v in variants}
        overlapped = {
            v: _dispatcher(bench, world, v, pgs, shared_ffn=spec.shared_ffn) for v in variants
        }
        for d in overlapped.values():
            d.set_shared_experts(shared)
        hidden, probs, routing, _ = make_rank_inputs(
            bench, rank, [torch.from_numpy(m) for m in routing_maps]
        )
        hidden_SBH = hidden.unsqueeze(1)

        slots: dict[str, Any] = {"shared": lambda: shared(hidden_SBH)}
        for v in variants:
            slots[f"{v}/exchange"] = lambda d=plain[v]: _hooks(d, hidden_SBH, probs, routing)
            slots[f"{v}/overlapped"] = lambda d=overlapped[v]: _hooks(d, hidden_SBH, probs, routing)
        names = list(slots)
        errors = {}
        for _ in range(max(bench.warmups, 1)):
            outs = {}
            for name in names:
                dist.barrier()
                outs[name] = slots[name]().detach()
            for v in variants:
                want = outs[f"{v}/exchange"] + outs["shared"]
                errors[v] = (
                    float((outs[f"{v}/overlapped"] - want).abs().max()) if want.numel() else 0.0
                )
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(bench.samples):
            for k in range(len(names)):
                name = names[(i + k) % len(names)]
                dist.barrier()
                t0 = time.perf_counter()
                slots[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
    return {"times_ms": times, "max_abs_err": errors, "order": names, "variants": variants}


def run_shared_overlap(
    spec: SharedOverlapSpec, *, timeout_s: float = 900.0, alltoall_skipped: str | None = None
) -> dict[str, Any]:
    """Run the ranks and reduce (see the module docstring). Returns the JSON-ready result:
    ``schema``, ``config``, ``shared_ms``, ``variants`` {name: exchange_ms, overlapped_ms,
    hidden_ms, hidden_share, max_abs_err}, ``alltoall_skipped``."""
    bench = spec.bench
    topo = bench.topology()
    world = topo.world_size
    if bench.experts % world:
        raise ValueError(f"--experts {bench.experts} must be a multiple of the world size {world}")
    if spec.shared_ffn < 1:
        raise ValueError(f"--shared-ffn must be >= 1, got {spec.shared_ffn}")
    maps = synthetic_routing_maps(
        topo, num_tokens=bench.tokens, num_experts=bench.experts, topk=bench.topk, seed=bench.seed
    )
    ranks = run_gloo_processes(
        shared_overlap_worker, world, spec, [m.numpy() for m in maps], timeout_s=timeout_s
    )

    def median(slot: str) -> float:  # per sample the slowest rank, then the median over samples
        return float(np.median(np.max([r["times_ms"][slot] for r in ranks], axis=0)))

    shared_ms = median("shared")
    variants = {}
    for v in ranks[0]["variants"]:
        ex, ov = median(f"{v}/exchange"), median(f"{v}/overlapped")
        hidden_ms = ex + shared_ms - ov
        variants[v] = {
            "exchange_ms": ex,
            "overlapped_ms": ov,
            "hidden_ms": hidden_ms,
            "hidden_share": hidden_ms / shared_ms if shared_ms > 0 else None,
            "max_abs_err": max(r["max_abs_err"][v] for r in ranks),
        }
    return {
        "schema": SHARED_SCHEMA,
        "config": spec.to_dict(),
        "world_size": world,
        "shared_ms": shared_ms,
        "variants": variants,
        "alltoall_skipped": alltoall_skipped if not bench.alltoall else None,
        "measured": "CPU gloo over loopback on this machine; forward only; medians of the slowest "
        "rank",
    }
