"""Build and run a real Megatron-Core MoELayer on CPU ranks, plus a dense single-process oracle.

Shape letters: S sequence length, B micro-batch size, H hidden size, F expert FFN size,
E experts (global), L local experts (E / EP), K top-k, T = S * B tokens on one rank,
W world size (= EP size; TP = 1).

The expert math is Megatron's SequentialMLP with SwiGLU and no biases:
``y = fc2(silu(x @ fc1_gate^T) * (x @ fc1_up^T) * p)`` for each routed (token, expert) pair,
summed over the token's K experts. ``fc1`` is ``[2F, H]`` (gate rows first, then up rows),
``fc2`` is ``[H, F]``, and the router weight is ``[E, H]``.

Weights come from one ``torch.Generator`` seeded with ``seed`` and are drawn for all E experts
in a fixed order, so every rank, every dispatcher type and the dense oracle see the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "build_and_run_moe_layer",
    "build_from_spec",
    "canonical_moe_layer",
    "canonical_weights",
    "dense_moe_reference",
    "load_canonical_weights",
    "rank_inputs",
]

# Config keys the dense oracle models; anything else in extra_config is Megatron-only.
_ORACLE_KEYS = frozenset({"moe_router_score_function", "moe_router_pre_softmax"})


def build_from_spec(spec: Any, **kwargs: Any) -> Any:
    """Build a module from what ``get_moe_module_spec`` returns: a ``ModuleSpec`` (Megatron-Core
    0.15) or a ``functools.partial`` builder (0.19)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    return build_module(spec, **kwargs) if isinstance(spec, ModuleSpec) else spec(**kwargs)


