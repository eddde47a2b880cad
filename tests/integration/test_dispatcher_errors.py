"""Bad input to RailWaveTokenDispatcher gives a clear error on every rank and never hangs.

One 4-rank gloo run (EP 4 = 2 nodes x 2 GPUs, 2 experts per rank) drives the dispatcher's six
hooks directly (Megatron's router cannot take an empty input, see REFERENCE.md section 3) and
records, per rank, what each case raised; the tests below check those records:

* malformed input on ONE rank (float routing map on rank 1, routing map [T, E + 1] on rank 2,
  probs [T, E - 1] on rank 3): every rank raises InputError naming that rank, right after the
  first collective (the count all-gather); afterwards a good call still works;
* a topology that does not match the EP size (gpus_per_node=3 with EP 4) and unsupported
  TransformerConfig options: ValueError at construction on every rank, before any collective;
* a rank with zero tokens (rank 1) and a rank that receives nothing (no token picks rank 3's
  experts): every path returns the right shapes and values (identity experts) and gradients;
* path 'auto' with a missing anchors file: one logger warning in the whole job (global rank 0),
  however many MoE layers are built.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # spawned ranks inherit sys.path and import tests.helpers
    sys.path.insert(0, str(_REPO_ROOT))

from megatron_railwave.config import RailWaveConfig  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed")

WORLD = 4
EXPERTS = 8  # 2 per rank; rank r owns experts 2r, 2r + 1
TOPK = 2
HIDDEN = 8
PATHS = ["native", "rail", "perm", "joint"]

# Options RailWave refuses, with a value that turns each on (each case also names the option).
UNSUPPORTED = {
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
    "moe_shared_expert_overlap": True,
    "overlap_moe_expert_parallel_comm": True,
    "fp8": "e4m3",
    "moe_latent_size": 16,
    "moe_router_padding_for_quantization": True,
}


# ---------------------------------------------------------------------- worker (spawned ranks)
def _inputs(rank: int, tokens: int, *, avoid_rank: int | None = None, seed: int = 0):
    """hidden [T, H], probs [T, E] (zero off the map), routing map [T, E] bool of one rank."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    if avoid_rank is not None:  # nobody routes to this rank's experts: it receives nothing
        per = EXPERTS // WORLD
        scores[:, avoid_rank * per:(avoid_rank + 1) * per] = -1.0
    routing = torch.zeros(tokens, EXPERTS, dtype=torch.bool)
    routing.scatter_(1, scores.topk(TOPK, dim=1).indices, True)
    probs = torch.rand(tokens, EXPERTS, generator=gen) * routing
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    return hidden, probs, routing


def _run_hooks(dispatcher: Any, hidden, probs, routing):
    """The six hooks with identity experts (y = x * prob). Returns (out [S, 1, H], tokens_per_expert)."""
    x, p = dispatcher.dispatch_preprocess(hidden.unsqueeze(1), routing, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, tokens_per_expert, p = dispatcher.dispatch_postprocess(x, p)
    y = dispatcher.combine_preprocess(x * p.unsqueeze(1))
    return dispatcher.combine_postprocess(dispatcher.token_combine(y)), tokens_per_expert


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test checks type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dispatcher_errors_worker(rank: int, world: int) -> dict[str, Any]:
    from megatron_railwave.bench.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_railwave.dispatcher import RailWaveTokenDispatcher

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    per = EXPERTS // world
    local = list(range(rank * per, (rank + 1) * per))

    def config(**changes: Any) -> TransformerConfig:
        cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=HIDDEN,
                                num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                                moe_token_dispatcher_type="alltoall",
                                expert_model_parallel_size=world, use_cpu_initialization=True,
                                add_bias_linear=False, moe_grouped_gemm=False, bias_activation_fusion=False,
                                gradient_accumulation_fusion=False)
        cfg.moe_token_dispatcher_type = "railwave"
        for key, value in changes.items():  # set after __post_init__: Megatron's own checks aside
            setattr(cfg, key, value)
        return cfg

    def make(path: str = "native", **changes: Any) -> RailWaveTokenDispatcher:
        return RailWaveTokenDispatcher(per, local, config(**changes), pgs,
                                       railwave=RailWaveConfig(gpus_per_node=2, path=path))

    out: dict[str, Any] = {}
    # Construction errors: raised locally, before any collective, so no rank can hang.
    out["topology"] = _error_text(lambda: RailWaveTokenDispatcher(
        per, local, config(), pgs, railwave=RailWaveConfig(gpus_per_node=3, path="native")))
    out["unsupported"] = {key: _error_text(lambda k=key, v=value: make(**{k: v}))
                          for key, value in UNSUPPORTED.items()}
    out["tensor_parallel"] = _error_text(lambda: make(tensor_model_parallel_size=2))

    # path 'auto' without its anchors file: three MoE layers, one warning on global rank 0 only.
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("megatron_railwave").addHandler(handler)
    missing = RailWaveConfig(gpus_per_node=2, path="auto", anchors="/nonexistent/anchors.yaml")
    for _ in range(3):
        RailWaveTokenDispatcher(per, local, config(), pgs, railwave=missing)
    logging.getLogger("megatron_railwave").removeHandler(handler)
    out["missing_anchors_warnings"] = [r.getMessage() for r in records]

    # Malformed input on one rank: every rank raises after the count all-gather.
    dispatcher = make("joint")
    cases = {
        "float_routing_map": (1, lambda h, p, r: (h, p, r.float())),
        "routing_map_shape": (2, lambda h, p, r: (h, p, torch.cat([r, r[:, :1]], dim=1))),
        "probs_shape": (3, lambda h, p, r: (h, p[:, :-1], r)),
    }
    for name, (bad_rank, spoil) in cases.items():
        hidden, probs, routing = _inputs(rank, 6)
        if rank == bad_rank:
            hidden, probs, routing = spoil(hidden, probs, routing)
        out[name] = _error_text(lambda: _run_hooks(dispatcher, hidden, probs, routing))
    hidden, probs, routing = _inputs(rank, 6)
    after, _ = _run_hooks(dispatcher, hidden, probs, routing)
    out["good_after_errors"] = bool(torch.allclose(after.squeeze(1), hidden * probs.sum(1, keepdim=True),
                                                   atol=1e-6))

    # Rank 1 has no tokens; nobody routes to rank 3's experts.
    tokens = [5, 0, 7, 3]
    out["zero_tokens"] = {}
    for path in PATHS:
        dispatcher = make(path)
        hidden, probs, routing = _inputs(rank, tokens[rank], avoid_rank=3, seed=1)
        hidden.requires_grad_(True)
        probs.requires_grad_(True)
        result, tokens_per_expert = _run_hooks(dispatcher, hidden, probs, routing)
        grad = torch.ones_like(result)
        (result * grad).sum().backward()
        expected = hidden.detach() * probs.detach().sum(1, keepdim=True)
        out["zero_tokens"][path] = {
            "shape": list(result.shape),
            "tokens_per_expert": tokens_per_expert.tolist(),
            "out_err": float((result.detach().squeeze(1) - expected).abs().max()) if result.numel() else 0.0,
            # d/dx sum(x * s) = s; d/dp[t, e] = sum_h x[t, h] on the routed entries.
            "dx_err": float((hidden.grad - probs.detach().sum(1, keepdim=True).expand_as(hidden)).abs().max())
            if hidden.numel() else 0.0,
            "dp_err": float((probs.grad - hidden.detach().sum(1, keepdim=True) * routing).abs().max())
            if probs.numel() else 0.0,
        }
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return out


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(dispatcher_errors_worker, WORLD, timeout_s=300)


