"""No modelled time is below its bandwidth lower bound: every path, arrangement, both delivery
variants (and combine overlap), global and per-rank phase dependencies, random demands
(hypothesis), and the peers in `netmodel.peers`."""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel import NetModelConfig, execute_plan
from megatron_railwave.lab.netmodel.execute import fabric_for, synced_program
from megatron_railwave.lab.netmodel.program import run_program
from megatron_railwave.lab.workloads import arrange
from megatron_railwave.names import ROUTES
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.netmodel_cases import MODELS, random_demand

_demand = random_demand


def _check(t):
    assert t.bound_s >= 0
    assert t.dispatch_s >= t.bound_dispatch_s * (1 - 1e-9)
    assert t.combine_s >= t.bound_combine_s * (1 - 1e-9)
    assert t.total_s >= t.bound_s * (1 - 1e-9)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([2, 3, 4]),
    g=st.sampled_from([2, 4]),
    density=st.floats(0.05, 0.6),
    skew=st.integers(1, 6),
    pattern=st.sampled_from(["none", "ring", "moderate", "extreme"]),
    path=st.sampled_from(list(map(str, ROUTES))),
    variant=st.sampled_from(sorted(MODELS)),
    alpha=st.sampled_from([0.0, 0.3]),
    nvlink=st.sampled_from([4.0, 40.0]),
)
def test_no_modelled_time_below_the_bandwidth_bound(
    seed, n, g, density, skew, pattern, path, variant, alpha, nvlink
):
    # NVLink (4 GB/s) slower than a rail (12.5 GB/s): both kinds of port set bounds.
    topo = RailTopology(num_nodes=n, gpus_per_node=g, rail_gbps=100.0, nvlink_gBps=nvlink)
    demand = _demand(n, g, seed, density, skew)
    if not int(demand.records_WN.sum()):
        return
    windows = None
    if pattern != "none" and n >= 3:
        demand, windows = arrange(demand, pattern, topo)
    plan = build_plan(demand, topo, path, options=PlanOptions(windows=windows))
    _check(
        execute_plan(
            plan, record_bytes=4096, model=replace(MODELS[variant], alpha=alpha), demand=demand
        )
    )


def test_bound_is_the_busiest_ports_bytes_by_hand():
    # 2 x 2, NATIVE: GPU (0,0) sends 3 records to GPU (1,1): NIC (0,0) carries 3 dispatch rows
    # (payload 1e6 + 16 B) at 1 GB/s = 3.000048 ms, NVLink (1,0) -> (1,1) 3 rows at 2 GB/s = 1.5 ms.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rec = torch.zeros(4, 2, 4, dtype=torch.int64)
    rec[0, 1, 0b10] = 3
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(4, 4, dtype=torch.int64))
    plan = build_plan(demand, topo, "native")
    t = execute_plan(
        plan, record_bytes=1_000_000, model=NetModelConfig(num_experts=2), demand=demand
    )
    assert t.bound_dispatch_s == pytest.approx(3 * (1e6 + 16) / 1e9)
    assert t.bound_combine_s == pytest.approx(3e-3)
    assert t.bound_link in ("nic-up (0, 0)", "nic-down (1, 0)")


@pytest.mark.parametrize("phase_sync", ["global", "rank"])
@pytest.mark.parametrize("peer", ["megatron", "fast"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_peers_respect_the_bound(peer, seed, phase_sync):
    from megatron_railwave.lab.netmodel.peers import bvn_waves, fast_program, megatron_program

    topo = RailTopology(num_nodes=4, gpus_per_node=4, rail_gbps=100.0, nvlink_gBps=20.0)
    demand = _demand(4, 4, seed, 0.3, 3)
    model = NetModelConfig(rel_tol=0.0, phase_sync=phase_sync)
    if peer == "megatron":
        program = megatron_program(demand, topo, record_bytes=4096, model=model)
    else:
        plan = build_plan(demand, topo, "rail")
        waves = bvn_waves(plan.records_NNG.sum(dim=-1).numpy())
        program = fast_program(plan, demand, waves, record_bytes=4096, model=model)
    program = synced_program(program, model, topo.world_size)
    run = run_program(fabric_for(topo, 32, 1.0), program, incast=model.incast(), rel_tol=0.0)
    assert run.bound_s > 0 and run.total_s >= run.bound_s * (1 - 1e-9)
    assert run.dispatch_s >= run.bound_dispatch_s * (1 - 1e-9)
    assert run.combine_s >= run.bound_combine_s * (1 - 1e-9)
