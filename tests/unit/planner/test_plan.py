"""build_plan: the four paths on a hand-made demand, options, JSON and determinism."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.names import Route, parse_route
from megatron_railwave.planner import (
    EligiblePolicy,
    PlanOptions,
    build_plan,
    cyclic_schedule,
    schedule_from_windows,
)
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=3, gpus_per_node=2)

# records_NGN[s, g, d]: node 0's GPU 0 owns 5 records for node 1 and 2 for node 2; GPU 1 owns
# 1 for node 1. Node 1's GPU 1 owns 4 for node 0. Local records (s == d) stay put.
RECORDS_NGN = torch.zeros(3, 2, 3, dtype=torch.int64)
RECORDS_NGN[0, 0, 1], RECORDS_NGN[0, 0, 2], RECORDS_NGN[0, 1, 1] = 5, 2, 1
RECORDS_NGN[1, 1, 0], RECORDS_NGN[1, 0, 1], RECORDS_NGN[2, 1, 2] = 4, 3, 6


def test_native_and_rail_quota_hand_case():
    native = build_plan(RECORDS_NGN, TOPO, "native")
    rail = build_plan(RECORDS_NGN, TOPO, Route.RAIL)
    # NATIVE keeps owners: pair (0 -> 1) sends [5, 1].
    assert native.quota_NNG[0, 1].tolist() == [5, 1] and native.relayed_records() == 0
    # RAIL: 6 records over 2 GPUs -> [3, 3]; GPU 0 hands 2 to GPU 1.
    #       (0 -> 2): 2 records -> [1, 1]; (1 -> 0): 4 -> [2, 2], GPU 1 hands 2 to GPU 0.
    assert rail.quota_NNG[0, 1].tolist() == [3, 3]
    assert rail.quota_NNG[0, 2].tolist() == [1, 1]
    assert rail.quota_NNG[1, 0].tolist() == [2, 2]
    assert rail.relay_NNGG[0, 1].tolist() == [[3, 2], [0, 1]]
    assert rail.relayed_records() == 2 + 1 + 2
    # local pairs are not balanced
    assert rail.quota_NNG[1, 1].tolist() == [3, 0] and rail.quota_NNG[2, 2].tolist() == [0, 6]


def test_rail_load_nrn_uses_rail_of_gpu():
    plan = build_plan(RECORDS_NGN, TOPO, "rail")
    load = plan.rail_load_NRN()
    assert load.shape == (3, 2, 3)
    assert load[0, :, 1].tolist() == [3, 3] and load[1, :, 0].tolist() == [2, 2]
    # two GPUs on one rail add up
    shared = RailTopology(num_nodes=3, gpus_per_node=2, rail_of_gpu=(0, 0))
    assert build_plan(RECORDS_NGN, shared, "native").rail_load_NRN()[0, :, 1].tolist() == [6]


def test_waved_paths_use_cyclic_or_bounded_schedule():
    perm = build_plan(RECORDS_NGN, TOPO, "perm")
    joint = build_plan(RECORDS_NGN, TOPO, "joint", options=PlanOptions(fanin=2))
    native = build_plan(RECORDS_NGN, TOPO, "native")
    assert perm.schedule is cyclic_schedule(3) and perm.num_waves == 2
    assert joint.num_waves == 1 and joint.schedule.max_fanin() == 2
    assert native.num_waves == 1 and native.schedule.kind == "all"
    assert perm.pair_wave_NN.tolist() == [[-1, 0, 1], [1, -1, 0], [0, 1, -1]]
    # PERM keeps owners, JOINT balances
    assert perm.quota_NNG[0, 1].tolist() == [5, 1] and joint.quota_NNG[0, 1].tolist() == [3, 3]


def test_unwaved_paths_keep_replay_windows():
    windows = schedule_from_windows(3, [[(0, 1), (1, 2), (2, 0)], [(0, 2), (1, 0), (2, 1)]])
    plan = build_plan(RECORDS_NGN, TOPO, "rail", options=PlanOptions(windows=windows))
    assert plan.schedule is windows and plan.num_waves == 2
    # waved paths ignore the windows
    assert (
        build_plan(RECORDS_NGN, TOPO, "joint", options=PlanOptions(windows=windows)).schedule.kind
        == "cyclic"
    )
    with pytest.raises(ValueError, match=r"windows are for 2 nodes, topology has 3"):
        build_plan(
            RECORDS_NGN,
            TOPO,
            "native",
            options=PlanOptions(windows=schedule_from_windows(2, [[(0, 1), (1, 0)]])),
        )


def test_build_plan_wrong_demand_shape_raises():
    with pytest.raises(
        ValueError, match=r"demand has shape \(3, 2, 2\), expected \[N, G, N\] = \[3, 2, 3\]"
    ):
        build_plan(torch.zeros(3, 2, 2, dtype=torch.int64), TOPO, "native")


def test_plan_options_validation_and_policy_names():
    with pytest.raises(ValueError, match=r"fanin must be >= 1, got 0"):
        PlanOptions(fanin=0)
    assert PlanOptions(policy="active").policy is EligiblePolicy.ACTIVE
    with pytest.raises(ValueError):
        PlanOptions(policy="some")


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("native", Route.NATIVE),
        ("RAIL-ONLY", Route.RAIL),
        ("rail_only", Route.RAIL),
        ("Permutation-Only", Route.PERM),
        ("perm", Route.PERM),
        (" joint ", Route.JOINT),
        (Route.JOINT, Route.JOINT),
    ],
)
def test_parse_path_aliases(name, path):
    assert parse_route(name) is path


def test_parse_path_unknown_raises():
    with pytest.raises(
        ValueError, match=r"unknown path 'ring'; choose one of native, rail, perm, joint"
    ):
        parse_route("ring")


def test_path_flags():
    # Routes in declaration order: NATIVE, RAIL, PERM, JOINT, FLOW, FLOW_WAVES.
    assert [p.balanced for p in Route] == [False, True, False, True, False, False]
    assert [p.min_max for p in Route] == [False, False, False, False, True, True]
    assert [p.waved for p in Route] == [False, False, True, True, False, True]
    assert parse_route("flow_waves") is Route.FLOW_WAVES


def test_same_inputs_same_plan():
    a = build_plan(RECORDS_NGN, TOPO, "joint", phase=3)
    b = build_plan(RECORDS_NGN.clone(), TOPO, "joint", phase=3)
    for field in ("records_NNG", "quota_NNG", "relay_NNGG", "pair_wave_NN"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert a.schedule == b.schedule


def test_stats_and_json():
    native = build_plan(RECORDS_NGN, TOPO, "native")
    joint = build_plan(RECORDS_NGN, TOPO, "joint")
    s_native, s_joint = native.stats(record_bytes=8), joint.stats(record_bytes=8)
    # Same demand: same B; RailBalance lowers rho_g, the waves bring kappa to 1.
    assert s_native.B_mean_bytes == s_joint.B_mean_bytes
    assert s_joint.rho_g < s_native.rho_g and s_joint.kappa == 1.0
    data = joint.to_json(record_bytes=8)
    assert {
        "path",
        "waves",
        "rail_load",
        "records_total",
        "relayed_records",
        "stats",
        "topology",
    } <= set(data)
    assert data["records_total"] == int(RECORDS_NGN.sum()) and data["path"] == "joint"
    assert data["waves"] == cyclic_schedule(3).to_list()
