"""Train a tiny Megatron-Core GPTModel with a shared expert on CPU gloo ranks (EP = world).

Shape: 3 layers (first dense, two MoE), hidden 64, 8 routed experts top-2 with a sigmoid router
and expert bias, one shared expert, SwiGLU; TP = PP = 1, every rank one DP and one EP rank.

Two loops, both with Megatron's own modules and one ``torch.optim.Adam``:

* ``train_hand_loop``: the plain training step (one micro-batch per step); dense grads all-reduced
  over the DP group, expert grads over the expert-DP group, both divided by the world size, then
  Megatron's router expert-bias update (as ``examples/train_glm_tiny.py``).
* ``train_ep_overlap``: Megatron's schedule (``get_forward_backward_func``) with
  ``overlap_moe_expert_parallel_comm=True``: the combined 1F1B schedule that interleaves one
  micro-batch's forward with another's backward, layer by layer (bf16, as Megatron requires).

Every run of a process builds the model from the same seed, so the dispatchers are compared on
the same weights and batches. Results are numpy (losses per step, flat grads per step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["gpt_runs_worker"]

VOCAB, SEQ, MICRO_BATCH, HIDDEN, EXPERTS, TOPK = 128, 16, 2, 64, 8, 2


def _config(
    world: int,
    dispatcher: str,
    *,
    shared_overlap: bool,
    ep_overlap: bool = False,
    recompute: bool = False,
):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if ep_overlap else torch.float32
    return TransformerConfig(
        num_layers=3,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_overlap=shared_overlap,
        moe_layer_freq=[0, 1, 1],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        overlap_moe_expert_parallel_comm=ep_overlap,
        bf16=ep_overlap,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Selective recompute of the MoE layers: their forward (dispatch, shared expert, combine)
        # runs again inside backward.
        **(dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}),
    )


def _model(config, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(seed)
    mcore_random.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        rotary_percent=0.5,
        share_embeddings_and_output_weights=False,
    )
    with (
        torch.no_grad()
    ):  # CPU init draws the same numbers on every rank: one draw per global expert
        for name, module in model.named_modules():
            if isinstance(module, SequentialMLP):
                layer = int(name.split("layers.")[1].split(".")[0])
                offset = module.ep_group.rank() * module.num_local_experts
                for i, expert in enumerate(module.local_experts):
                    gen = torch.Generator().manual_seed(seed * 100_003 + layer * 1009 + offset + i)
                    expert.linear_fc1.weight.copy_(
                        torch.randn(expert.linear_fc1.weight.shape, generator=gen) * 0.05
                    )
                    expert.linear_fc2.weight.copy_(
                        torch.randn(expert.linear_fc2.weight.shape, generator=gen) * 0.05
                    )
    return model


def _batch(rank: int, step: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 7919 + rank * 104_729 + step)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=gen)
    stride = torch.randint(1, 8, (MICRO_BATCH, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ),
        "attention_mask": mask.expand(MICRO_BATCH, 1, SEQ, SEQ),
    }


def _reduce_grads(params: list[torch.nn.Parameter], group, world: int) -> None:
    import torch.distributed as dist

    if not params:
        return
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in params
        ]
    )
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
        offset += p.numel()


def _flat_grads(model) -> np.ndarray:
    return (
        torch.cat([p.grad.reshape(-1).float() for _, p in sorted(model.named_parameters())])
        .numpy()
        .copy()
    )


def _after_step(model, world: int) -> None:
    from megatron.core import parallel_state

    dense = [p for p in model.parameters() if getattr(p, "allreduce", True)]
    expert = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
    _reduce_grads(dense, parallel_state.get_data_parallel_group(), world)
    _reduce_grads(expert, parallel_state.get_expert_data_parallel_group(), world)


def _finish_step(model, config, optimizer) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    optimizer.step()
    _update_router_expert_bias(
        [model],
        config,
        tp_dp_cp_group=parallel_state.get_tensor_and_data_parallel_group(
            with_context_parallel=True
        ),
    )
    reset_model_temporary_tensors(config, [model])


def _broadcast_dense(model) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "allreduce", True):
                dist.broadcast(p, src=0)


def train_hand_loop(
    rank: int,
    world: int,
    dispatcher: str,
    *,
    shared_overlap: bool,
    steps: int,
    seed: int,
    recompute: bool = False,
) -> dict[str, Any]:
    """``steps`` optimizer steps of one micro-batch each, then one forward-only pass (eval mode,
    no grad). Returns per-step mean loss over ranks, this rank's reduced grads per step (flat, name
    order) and the forward-only pass's mean loss (``eval_loss``)."""
    import torch.distributed as dist

    config = _config(world, dispatcher, shared_overlap=shared_overlap, recompute=recompute)
    model = _model(config, seed)
    _broadcast_dense(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses, grads = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**_batch(rank, step, seed)).mean()
        loss.backward()
        _after_step(model, world)
        grads.append(_flat_grads(model))
        _finish_step(model, config, optimizer)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    model.eval()
    with torch.no_grad():
        eval_loss = model(**_batch(rank, steps, seed)).mean()
    dist.all_reduce(eval_loss)
    return {
        "losses": np.array(losses),
        "grads": np.stack(grads),
        "eval_loss": eval_loss.item() / world,
    }


