"""``ops.rail_plan`` (compiled, csrc/cpu/schedule.cpp) against ``planner.railbalance``'s numpy
quotas and relay counts (the reference), for balanced and owner-keeps paths, every eligible-rail
policy, failed rails and rotation phases; and ``build_plan`` the same with either."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_railwave import ops
from megatron_railwave.planner import EligiblePolicy, PlanOptions, build_plan
from megatron_railwave.planner.railbalance import eligible_NNG, rail_quota_NNG, relay_NNGG
from tests.helpers.ops_cases import random_failed_topology

pytestmark = pytest.mark.skipif(
    ops.load_error() is not None or not ops.compiled_for(torch.device("cpu")),
    reason="the compiled ops did not load (make ext)",
)


@settings(max_examples=80, deadline=None)
@given(
    num_nodes=st.integers(1, 6),
    gpus=st.sampled_from([1, 2, 3, 4, 8]),
    balanced=st.booleans(),
    policy=st.sampled_from(list(EligiblePolicy)),
    phase=st.integers(0, 11),
    failed=st.integers(0, 3),
    sparsity=st.sampled_from([0.0, 0.5, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_rail_plan_matches_railbalance(
    num_nodes, gpus, balanced, policy, phase, failed, sparsity, seed
):
    rng = np.random.default_rng(seed)
    topo = random_failed_topology(rng, num_nodes, gpus, failed)
    assume(topo is not None)  # two nodes without a common healthy rail
    records = rng.integers(0, 40, size=(num_nodes, num_nodes, gpus)) * (
        rng.random((num_nodes, num_nodes, gpus)) > sparsity
    )
    records_NNG = torch.from_numpy(records.astype(np.int64))
    mask_NG = torch.from_numpy(rng.random((num_nodes, gpus)) > 0.5)
    eligible = eligible_NNG(topo, records_NNG, policy, mask_NG)
    quota, relay = ops.rail_plan(records_NNG, eligible, balanced=balanced, phase=phase)
    want_quota = rail_quota_NNG(records_NNG, eligible, balanced=balanced, phase=phase)
    assert torch.equal(quota, want_quota)
    assert torch.equal(relay, relay_NNGG(records_NNG, want_quota))

    old = ops.set_forced_reference(True)
    try:
        reference = build_plan(
            records_NNG.permute(0, 2, 1),
            topo,
            "joint" if balanced else "perm",
            phase=phase,
            options=PlanOptions(policy=policy, rail_mask_NG=mask_NG),
        )
    finally:
        ops.set_forced_reference(old)
    plan = build_plan(
        records_NNG.permute(0, 2, 1),
        topo,
        "joint" if balanced else "perm",
        phase=phase,
        options=PlanOptions(policy=policy, rail_mask_NG=mask_NG),
    )
    assert torch.equal(plan.quota_NNG, reference.quota_NNG) and torch.equal(
        plan.relay_NNGG, reference.relay_NNGG
    )
