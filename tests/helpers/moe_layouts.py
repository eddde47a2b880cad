"""A real Megatron-Core MoELayer under folded parallel layouts (TP + SP, CP, PP) and passes
(recompute, forward-only, variable tokens per micro-batch), on 8 CPU ranks over gloo.

Letters: S sequence (this rank's chunk), B micro-batch, H hidden, E experts, L local experts.

Every layout keeps expert-TP 1, so attention TP / CP / PP are folded out of the expert grid and
each EP group is a contiguous block of 4 global ranks. Weights are the canonical ones of
``moe_layer.canonical_weights`` (per global expert), so every EP group, every dispatcher and every
path see the same model; each rank feeds its own tokens (its sequence-parallel / context-parallel
chunk).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_railwave.names import ROUTES
from tests.helpers.moe_layer import build_from_spec, load_canonical_weights, rank_inputs

__all__ = ["run_layouts_worker"]

PATHS = tuple(map(str, ROUTES))
EXPERTS, TOPK, HIDDEN, FFN = 8, 3, 16, 8


def _config(dispatcher: str, parallel: dict[str, int], **extra: Any):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=parallel.get("pp", 1),
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=parallel.get("tp", 1),
        sequence_parallel=parallel.get("tp", 1) > 1,
        context_parallel_size=parallel.get("cp", 1),
        pipeline_model_parallel_size=parallel.get("pp", 1),
        pipeline_dtype=torch.float32,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )
    kwargs.update(extra)
    config = TransformerConfig(**kwargs)
    config.moe_token_dispatcher_type = (
        dispatcher  # after Megatron's checks, as the CLI path leaves it
    )
    return config


def _build(dispatcher: str, parallel: dict[str, int], **extra: Any):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = _config(dispatcher, parallel, **extra)
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = build_from_spec(
        spec,
        config=config,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    layer.set_layer_number(1)
    load_canonical_weights(layer, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN, seed=11)
    return layer


def _step(
    layer: Any, x: torch.Tensor, grad_weight: torch.Tensor, *, full_recompute: bool = False
) -> dict:
    """One forward + backward; returns output and every gradient (numpy)."""
    from megatron.core import tensor_parallel

    x = x.clone().requires_grad_(True)
    if full_recompute:  # what TransformerBlock's full recompute does around a whole layer
        output, _ = tensor_parallel.checkpoint(layer, False, x)
    else:
        output, _ = layer(x)
    (output * grad_weight).sum().backward()
    experts = layer.experts.local_experts
    out = {
        "output": output.detach().numpy().copy(),
        "input_grad": x.grad.numpy().copy(),
        "fc1_grad": np.stack([e.linear_fc1.weight.grad.numpy() for e in experts]),
        "fc2_grad": np.stack([e.linear_fc2.weight.grad.numpy() for e in experts]),
        "router_grad": layer.router.weight.grad.numpy().copy(),
    }
    layer.zero_grad(set_to_none=True)
    return out


def _layout(rank: int, parallel: dict[str, int]) -> dict[str, Any]:
    """alltoall, then railwave on each path, under one folded layout."""
    from megatron.core import parallel_state

    import megatron_railwave

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.get("tp", 1),
        pipeline_model_parallel_size=parallel.get("pp", 1),
        context_parallel_size=parallel.get("cp", 1),
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    try:
        ep_ranks = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_model_parallel_group()
        )
        x, g = rank_inputs(rank, seq_len=4, micro_batch=2, hidden=HIDDEN, seed=11)
        res: dict[str, Any] = {"ep_group": list(ep_ranks)}
        layer = _build("alltoall", parallel)
        layer.train()
        res["alltoall"] = _step(layer, x, g)
        for path in PATHS:
            megatron_railwave.install({"gpus_per_node": 2, "path": path, "metrics": False})
            layer = _build("railwave", parallel)
            layer.train()
            res[path] = _step(layer, x, g)
        return res
    finally:
        parallel_state.destroy_model_parallel()


def _passes(rank: int) -> dict[str, Any]:
    """Recompute (selective and full), forward-only and variable tokens, EP 4 x DP 2.

    Sigmoid router with expert bias (GLM-4.5-Air style); EP rank 3's experts get a bias of -1e4,
    so no token selects them and EP rank 3 receives nothing.
    """
    from megatron.core import parallel_state

    import megatron_railwave
    from megatron_railwave.exchange import TorchDistExchange
    from megatron_railwave.steps import pass_kind, set_step

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=4
    )
    plans: list[dict[str, Any]] = []
    original_plan = TorchDistExchange.plan

    def spy(self, demand, path, *, phase=0):
        plan = original_plan(self, demand, path, phase=phase)
        plans.append(
            {
                "kind": str(pass_kind(True)),
                "phase": phase,
                "path": str(plan.path),
                "rail_load": plan.rail_load_NRN().tolist(),
                "relay": plan.relayed_records(),
                "own_experts": demand.demand.view_experts_X.tolist(),
            }
        )
        return plan

    TorchDistExchange.plan = spy
    extra = dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
    )
    try:
        seqs = [(5, 1), (2, 3)]  # (S, B) of micro-batch 0 and 1: 5 and 6 tokens
        inputs = [
            rank_inputs(rank, seq_len=s, micro_batch=b, hidden=HIDDEN, seed=20 + i)
            for i, (s, b) in enumerate(seqs)
        ]
        res: dict[str, Any] = {}
        for mode, recompute in (
            ("selective", dict(recompute_granularity="selective", recompute_modules=["moe"])),
            ("full", {}),
        ):
            for dispatcher in ("alltoall", "railwave"):
                stats: list[Any] = []
                if dispatcher == "railwave":
                    megatron_railwave.install(
                        {"gpus_per_node": 2, "path": "joint", "metrics": False},
                        stats_sink=stats.append,
                    )
                layer = _build(dispatcher, {}, **extra, **recompute)
                with torch.no_grad():
                    layer.router.expert_bias.zero_()
                    layer.router.expert_bias[6:] = -1e4  # EP rank 3's experts: never selected
                layer.train()
                plans.clear()
                set_step(10)
                steps = [_step(layer, x, g, full_recompute=mode == "full") for x, g in inputs]
                layer.eval()
                set_step(11)
                with torch.no_grad():
                    fwd_only, _ = layer(inputs[0][0])
                layer.train()
                after = _step(layer, *inputs[1], full_recompute=mode == "full")
                set_step(None)
                res[f"{mode}/{dispatcher}"] = {
                    "steps": steps,
                    "forward_only": fwd_only.numpy().copy(),
                    "after": after,
                    "plans": list(plans) if dispatcher == "railwave" else [],
                    "stats": [
                        (s.step, s.microbatch, s.pass_kind, s.tokens_per_expert_max) for s in stats
                    ],
                }
        return res
    finally:
        TorchDistExchange.plan = original_plan
        parallel_state.destroy_model_parallel()


def run_layouts_worker(rank: int, world: int) -> dict[str, Any]:
    """Every layout and pass case on this rank (8 ranks)."""
    from megatron_railwave.testing.megatron_cpu import (
        apply_megatron_cpu_shims,
        seed_megatron_cpu_rng,
    )

    assert world == 8
    apply_megatron_cpu_shims()
    torch._dynamo.config.disable = True  # megatron.core.jit would compile C++ for ~20 s per process
    from megatron.core import parallel_state

    out: dict[str, Any] = {}
    for name, parallel in (("tp2-sp", {"tp": 2}), ("cp2", {"cp": 2}), ("pp2", {"pp": 2})):
        out[name] = _layout(rank, parallel)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=4)
    seed_megatron_cpu_rng(3)  # the checkpoint saves and restores Megatron's (CPU) RNG states
    parallel_state.destroy_model_parallel()
    out["passes"] = _passes(rank)
    return out