class _CpuTorch:
    """``torch`` for Megatron's schedules module on a CPU-only torch: its ``torch.zeros(...,
    device="cuda")`` token counter lands on the CPU (test-only stand-in; nothing else changes)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _shim_schedules_for_cpu() -> None:
    """Test-only CPU stand-ins for the EP-overlap schedule: the token counter above, and
    ``Tensor.record_stream`` (called on every node input with the stand-in stream of
    ``megatron_cpu``) a no-op on CPU tensors, where no caching allocator tracks streams."""
    from megatron.core.pipeline_parallel import schedules

    if torch.cuda.is_available() or isinstance(schedules.torch, _CpuTorch):
        return
    schedules.torch = _CpuTorch()
    original = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.is_cuda:
            original(self, stream)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]


def train_ep_overlap(
    rank: int,
    world: int,
    dispatcher: str,
    *,
    ep_overlap: bool,
    steps: int,
    microbatches: int,
    seed: int,
) -> dict[str, Any]:
    """``steps`` optimizer steps of ``microbatches`` micro-batches through Megatron's
    ``get_forward_backward_func`` (bf16 model), with or without
    ``overlap_moe_expert_parallel_comm``."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _shim_schedules_for_cpu()
    config = _config(world, dispatcher, shared_overlap=False, ep_overlap=True)
    if not ep_overlap:
        config.overlap_moe_expert_parallel_comm = False
    model = _model(config, seed)
    _broadcast_dense(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-4)
    model.train()
    forward_backward = get_forward_backward_func()
    losses, grads = [], []

    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batches = iter([_batch(rank, step * microbatches + m, seed) for m in range(microbatches)])

        def forward_step(data_iterator, model, return_schedule_plan: bool = False):
            batch = next(data_iterator)
            # The combined 1F1B schedule asks for the model's schedule plan instead of its output.
            output = model.build_schedule_plan(**batch) if return_schedule_plan else model(**batch)

            def loss_func(output_tensor):
                loss = output_tensor.float().mean()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        _after_step(model, world)
        grads.append(_flat_grads(model))
        _finish_step(model, config, optimizer)
        total = torch.stack([d["loss"].float() for d in out]).mean()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": np.array(losses), "grads": np.stack(grads)}


def gpt_runs_worker(rank: int, world: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run each of ``runs`` in this process (``{"name", "loop": "hand" | "ep_overlap",
    "dispatcher", "railwave": {...} | None, **loop kwargs}``); returns {name: result}."""
    from megatron_railwave.testing.megatron_cpu import (
        apply_megatron_cpu_shims,
        seed_megatron_cpu_rng,
    )

    apply_megatron_cpu_shims()
    torch.set_num_threads(1)
    torch._dynamo.config.disable = (
        True  # Megatron's torch.compile'd helpers: ~20 s of C++ per process
    )
    from megatron.core import parallel_state

    import megatron_railwave

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    seed_megatron_cpu_rng(1234)
    out: dict[str, Any] = {}
    try:
        for run in runs:
            run = dict(run)
            name, loop, railwave = run.pop("name"), run.pop("loop"), run.pop("railwave", None)
            if railwave is not None:
                megatron_railwave.install(railwave)
            fn = train_hand_loop if loop == "hand" else train_ep_overlap
            out[name] = fn(rank, world, **run)
    finally:
        parallel_state.destroy_model_parallel()
    return out