@pytest.mark.parametrize("case,bad_rank,detail", [
    ("float_routing_map", 1, "routing_map has dtype torch.float32, expected torch.bool"),
    ("routing_map_shape", 2, r"routing_map has shape \(6, 9\), expected \[T, 8\]"),
    ("probs_shape", 3, r"probs has shape \(6, 7\), expected routing_map's \(6, 8\)"),
])
def test_dispatcher_bad_input_on_one_rank_raises_on_every_rank(ranks, case, bad_rank, detail):
    import re

    for rank, res in enumerate(ranks):
        text = res[case]
        assert text.startswith("InputError: malformed dispatcher input on EP rank(s) "
                               f"[{bad_rank}]"), f"rank {rank}: {text}"
        assert ("this rank: " in text) == (rank == bad_rank), f"rank {rank}: {text}"
        if rank == bad_rank:
            assert re.search(detail, text), text


def test_dispatcher_recovers_after_bad_input(ranks):
    assert all(res["good_after_errors"] for res in ranks)


def test_dispatcher_topology_mismatch_raises_at_construction(ranks):
    for res in ranks:
        assert res["topology"].startswith("ValueError: EP size 4 is not a multiple of gpus_per_node=3"), \
            res["topology"]


def test_dispatcher_missing_anchors_warns_once_on_rank_zero(ranks):
    assert len(ranks[0]["missing_anchors_warnings"]) == 1
    assert "anchors file '/nonexistent/anchors.yaml' does not exist" in ranks[0]["missing_anchors_warnings"][0]
    assert all(res["missing_anchors_warnings"] == [] for res in ranks[1:])


@pytest.mark.parametrize("option", sorted(UNSUPPORTED) + ["tensor_parallel"])
def test_dispatcher_unsupported_option_raises_naming_it(ranks, option):
    name = "tensor_model_parallel_size" if option == "tensor_parallel" else option
    for res in ranks:
        text = res[option] if option == "tensor_parallel" else res["unsupported"][option]
        assert text.startswith("ValueError: moe_token_dispatcher_type='railwave' does not support"), text
        assert name in text and "'alltoall' dispatcher" in text, text


@pytest.mark.parametrize("path", PATHS)
def test_dispatcher_rank_with_zero_tokens_and_rank_receiving_nothing(ranks, path):
    tokens = [5, 0, 7, 3]
    for rank, res in enumerate(ranks):
        got = res["zero_tokens"][path]
        assert got["shape"] == [tokens[rank], 1, HIDDEN]
        assert max(got["out_err"], got["dx_err"], got["dp_err"]) < 1e-5, (rank, got)
    assert ranks[3]["zero_tokens"][path]["tokens_per_expert"] == [0, 0]  # receives nothing
    assert sum(sum(r["zero_tokens"][path]["tokens_per_expert"]) for r in ranks) == TOPK * sum(tokens)


def test_unknown_path_name_is_rejected_with_the_allowed_names():
    with pytest.raises(ValueError, match=r"unknown path 'fastest'; choose one of native, rail, perm, joint"):
        RailWaveConfig(path="fastest")


def test_topology_mismatch_names_sizes_and_fix():
    with pytest.raises(ValueError, match=r"EP size 4 is not a multiple of gpus_per_node=3; an EP group must "
                                         r"span whole nodes"):
        RailWaveConfig(gpus_per_node=3).topology(4)
    with pytest.raises(ValueError):
        RailWaveConfig(cluster=str(_REPO_ROOT / "configs" / "clusters" / "h800_4x8.yaml")).topology(4)
