"""The launch layouts people run, on a real Megatron-Core MoELayer (8 CPU ranks, gloo, EP 4).

* Folded layouts with expert-TP 1: TP 2 with sequence parallel, CP 2, PP 2 (the layer under the
  pipeline's process groups; the pipeline schedule itself is not run here). Each EP group is a
  contiguous block of 4 ranks; railwave matches ``alltoall`` within 1e-5 and the four paths are
  bitwise equal.
* Passes (EP 4 x DP 2, sigmoid router with expert bias; EP rank 3's experts are never selected, so
  it receives nothing): two micro-batches of different token counts with selective recompute
  (``recompute_modules=['moe']``) and with a checkpoint around the whole layer (what full
  recompute does), a forward-only pass in eval mode under ``no_grad``, then the next step.
  Outputs and gradients match ``alltoall``; every recompute replays exactly its first forward's
  plan; the rotation phase and the logged step follow Megatron's iteration (``steps.set_step``),
  not dispatcher calls.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.moe_layouts import PATHS, run_layouts_worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)

KEYS = ["output", "input_grad", "fc1_grad", "fc2_grad", "router_grad"]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(run_layouts_worker, 8, timeout_s=1200)


@pytest.mark.parametrize("layout", ["tp2-sp", "cp2", "pp2"])
def test_folded_layout_matches_alltoall_and_paths_are_bitwise_equal(ranks, layout):
    for rank, res in enumerate(ranks):
        got = res[layout]
        assert got["ep_group"] == list(
            range(4 * (rank // 4), 4 * (rank // 4) + 4)
        )  # contiguous EP blocks
        for path in PATHS:
            for key in KEYS:
                np.testing.assert_allclose(
                    got[path][key],
                    got["alltoall"][key],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"{layout} rank {rank} {path} {key}",
                )
                assert np.array_equal(got[path][key], got["native"][key]), (
                    f"{layout} rank {rank}: {path} {key}"
                )


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_forward_only_and_variable_tokens_match_alltoall(ranks, mode):
    for rank, res in enumerate(ranks):
        rail, ref = res["passes"][f"{mode}/railwave"], res["passes"][f"{mode}/alltoall"]
        for mb in range(2):
            for key in KEYS:
                np.testing.assert_allclose(
                    rail["steps"][mb][key],
                    ref["steps"][mb][key],
                    rtol=1e-5,
                    atol=1e-6,
                    err_msg=f"{mode} rank {rank} micro-batch {mb} {key}",
                )
        np.testing.assert_allclose(rail["forward_only"], ref["forward_only"], rtol=1e-5, atol=1e-6)
        for key in KEYS:
            np.testing.assert_allclose(rail["after"][key], ref["after"][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_replays_its_forward_plan_and_steps_follow_the_iteration(ranks, mode):
    for rank, res in enumerate(ranks):
        rail = res["passes"][f"{mode}/railwave"]
        plans = rail["plans"]
        # step 10: mb0 forward, its recompute, mb1 forward, its recompute; step 11: the eval pass
        # (phase not advanced), a training forward and its recompute.
        assert [(p["kind"], p["phase"]) for p in plans] == [
            ("train", 0),
            ("recompute", 0),
            ("train", 1),
            ("recompute", 1),
            ("train", 2),
            ("train", 2),
            ("recompute", 2),
        ], (rank, [(p["kind"], p["phase"]) for p in plans])
        for first, again in ((0, 1), (2, 3), (5, 6)):
            assert plans[again] == {**plans[first], "kind": "recompute"}, (rank, first)
        # Logged once per forward (not for recomputes), by Megatron's step and micro-batch.
        assert [s[:3] for s in rail["stats"]] == [
            (10, 0, "train"),
            (10, 1, "train"),
            (11, 0, "forward_only"),
            (11, 0, "train"),
        ]
        # EP rank 3 receives nothing; the others share every token's top-3.
        own = [p["own_experts"] for p in plans if p["kind"] == "train"]
        if rank % 4 == 3:
            assert all(o == [0, 0] for o in own), own
        else:
            assert sum(map(sum, own)) > 0
