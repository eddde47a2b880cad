"""The per-record routing bound (`netmodel.bounds.ideal_bound`, its old name kept as an alias of
`per_record_bound`): worked by hand on a tiny case, and
no modelled time of any path or peer is below it (hypothesis over random demands, arrangements,
delivery variants, phase sync, incast alpha and NVLink speed)."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel import execute_plan
from megatron_railwave.lab.netmodel.bounds import ideal_bound
from megatron_railwave.lab.netmodel.peers import PEERS, model_peer
from megatron_railwave.lab.workloads import arrange
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.netmodel_cases import MODELS, random_demand

_demand = partial(random_demand, consistent_experts=True)


def test_ideal_bound_by_hand_two_nodes():
    # 2 x 2, rails 8 Gb/s = 1 GB/s, NVLink 2 GB/s; rows of 1e6 B.
    # GPU (0,0) sends 3 records to node 1 with mask {0, 1}: node 1 takes 3 rows in over 2 GB/s of
    # NICs (1.5 ms); GPU (1,0) and (1,1) each take 3 copies over NVLink 2 + NIC 1 = 3 GB/s (1 ms);
    # GPU (0,0) sends 3 rows out over 3 GB/s (1 ms). Binding: node 1's NIC aggregate, 1.5 ms a
    # direction, 3 ms dispatch + combine.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rec = torch.zeros(4, 2, 4, dtype=torch.int64)
    rec[0, 1, 0b11] = 3
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(4, 4, dtype=torch.int64))
    got = ideal_bound(demand, topo, payload_bytes=1_000_000)
    assert got.dispatch_s == pytest.approx(1.5e-3) and got.bound_s == pytest.approx(3e-3)
    assert got.resource == "node NIC in node 1"
    # Per-rank phases: node 1's NIC aggregate carries 3 rows in (dispatch) and 0 in (combine
    # returns to node 0): still 1.5 ms; node 0 likewise: the joint form is 1.5 ms.
    assert ideal_bound(
        demand, topo, payload_bytes=1_000_000, phase_sync="rank"
    ).bound_s == pytest.approx(1.5e-3)


def test_ideal_bound_self_only_records_do_not_leave():
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rec = torch.zeros(4, 2, 4, dtype=torch.int64)
    rec[1, 0, 0b10] = 5  # GPU (0,1)'s tokens whose only target is itself
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(4, 4, dtype=torch.int64))
    assert ideal_bound(demand, topo, payload_bytes=1000).bound_s == 0.0


def test_ideal_bound_rejects_unknown_phase_sync():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    demand = _demand(2, 2, 0, 0.5, 1)
    with pytest.raises(ValueError, match="phase_sync must be 'global' or 'rank'"):
        ideal_bound(demand, topo, payload_bytes=8, phase_sync="node")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([2, 3, 4]),
    g=st.sampled_from([2, 4]),
    density=st.floats(0.05, 0.6),
    skew=st.integers(1, 6),
    pattern=st.sampled_from(["none", "ring", "moderate", "extreme"]),
    who=st.sampled_from(["native", "rail", "perm", "joint", *PEERS]),
    variant=st.sampled_from(sorted(MODELS)),
    alpha=st.sampled_from([0.0, 0.3]),
    nvlink=st.sampled_from([4.0, 40.0]),
    adapters=st.booleans(),
)
def test_no_modelled_time_below_the_ideal_bound(
    seed, n, g, density, skew, pattern, who, variant, alpha, nvlink, adapters
):
    # NVLink (4 GB/s) slower than a rail (12.5 GB/s) and faster; H20-like shared adapters.
    extra = (
        {"adapter_of_rail": [r // 2 for r in range(g)], "adapter_gbps": 150.0} if adapters else {}
    )
    topo = RailTopology(num_nodes=n, gpus_per_node=g, rail_gbps=100.0, nvlink_gBps=nvlink, **extra)
    demand = _demand(n, g, seed, density, skew)
    if not int(demand.records_WN.sum()):
        return
    windows = None
    if pattern != "none" and n >= 3:
        demand, windows = arrange(demand, pattern, topo)
    model = replace(MODELS[variant], alpha=alpha)
    bound = ideal_bound(demand, topo, payload_bytes=4096, phase_sync=model.phase_sync)
    if who in PEERS and who != "deepep-balanced":
        if who == "megatron" or who == "megatron-flat":
            if demand.experts_WE is None:
                return
        got = model_peer(who, demand, topo, record_bytes=4096, model=model, repeats=0)["comm_s"]
    elif who == "deepep-balanced":
        return  # a different input: its own bound, covered by 'native'
    else:
        plan = build_plan(demand, topo, who, options=PlanOptions(windows=windows))
        got = execute_plan(plan, record_bytes=4096, model=model, demand=demand).total_s
    assert got >= bound.bound_s * (1 - 1e-9), (got, bound)
