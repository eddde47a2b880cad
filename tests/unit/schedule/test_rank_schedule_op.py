"""``ops.rank_schedule`` (compiled, csrc/cpu/schedule.cpp) against the Python pipeline it replaces
on the exchange's path: ``compile_schedule`` with the rank's node's deliveries, ``rank_view`` and
``exchange.layout.layout_counts``, field by field, for every path, eligible policy, fan-in, rail
chunks, failed rails, replay windows and rotation phase."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_railwave import ops
from megatron_railwave.exchange.layout import layout_counts
from megatron_railwave.names import ROUTES
from megatron_railwave.planner import EligiblePolicy, PlanOptions, build_plan
from megatron_railwave.planner.waves import schedule_from_windows
from megatron_railwave.schedule import (
    RecordWireFormat,
    compile_for_rank,
    compile_schedule,
    rank_view,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.ops_cases import random_failed_topology

pytestmark = pytest.mark.skipif(
    ops.load_error() is not None or not ops.compiled_for(torch.device("cpu")),
    reason="the compiled ops did not load (make ext)",
)

PATHS = tuple(map(str, ROUTES))
WIRE = RecordWireFormat(
    hidden=16, payload_dtype=torch.float32, probs_dtype=torch.float32, experts_per_node=8
)


def _node_view(full: DemandCounts, node: int) -> DemandCounts:
    return DemandCounts(
        records_WN=full.records_WN, view_node=node, view_masks_WM=full.masks_into(node)
    )


def _random_demand(rng: np.random.Generator, topo: RailTopology, sparsity: float) -> DemandCounts:
    w, n, m = topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node
    records = rng.integers(0, 6, size=(w, n, m)) * (rng.random((w, n, m)) > sparsity)
    records[:, :, 0] = 0  # mask 0 is "no record"
    return DemandCounts(
        records_WNM=torch.from_numpy(records.astype(np.int64)),
        experts_WE=torch.zeros(w, 1, dtype=torch.int64),
    )


def _assert_same(plan, demand: DemandCounts, rank: int) -> None:
    topo = plan.topology
    node = topo.node_of(rank)
    view_demand = _node_view(demand, node)
    got = compile_for_rank(plan, WIRE, demand=view_demand, node=node, rank=rank)
    assert got.layout_counts is not None  # the compiled op ran
    schedule = compile_schedule(plan, WIRE, demand=view_demand)
    view = rank_view(schedule, rank)
    mine = schedule.only_ranks((rank,))
    for name in ("phase_X", "src_X", "dst_X", "rows_X"):
        assert torch.equal(getattr(got.schedule, name), getattr(mine, name)), name
    assert got.schedule.transfer_ranks == (rank,)
    assert got.schedule.phases == schedule.phases
    assert got.schedule.delivery_nodes == schedule.delivery_nodes
    assert got.view.phases == view.phases
    for name in ("rank", "node", "local", "owner_category_counts", "egress_N", "num_copies"):
        assert getattr(got.view, name) == getattr(view, name), name
    for name in ("kept_N", "relay_in_NG", "arrival_counts_NGM", "source_round_N"):
        np.testing.assert_array_equal(getattr(got.view, name), getattr(view, name), err_msg=name)
    np.testing.assert_array_equal(got.layout_counts, layout_counts(plan, view))


@settings(max_examples=60, deadline=None)
@given(
    num_nodes=st.integers(1, 5),
    gpus=st.sampled_from([1, 2, 3, 4, 8]),
    path=st.sampled_from(PATHS),
    policy=st.sampled_from(list(EligiblePolicy)),
    fanin=st.integers(1, 3),
    chunks=st.sampled_from([1, 1, 2, 3, 5]),
    phase=st.integers(0, 7),
    failed=st.integers(0, 3),
    sparsity=st.sampled_from([0.0, 0.5, 0.95]),
    seed=st.integers(0, 2**16),
    streamed=st.booleans(),
)
def test_rank_schedule_matches_the_python_pipeline(
    num_nodes, gpus, path, policy, fanin, chunks, phase, failed, sparsity, seed, streamed
):
    rng = np.random.default_rng(seed)
    topo = random_failed_topology(rng, num_nodes, gpus, failed)
    assume(topo is not None)  # two nodes without a common healthy rail
    demand = _random_demand(rng, topo, sparsity)
    mask_NG = torch.from_numpy(rng.random((num_nodes, gpus)) > 0.5)
    options = PlanOptions(
        policy=policy,
        fanin=fanin,
        chunks=chunks,
        rail_mask_NG=mask_NG if policy == EligiblePolicy.MASK else None,
        streamed=streamed,
    )
    plan = build_plan(demand, topo, path, options=options, phase=phase)
    for rank in range(topo.world_size):
        _assert_same(plan, demand, rank)


def test_rank_schedule_with_replay_windows():
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    windows = schedule_from_windows(
        4,
        [
            [(0, 1), (1, 2), (2, 3), (3, 0)],
            [(0, 2), (2, 0)],
            [(0, 3), (1, 0), (2, 1), (3, 2), (1, 3), (3, 1)],
        ],
    )
    demand = _random_demand(np.random.default_rng(5), topo, 0.3)
    for path in ("native", "rail"):
        plan = build_plan(demand, topo, path, options=PlanOptions(windows=windows))
        for rank in range(topo.world_size):
            _assert_same(plan, demand, rank)


def test_forced_reference_takes_the_python_pipeline():
    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    demand = _random_demand(np.random.default_rng(1), topo, 0.2)
    plan = build_plan(demand, topo, "joint")
    old = ops.set_forced_reference(True)
    try:
        got = compile_for_rank(plan, WIRE, demand=_node_view(demand, 1), node=1, rank=3)
    finally:
        ops.set_forced_reference(old)
    assert got.layout_counts is None
    assert (
        got.view.phases
        == rank_view(compile_schedule(plan, WIRE, demand=_node_view(demand, 1)), 3).phases
    )


def test_rank_schedule_rejects_bad_input_naming_it():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    demand = _random_demand(np.random.default_rng(2), topo, 0.0)
    plan = build_plan(demand, topo, "joint")
    with pytest.raises(ValueError, match="masks_WM has shape"):
        ops.rank_schedule(
            plan.records_NNG,
            plan.quota_NNG,
            plan.relay_NNGG,
            plan.pair_wave_NN,
            torch.zeros(3, 4, dtype=torch.int64),
            rank=0,
            num_phases=8,
            relay_phase_U=[0],
            rail_phase_V=[2],
            deliver_phase_R=[1, 3],
        )
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        ops.rank_schedule(
            plan.records_NNG,
            plan.quota_NNG,
            plan.relay_NNGG,
            plan.pair_wave_NN,
            demand.masks_into(0).contiguous(),
            rank=4,
            num_phases=8,
            relay_phase_U=[0],
            rail_phase_V=[2],
            deliver_phase_R=[1, 3],
        )


def test_a_rank_only_schedule_refuses_what_needs_other_ranks():
    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    demand = _random_demand(np.random.default_rng(2), topo, 0.2)
    plan = build_plan(demand, topo, "joint")
    got = compile_for_rank(plan, WIRE, demand=_node_view(demand, 1), node=1, rank=3)
    assert set(got.schedule.src_X.tolist()) | set(got.schedule.dst_X.tolist()) >= {3}
    assert all(
        s == 3 or d == 3 for s, d in zip(got.schedule.src_X.tolist(), got.schedule.dst_X.tolist())
    )
    assert rank_view(got.schedule, 3).phases == got.view.phases  # its own rank: fine
    full = compile_schedule(plan, WIRE, demand=_node_view(demand, 1))
    assert got.schedule.rank_bytes(3) == full.rank_bytes(3)
    with pytest.raises(ValueError, match=r"rank_view needs the transfers of \[2\]"):
        rank_view(got.schedule, 2)
    with pytest.raises(ValueError, match="wire_rows_P needs the transfers of every rank"):
        got.schedule.wire_rows_P()
