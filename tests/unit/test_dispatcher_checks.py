"""Dispatcher checks without a process group. CUDA-graph settings that capture the MoE preprocess
are refused at construction. The per-device caches are built outside inference mode: a first call
under ``torch.inference_mode()`` (an eval or an RL rollout before training) with a launcher order
that is not node by node used to cache the expert-column index as an inference tensor, and every
later training forward then failed ("Inference tensors cannot be saved for backward")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims  # noqa: E402

apply_megatron_cpu_shims()  # CPU torch: Megatron's MoE package imports Triton kernels
pytest.importorskip("megatron.core")

from megatron_railwave.dispatcher import RailWaveTokenDispatcher, check_supported  # noqa: E402
from megatron_railwave.exchange.placement import RankFacts, place_ranks  # noqa: E402


def _cyclic_dispatcher_state() -> SimpleNamespace:
    # SLURM cyclic order over 2 hosts x 2 GPUs: not the identity, so _to_railwave permutes columns.
    layout = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    facts = [
        RankFacts(
            ep_rank=e,
            global_rank=e,
            host=h,
            host_id=hash(h) % 2**62,
            local_rank=g,
            gpu=g,
            fingerprint=(),
        )
        for e, (h, g) in enumerate(layout)
    ]
    placement = place_ranks(facts, gpus_per_node=2)
    assert not placement.identity
    return SimpleNamespace(placement=placement, num_experts=8, num_local_experts=2, _columns={})


def test_training_forward_after_a_first_call_in_inference_mode():
    state = _cyclic_dispatcher_state()
    routing = torch.zeros(3, 8, dtype=torch.bool)
    routing[:, 4] = True
    with torch.inference_mode():
        RailWaveTokenDispatcher._to_railwave(state, routing, torch.rand(3, 8))
    assert not state._columns[routing.device].is_inference()
    probs = torch.rand(3, 8, requires_grad=True)
    rm, p = RailWaveTokenDispatcher._to_railwave(state, routing, probs)
    # the old cache: RuntimeError, inference tensors cannot be saved for backward
    p.sum().backward()
    assert torch.equal(probs.grad, torch.ones(3, 8))
    assert rm[:, 2].all()  # Megatron's expert 4 (EP rank 2) is railwave column 2 (railwave rank 1)


def _config(**kw):
    base = dict(
        expert_tensor_parallel_size=1,
        moe_expert_capacity_factor=None,
        fp8=None,
        cuda_graph_impl="none",
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            cuda_graph_impl="transformer_engine",
            cuda_graph_modules=["moe_router", "moe_preprocess"],
        ),
        dict(cuda_graph_impl="local", cuda_graph_modules=["moe"]),
        dict(cuda_graph_impl="local", cuda_graph_modules=[]),  # the whole layer
        dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]),
        dict(
            cuda_graph_impl="none", enable_cuda_graph=True, cuda_graph_modules="full"
        ),  # deprecated flag
    ],
)
def test_cuda_graphs_that_capture_the_moe_preprocess_are_refused_at_construction(kw):
    # On replay Megatron skips MoELayer.preprocess, so the dispatcher's per-call state would be
    # missing.
    with pytest.raises(
        ValueError, match="cuda_graph_impl=.*graph replay skips MoELayer.preprocess"
    ):
        check_supported(_config(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"]),
        dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe_router"]),
    ],
)
def test_cuda_graphs_that_leave_the_moe_preprocess_eager_are_accepted(kw):
    check_supported(_config(**kw))
