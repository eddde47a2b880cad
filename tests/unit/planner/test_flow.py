"""The min-max relay plan of FLOW / FLOW_WAVES (``planner.flow``): the compiled ``ops.flow_plan``
(csrc/cpu/flow.cpp) against the Python reference bit for bit, failed rails, shared rails and
waves included; the plan's invariants; and what it buys over RailBalance on its own model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_railwave import ops
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.planner.flow import (
    flow_costs,
    flow_objective_cost,
    flow_relay_reference,
)
from megatron_railwave.planner.plan import delivery_copies_NNGG
from megatron_railwave.planner.railbalance import eligible_NNG, healthy_gpus_NG
from megatron_railwave.planner.waves import all_at_once, bounded_fanin_schedule
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.ops_cases import random_failed_topology

compiled = pytest.mark.skipif(
    ops.load_error() is not None or not ops.compiled_for(torch.device("cpu")),
    reason="the compiled ops did not load (make ext)",
)


def _case(rng, topo: RailTopology, sparsity: float, waved: bool):
    n, g = topo.num_nodes, topo.gpus_per_node
    records = rng.integers(0, 60, size=(n, n, g)) * (rng.random((n, n, g)) > sparsity)
    # Copies per target: each record has 1..g targets; target j's copies <= the records.
    copies = (records[..., None] * rng.random((n, n, g, g))).astype(np.int64)
    records_NNG = torch.from_numpy(records.astype(np.int64))
    schedule = bounded_fanin_schedule(n, 1) if waved else all_at_once(n)
    return (
        records_NNG,
        torch.from_numpy(copies),
        eligible_NNG(topo, records_NNG),
        schedule.pair_wave_NN(),
        schedule.num_waves,
    )


def _kwargs(topo: RailTopology, num_waves: int, units: int, sweeps: int) -> dict:
    nvlink_cost, nic_cost = flow_costs(topo)
    return dict(
        num_waves=num_waves,
        num_rails=topo.num_rails,
        nvlink_cost=nvlink_cost,
        nic_cost=nic_cost,
        units=units,
        sweeps=sweeps,
    )


@compiled
@settings(max_examples=60, deadline=None)
@given(
    num_nodes=st.integers(1, 5),
    gpus=st.sampled_from([1, 2, 3, 4, 8]),
    failed=st.integers(0, 3),
    sparsity=st.sampled_from([0.0, 0.5, 0.9]),
    waved=st.booleans(),
    units=st.sampled_from([1, 3, 16]),
    sweeps=st.integers(0, 2),
    shared_rails=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compiled_flow_plan_matches_reference(
    num_nodes, gpus, failed, sparsity, waved, units, sweeps, shared_rails, seed
):
    rng = np.random.default_rng(seed)
    if shared_rails and gpus % 2 == 0 and not failed:
        topo = RailTopology(
            num_nodes=num_nodes,
            gpus_per_node=gpus,
            rail_of_gpu=tuple(l // 2 for l in range(gpus)),
        )
    else:
        topo = random_failed_topology(rng, num_nodes, gpus, failed)
    assume(topo is not None)
    records, copies, eligible, wave, num_waves = _case(rng, topo, sparsity, waved)
    rail_G = torch.tensor(topo.rail_of_gpu, dtype=torch.int64)
    kwargs = _kwargs(topo, num_waves, units, sweeps)
    want = flow_relay_reference(records, copies, eligible, wave, rail_G, **kwargs)
    got = ops.flow_plan(records, copies, eligible, wave, rail_G, **kwargs)
    assert torch.equal(got, want)

    # Invariants: every record leaves on exactly one eligible rail; local pairs are kept.
    assert torch.equal(want.sum(dim=3), records)
    rail_used = want.sum(dim=2) > 0  # [s, d, l]
    remote = (wave >= 0).unsqueeze(-1)
    assert not bool((rail_used & remote & ~eligible).any())
    healthy = healthy_gpus_NG(topo)
    failed_gpu = ~(healthy[:, None, :] & healthy[None, :, :])
    assert not bool((rail_used & remote & failed_gpu).any())
    diag = torch.arange(num_nodes)
    local = want[diag, diag]
    assert torch.equal(local.diagonal(dim1=-2, dim2=-1), records[diag, diag])
    assert int(local.sum()) == int(records[diag, diag].sum())


@pytest.mark.parametrize("path", [Route.FLOW, Route.FLOW_WAVES])
def test_build_plan_flow_is_deterministic_and_consistent(path):
    topo = RailTopology(num_nodes=3, gpus_per_node=4, failed_rails=frozenset({(1, 2)}))
    gen = torch.Generator().manual_seed(3)
    maps = [torch.rand(64, 24, generator=gen) < 0.15 for _ in range(topo.world_size)]
    demand = DemandCounts.from_routing_maps(maps, topo)
    a = build_plan(demand, topo, path, options=PlanOptions(chunks=2))
    b = build_plan(demand, topo, str(path), options=PlanOptions(chunks=2))
    assert torch.equal(a.relay_NNGG, b.relay_NNGG)
    assert torch.equal(a.quota_NNG, a.relay_NNGG.sum(dim=2))
    assert torch.equal(a.relay_NNGG.sum(dim=3), a.records_NNG)
    assert a.chunks == 2
    assert a.num_waves == (2 if path.waved else 1)
    # The failed rail (node 1, rail 2) carries nothing remote in either direction.
    assert int(a.quota_NNG[1, :, 2].sum()) == int(a.records_NNG[1, 1, 2])
    assert int(a.quota_NNG[:, 1, 2].sum()) == int(a.records_NNG[1, 1, 2])


def test_flow_never_costs_more_than_railbalance_in_its_model():
    """A hot source GPU (GPU 0 of every node owns 12x the records) and random demands: FLOW keeps
    the cheaper of its water-filling and RailBalance's plan in the objective both are scored by
    (``flow_objective_cost``), so its modelled time is never above RailBalance's."""
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    n, g = topo.num_nodes, topo.gpus_per_node
    for seed in range(4):
        rng = np.random.default_rng(seed)
        records_NGN = rng.integers(20, 40, size=(n, g, n))
        if seed == 0:
            records_NGN[:, 0, :] *= 12  # GPU 0 of every node is hot
        records_NGN = torch.from_numpy(records_NGN.astype(np.int64))
        flow = build_plan(records_NGN, topo, Route.FLOW)
        rail = build_plan(records_NGN, topo, Route.RAIL)
        copies = delivery_copies_NNGG(records_NGN, flow.records_NNG, g)
        cost = {
            p.path: flow_objective_cost(
                p.relay_NNGG, copies, p.pair_wave_NN, topo, num_waves=p.num_waves
            )
            for p in (flow, rail)
        }
        assert cost[Route.FLOW] <= cost[Route.RAIL]
        assert int(flow.relay_NNGG.sum()) == int(records_NGN.sum())
