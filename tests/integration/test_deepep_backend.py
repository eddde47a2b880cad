"""The DeepEP backend through the fake Buffer (CPU, gloo): bitwise equal to the torch backend,
within 1e-5 of Megatron's alltoall in a real MoELayer, forward and backward, all four paths.

What these runs can and cannot see: the fake models DeepEP's API, receive order and combine
arithmetic (docs/deepep.md); the real kernels have not run (no GPU here). With 2 GPUs per node a
record reaches at most 2 GPUs of a node, and a 2-term fp32 sum does not depend on its order, so
the 2 x 4 fp32 case is the one that checks DeepEP's NVLink-level order (ascending local rank).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_railwave.names import ROUTES, parse_route
from tests.helpers.deepep_worker import (
    run_backends,
    run_moe_layer_backends,
    run_unsupported_layouts,
)
from tests.helpers.dist import run_distributed
from tests.helpers.exchange_worker import dense_reference

PATHS = list(map(str, ROUTES))


@pytest.mark.parametrize(
    "topo,kw,dtype",
    [
        # 2 nodes x 4 GPUs, top-6 of 16: records reach up to 4 GPUs of a node (sum order matters).
        (
            dict(num_nodes=2, gpus_per_node=4),
            dict(
                tokens=[20, 0, 33, 7, 16, 25, 1, 12],
                experts=16,
                topk=6,
                hidden=256,
                seed=1,
                gpus_per_node=4,
            ),
            "fp32",
        ),
        # 4 nodes x 2 GPUs, bf16: three waves for PERM / JOINT, relays for RAIL / JOINT, a rank
        # with no tokens, uneven token counts.
        (
            dict(num_nodes=4, gpus_per_node=2),
            dict(tokens=[20, 0, 33, 7, 16, 25, 1, 12], experts=16, topk=3, hidden=256, seed=2),
            "bf16",
        ),
    ],
    ids=["2x4-fp32", "4x2-bf16"],
)
def test_deepep_exchange_bitwise_equals_torch_backend(topo, kw, dtype):
    world = topo["num_nodes"] * topo["gpus_per_node"]
    results = run_distributed(run_backends, world, topo, PATHS, kw, dtype, timeout_s=400)
    waves = {p: max(r[f"shape/{p}"]["waves"] for r in results) for p in PATHS}
    relayed = {p: sum(r[f"shape/{p}"]["relayed_in"] for r in results) for p in PATHS}
    n = topo["num_nodes"]
    # The paths really differ on DeepEP: one wave per remote node for PERM / JOINT, relays for RAIL
    # / JOINT.
    assert waves == {p: n - 1 if parse_route(p).waved else 1 for p in PATHS}, waves
    assert (
        relayed["native"] == relayed["perm"] == 0 and relayed["rail"] > 0 and relayed["joint"] > 0
    ), relayed
    for rank, res in enumerate(results):
        base = res["torch/native"]
        for path in PATHS:
            for name, a, b in zip(("out", "dx", "dprobs"), res[f"deepep/{path}"], base):
                assert np.array_equal(a, b), (
                    f"rank {rank} deepep/{path} {name}: max diff {np.abs(a - b).max()} from "
                    f"torch/native"
                )
        if dtype == "fp32":
            ref = dense_reference(rank, world, **kw)
            for name, a, b in zip(("out", "dx", "dprobs"), base, ref):
                np.testing.assert_allclose(
                    a, b.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"rank {rank} {name}"
                )


@pytest.mark.parametrize(
    "world",
    # 4 x 2 in a MoELayer takes ~3 minutes on 2 cores: `make test-all` (the exchange-level 4 x 2
    # case above covers waves and relays in `make test`).
    [4, pytest.param(8, marks=pytest.mark.slow)],
    ids=["ep4-2x2", "ep8-4x2"],
)
def test_deepep_moe_layer_matches_alltoall(world):
    kw = dict(
        num_experts=2 * world, topk=3, hidden=128, ffn_hidden=8, seq_len=6, micro_batch=2, seed=5
    )
    results = run_distributed(
        run_moe_layer_backends, world, dict(gpus_per_node=2), PATHS, kw, timeout_s=600
    )
    for rank, res in enumerate(results):
        for path in PATHS:
            for key in ("output", "input_grad", "fc1_grad", "fc2_grad", "router_grad"):
                got = res[f"deepep/{path}"][key]
                np.testing.assert_allclose(
                    got,
                    res["alltoall"][key],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"rank {rank} deepep/{path} {key} vs alltoall",
                )
                assert np.array_equal(got, res["torch/native"][key]), (
                    f"rank {rank}: deepep/{path} {key} not bitwise equal to the torch backend"
                )


def test_deepep_unsupported_layout_and_routing_fail_on_every_rank():
    results = run_distributed(run_unsupported_layouts, 4, timeout_s=120)
    for rank, errors in enumerate(results):
        assert errors["hidden"].startswith(
            "ValueError: backend 'deepep' cannot run 2 nodes x 2 GPUs"
        ), errors
        assert (
            "hidden size 100 (400 bytes per row" in errors["hidden"]
            and "backend: torch" in errors["hidden"]
        )
        try:
            import deep_ep  # noqa: F401
        except Exception:  # noqa: BLE001 - here: no wheel, every rank names it and the fallback
            assert errors["real"].startswith("ImportError: backend 'deepep' needs DeepEP 2.1"), (
                errors
            )
            assert "tokenspeed-deepep" in errors["real"] and "backend: torch" in errors["real"]
        else:  # with the wheel: 2 GPUs per node is not a DeepEP layout
            assert (
                "2 GPUs per node (DeepEP's internode kernels need exactly 8)" in errors["real"]
            ), errors
        assert errors["topk"].startswith(f"InputError: EP rank {rank}: DeepEP delivered"), errors
        assert "a token routes to more than 1 experts of one node" in errors["topk"]