def canonical_weights(
    *, num_experts: int, hidden: int, ffn_hidden: int, seed: int
) -> dict[str, torch.Tensor]:
    """Global MoE weights, identical for every rank and dispatcher.

    Returns:
        ``router`` [E, H], ``fc1`` [E, 2F, H], ``fc2`` [E, H, F]; fp32, CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=gen) / hidden**0.5
    fc1 = torch.randn(num_experts, 2 * ffn_hidden, hidden, generator=gen) / hidden**0.5
    fc2 = torch.randn(num_experts, hidden, ffn_hidden, generator=gen) / ffn_hidden**0.5
    return {"router": router, "fc1": fc1, "fc2": fc2}


def load_canonical_weights(
    layer: Any, *, num_experts: int, hidden: int, ffn_hidden: int, seed: int
) -> None:
    """Copy ``canonical_weights`` into a MoELayer (router, and this rank's local experts)."""
    weights = canonical_weights(
        num_experts=num_experts, hidden=hidden, ffn_hidden=ffn_hidden, seed=seed
    )
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for local_idx, global_idx in enumerate(layer.local_expert_indices):
            expert = layer.experts.local_experts[local_idx]
            expert.linear_fc1.weight.copy_(weights["fc1"][global_idx])
            expert.linear_fc2.weight.copy_(weights["fc2"][global_idx])


def rank_inputs(
    rank: int, *, seq_len: int, micro_batch: int, hidden: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-rank layer input and loss weights.

    Returns:
        ``x`` [S, B, H] and ``grad_weight`` [S, B, H] (the loss is ``sum(output * grad_weight)``,
        so ``grad_weight`` is the upstream gradient of the output); fp32, CPU.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (rank + 1))
    x = torch.randn(seq_len, micro_batch, hidden, generator=gen)
    grad_weight = torch.randn(seq_len, micro_batch, hidden, generator=gen)
    return x, grad_weight


def _moe_config(
    world_size: int,
    dispatcher_type: str,
    *,
    num_experts: int,
    topk: int,
    hidden: int,
    ffn_hidden: int,
    extra_config: dict[str, Any] | None,
):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn_hidden,
        moe_ffn_hidden_size=ffn_hidden,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher_type,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world_size,
        tensor_model_parallel_size=1,
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
    kwargs.update(extra_config or {})
    return TransformerConfig(**kwargs)


@contextlib.contextmanager
def canonical_moe_layer(
    world_size: int,
    dispatcher_type: str,
    *,
    num_experts: int,
    topk: int,
    hidden: int,
    ffn_hidden: int,
    seed: int,
    extra_config: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """A MoELayer (layer number 1, EP = ``world_size``, TP = 1) with ``canonical_weights`` of
    ``seed``, inside Megatron's model-parallel state (initialised here, destroyed on exit). The
    gloo process group must already be initialised and the Megatron CPU shims applied."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = _moe_config(
        world_size,
        dispatcher_type,
        num_experts=num_experts,
        topk=topk,
        hidden=hidden,
        ffn_hidden=ffn_hidden,
        extra_config=extra_config,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world_size
    )
    try:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
        layer = build_from_spec(spec, config=config, layer_number=1, pg_collection=pg_collection)
        layer.set_layer_number(1)
        load_canonical_weights(
            layer, num_experts=num_experts, hidden=hidden, ffn_hidden=ffn_hidden, seed=seed
        )
        yield layer
    finally:
        parallel_state.destroy_model_parallel()


def build_and_run_moe_layer(
    rank: int,
    world_size: int,
    dispatcher_type: str,
    *,
    num_experts: int,
    topk: int,
    hidden: int,
    ffn_hidden: int,
    seq_len: int,
    micro_batch: int,
    seed: int,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one MoELayer forward + backward on this rank (call inside ``run_distributed``).

    The process group must already be initialised (gloo). EP = ``world_size``, TP = 1.

    Args:
        rank, world_size: this rank and the EP size.
        dispatcher_type: ``config.moe_token_dispatcher_type`` (e.g. "alltoall", "allgather").
        num_experts, topk, hidden, ffn_hidden: E, K, H, F.
        seq_len, micro_batch: S, B of this rank's input.
        seed: weight and input seed (inputs also depend on ``rank``).
        extra_config: extra ``TransformerConfig`` fields, applied last.

    Returns:
        numpy fp32 arrays: ``output`` [S, B, H], ``input_grad`` [S, B, H],
        ``fc1_grad`` [L, 2F, H], ``fc2_grad`` [L, H, F], ``router_grad`` [E, H] (this rank's
        contribution only: no reduction over ranks), and ``local_expert_indices`` (list[int]).
    """
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    with canonical_moe_layer(
        world_size,
        dispatcher_type,
        num_experts=num_experts,
        topk=topk,
        hidden=hidden,
        ffn_hidden=ffn_hidden,
        seed=seed,
        extra_config=extra_config,
    ) as layer:
        x, grad_weight = rank_inputs(
            rank, seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, seed=seed
        )
        x.requires_grad_(True)
        layer.train()
        output, mlp_bias = layer(x)
        assert mlp_bias is None
        (output * grad_weight).sum().backward()

        experts = layer.experts.local_experts
        return {
            "output": output.detach().numpy().copy(),
            "input_grad": x.grad.numpy().copy(),
            "fc1_grad": np.stack([e.linear_fc1.weight.grad.numpy() for e in experts]),
            "fc2_grad": np.stack([e.linear_fc2.weight.grad.numpy() for e in experts]),
            "router_grad": layer.router.weight.grad.numpy().copy(),
            "local_expert_indices": list(layer.local_expert_indices),
        }


def dense_moe_reference(
    world_size: int,
    *,
    num_experts: int,
    topk: int,
    hidden: int,
    ffn_hidden: int,
    seq_len: int,
    micro_batch: int,
    seed: int,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The same MoE math as :func:`build_and_run_moe_layer`, all ranks in one process.

    Every token is sent through its K experts directly (no dispatcher, no communication).

    Args:
        world_size: number of ranks whose inputs are stacked (W).
        extra_config: only ``moe_router_score_function`` ("softmax" | "sigmoid") and
            ``moe_router_pre_softmax`` are modelled.

    Returns:
        numpy fp32 arrays: ``output`` [W, S, B, H], ``input_grad`` [W, S, B, H],
        ``fc1_grad`` [E, 2F, H], ``fc2_grad`` [E, H, F], ``router_grad`` [E, H] (summed over
        all ranks' tokens).

    Raises:
        ValueError: ``extra_config`` holds a key the oracle does not model.
    """
    extra = dict(extra_config or {})
    unknown = sorted(set(extra) - _ORACLE_KEYS)
    if unknown:
        raise ValueError(
            f"dense_moe_reference models only {sorted(_ORACLE_KEYS)} of extra_config, got "
            f"{unknown}; compare such configs between dispatchers instead"
        )
    score_function = extra.get("moe_router_score_function", "softmax")
    pre_softmax = bool(extra.get("moe_router_pre_softmax", False))

    weights = {
        name: tensor.requires_grad_(True)
        for name, tensor in canonical_weights(
            num_experts=num_experts, hidden=hidden, ffn_hidden=ffn_hidden, seed=seed
        ).items()
    }
    per_rank = [
        rank_inputs(r, seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, seed=seed)
        for r in range(world_size)
    ]
    x_WSBH = torch.stack([x for x, _ in per_rank]).requires_grad_(True)
    grad_weight_WSBH = torch.stack([g for _, g in per_rank])

    x_NH = x_WSBH.reshape(-1, hidden)
    logits_NE = x_NH @ weights["router"].t()
    if score_function == "softmax" and not pre_softmax:
        top_logits_NK, top_idx_NK = torch.topk(logits_NE, k=topk, dim=1)
        probs_NK = torch.softmax(top_logits_NK, dim=-1)
    elif score_function == "softmax":
        probs_NK, top_idx_NK = torch.topk(torch.softmax(logits_NE, dim=-1), k=topk, dim=1)
    elif score_function == "sigmoid":
        scores_NK, top_idx_NK = torch.topk(torch.sigmoid(logits_NE), k=topk, dim=1)
        probs_NK = scores_NK
        if topk > 1:
            probs_NK = scores_NK / (scores_NK.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"moe_router_score_function={score_function!r} is not modelled")

    out_NH = torch.zeros_like(x_NH)
    for expert in range(num_experts):
        token_idx, slot = (top_idx_NK == expert).nonzero(as_tuple=True)
        if token_idx.numel() == 0:
            continue
        gate_up = x_NH[token_idx] @ weights["fc1"][expert].t()
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up * probs_NK[token_idx, slot].unsqueeze(-1)
        out_NH = out_NH.index_add(0, token_idx, act @ weights["fc2"][expert].t())
    out_WSBH = out_NH.reshape(x_WSBH.shape)
    (out_WSBH * grad_weight_WSBH).sum().backward()
    return {
        "output": out_WSBH.detach().numpy(),
        "input_grad": x_WSBH.grad.numpy(),
        "fc1_grad": weights["fc1"].grad.numpy(),
        "fc2_grad": weights["fc2"].grad.numpy(),
        "router_grad": weights["router"].grad.numpy(),
    }
