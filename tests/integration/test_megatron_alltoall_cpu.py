"""A real Megatron-Core MoELayer (alltoall dispatcher, EP=4, 4 gloo processes) vs a dense oracle.

Layout worked out for the sizes below: E=8 experts over EP=4 ranks gives L=2 local experts
per rank (rank r owns experts 2r, 2r+1), so the dispatcher's second permutation (sort chunks
by local expert) runs. Each rank has T = S*B = 16 tokens and K=2, so it sends 32 token copies.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # spawned ranks inherit sys.path and import tests.helpers
    sys.path.insert(0, str(_REPO_ROOT))

from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.moe_layer import build_and_run_moe_layer, dense_moe_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)

_WORLD_SIZE = 4
_SIZES = dict(num_experts=8, topk=2, hidden=32, ffn_hidden=16, seq_len=8, micro_batch=2, seed=1234)


@pytest.fixture(scope="module")
def alltoall_and_reference() -> tuple[list[dict], dict]:
    ranks = run_distributed(
        functools.partial(build_and_run_moe_layer, dispatcher_type="alltoall", **_SIZES),
        _WORLD_SIZE,
        timeout_s=180,
    )
    return ranks, dense_moe_reference(_WORLD_SIZE, **_SIZES)


def test_megatron_alltoall_ep4_output_matches_dense_reference(alltoall_and_reference):
    ranks, ref = alltoall_and_reference
    for rank, result in enumerate(ranks):
        np.testing.assert_allclose(
            result["output"],
            ref["output"][rank],
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"output of rank {rank}",
        )


def test_megatron_alltoall_ep4_input_grad_matches_dense_reference(alltoall_and_reference):
    ranks, ref = alltoall_and_reference
    for rank, result in enumerate(ranks):
        np.testing.assert_allclose(
            result["input_grad"],
            ref["input_grad"][rank],
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"input grad of rank {rank}",
        )


def test_megatron_alltoall_ep4_weight_grads_match_dense_reference(alltoall_and_reference):
    ranks, ref = alltoall_and_reference
    for rank, result in enumerate(ranks):
        local = result["local_expert_indices"]
        assert local == [2 * rank, 2 * rank + 1]
        np.testing.assert_allclose(result["fc1_grad"], ref["fc1_grad"][local], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result["fc2_grad"], ref["fc2_grad"][local], rtol=1e-5, atol=1e-5)
    # The router weight is replicated: each rank holds only its own tokens' contribution.
    router_grad = sum(result["router_grad"] for result in ranks)
    np.testing.assert_allclose(router_grad, ref["router_grad"], rtol=1e-5, atol=1e-5)
