"""The any-routing bound (`netmodel.bounds.any_routing_bound`) beside the per-record routing bound:
worked by hand, never above the per-record bound (strictly below on a hot owner), exact token
counts from a routing, and no modelled time of any route (with and without waves and chunks) or
peer below either bound (hypothesis over random demands; the sensitivity inputs are checked in
test_sensitivity.py's smoke run)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel import execute_plan
from megatron_railwave.lab.netmodel.bounds import (
    OwnerTokens,
    any_routing_bound,
    ideal_bound,
    owner_tokens_from_topk_ids,
    per_record_bound,
)
from megatron_railwave.lab.netmodel.execute import fabric_for
from megatron_railwave.lab.netmodel.incast import IncastModel
from megatron_railwave.lab.netmodel.peers import PEERS, model_peer
from megatron_railwave.lab.netmodel.program import ProgramBuilder, run_program
from megatron_railwave.lab.workloads import arrange, demand_from_topk_ids
from megatron_railwave.names import ROUTES, Route
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.netmodel_cases import MODELS, random_demand

ROW = 1_000_000


def _counts(rec: torch.Tensor) -> DemandCounts:
    w = rec.shape[0]
    return DemandCounts(records_WNM=rec, experts_WE=torch.zeros(w, w, dtype=torch.int64))


def test_old_names_are_the_per_record_bound():
    assert ideal_bound is per_record_bound


def test_any_routing_bound_by_hand_two_nodes():
    # 2 x 2, rails 1 GB/s, NVLink 2 GB/s. GPU (0,0) sends 3 tokens to node 1 with mask {0, 1}.
    # Node 1's NICs (2 GB/s each way): 3 dispatch rows in, 3 combine rows out -> 1.5 ms per
    # direction, overlapping (the per-record bound adds them: 3 ms). Node 0: 3 tokens out
    # (dispatch) and 3 sums in (combine): 1.5 ms. GPU (0,0): 3 tokens out over 3 GB/s: 1 ms;
    # GPU (1,0): 3 copies in, 3 results out: 1 ms.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rec = torch.zeros(4, 2, 4, dtype=torch.int64)
    rec[0, 1, 0b11] = 3
    got = any_routing_bound(_counts(rec), topo, payload_bytes=ROW)
    assert got.node_nic_out_s == pytest.approx(1.5e-3) == got.node_nic_in_s
    assert got.gpu_out_s == pytest.approx(1e-3) == got.gpu_in_s
    assert got.bound_s == pytest.approx(1.5e-3) and got.resource.startswith("node NIC")
    assert not got.exact_tokens


def _hot_owner(n: int = 4, g: int = 4, tokens: int = 50) -> DemandCounts:
    # GPU (0,0) owns `tokens` tokens, each on GPU 1 of every other node (3 records a token);
    # nothing else moves. Per record it leaves its owner 3 * tokens times; any routing can send
    # each token once to GPU (0,1) and fan it out there.
    rec = torch.zeros(n * g, n, 1 << g, dtype=torch.int64)
    rec[0, 1:, 0b10] = tokens
    return _counts(rec)


def test_any_routing_is_strictly_lower_on_a_hot_owner():
    # 4 x 4, NVLink 4 GB/s + rail 12.5 GB/s = 16.5 GB/s per GPU, node NICs 50 GB/s. Per record:
    # GPU (0,0) sends 150 rows out, 9.09 ms a phase (node 0's NICs: 3 ms), 18.2 ms with the
    # barrier, 9.09 ms per rank. Any routing: GPU (0,0) 50 tokens out (3.03 ms), each GPU (d, 1)
    # 50 copies in and 50 results out (3.03 ms a direction), node 0 50 tokens out and 50 sums in
    # (1 ms a direction).
    topo = RailTopology(num_nodes=4, gpus_per_node=4, rail_gbps=100.0, nvlink_gBps=4.0)
    demand = _hot_owner()
    per = per_record_bound(demand, topo, payload_bytes=ROW)
    per_rank = per_record_bound(demand, topo, payload_bytes=ROW, phase_sync="rank")
    anyr = any_routing_bound(demand, topo, payload_bytes=ROW)
    assert per.resource == "GPU out (NVLink + NIC) (0, 0)"
    assert per.bound_s == pytest.approx(2 * 150 * ROW / 16.5e9)
    assert per_rank.bound_s == pytest.approx(150 * ROW / 16.5e9)
    assert anyr.gpu_out_s == pytest.approx(50 * ROW / 16.5e9) == anyr.gpu_in_s
    assert anyr.node_nic_out_s == pytest.approx(50 * ROW / 50e9) == anyr.node_nic_in_s
    assert anyr.bound_s == pytest.approx(50 * ROW / 16.5e9)
    assert anyr.resource.startswith("GPU")
    assert anyr.bound_s < 0.5 * per_rank.bound_s < 0.5 * per.bound_s


def _hot_owner_to_gpu1(n: int = 4, tokens: int = 60) -> DemandCounts:
    # 4 x 2: GPU (0,0) owns `tokens` tokens, each on GPU 1 of every other node.
    rec = torch.zeros(n * 2, n, 4, dtype=torch.int64)
    rec[0, 1:, 0b10] = tokens
    return _counts(rec)


def _proxy_fanout_program(topo, tokens: int, row: int, chunks: int = 10):
    """A routing no modelled path uses, on `_hot_owner_to_gpu1`: GPU (0,0) hands half of its
    tokens once to the proxy GPU (0,1) over NVLink, which sends each to GPU 1 of the three other
    nodes on rail 1 (fan-out from a proxy); the other half leaves on rail 0 to GPU (d, 0), which
    forwards it over NVLink to (d, 1). Combine runs the same hops backwards, the proxy summing a
    token's three results into one row for the owner. In ``chunks`` pipelined parts; a part's
    combine waits only for its own dispatch (no barrier)."""
    n = topo.num_nodes
    b = ProgramBuilder(fabric=fabric_for(topo, 1, 1.0))
    remote = np.arange(1, n)
    gpu0, gpu1 = 2 * remote, 2 * remote + 1
    one = np.ones(n - 1, dtype=np.int64)
    part = tokens // 2 // chunks * row  # bytes of one part of one half
    prev: tuple[tuple[int, ...], ...] = ((), (), (), ())  # each hop takes its parts in turn
    for c in range(chunks):
        a = b.phase(f"dispatch.first[{c}]", "relay", 0, prev[0])
        b.nvlink(a, np.array([0]), np.array([1]), np.array([part]))
        b.rail(a, 0 * one, gpu0, np.full(n - 1, part))
        f = b.phase(f"dispatch.second[{c}]", "rail", 0, (a, *prev[1]))
        b.rail(f, one, gpu1, np.full(n - 1, part))
        b.nvlink(f, gpu0, gpu1, np.full(n - 1, part))
        r = b.phase(f"combine.first[{c}]", "rail", 1, (f, *prev[2]))
        b.rail(r, gpu1, one, np.full(n - 1, part))
        b.nvlink(r, gpu1, gpu0, np.full(n - 1, part))
        s = b.phase(f"combine.second[{c}]", "relay", 1, (r, *prev[3]))
        b.nvlink(s, np.array([1]), np.array([0]), np.array([part]))  # the proxy's sums
        b.rail(s, gpu0, 0 * one, np.full(n - 1, part))
        prev = ((a,), (f,), (r,), (s,))
    return b.fabric, b.build()


def test_a_proxy_fanout_beats_the_per_record_bound_not_the_any_routing_bound():
    # 4 x 2, rails 12.5 GB/s, NVLink 5 GB/s. Per record GPU (0,0) sends 180 rows over 17.5 GB/s:
    # 10.3 ms even per rank. The proxy routing loads each rail with 90 rows (7.2 ms a direction)
    # and the owner's NVLink port with 30 (6 ms): 9.36 ms on the flow model (7.2 ms plus the
    # fill and drain of the 10-part pipeline), below the per-record bound; the any-routing bound
    # (60 rows on the owner's 17.5 GB/s: 3.4 ms) stays below it.
    topo = RailTopology(num_nodes=4, gpus_per_node=2, rail_gbps=100.0, nvlink_gBps=5.0)
    demand = _hot_owner_to_gpu1(tokens=60)
    fabric, program = _proxy_fanout_program(topo, 60, ROW)
    run = run_program(fabric, program, incast=IncastModel(), rel_tol=0.0)
    per = per_record_bound(demand, topo, payload_bytes=ROW, phase_sync="rank")
    anyr = any_routing_bound(demand, topo, payload_bytes=ROW)
    assert per.bound_s == pytest.approx(180 * ROW / 17.5e9)
    assert anyr.bound_s == pytest.approx(60 * ROW / 17.5e9)
    assert anyr.bound_s <= run.total_s < per.bound_s
    assert run.total_s == pytest.approx(9.36e-3, rel=1e-6)


def _ids_demand(topo, num_experts, seed, tokens=24, topk=3):
    rng = np.random.default_rng(seed)
    w = topo.world_size
    ids = np.stack(
        [
            np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(tokens)])
            for _ in range(w)
        ]
    )
    ids[:, : tokens // 4, -1] = -1  # some tokens with fewer slots
    return ids, demand_from_topk_ids(torch.from_numpy(ids), topo, num_experts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_owner_tokens_tighten_the_estimate_and_stay_below_per_record(seed):
    topo = RailTopology(num_nodes=3, gpus_per_node=2, rail_gbps=100.0, nvlink_gBps=40.0)
    ids, demand = _ids_demand(topo, 12, seed)
    tokens = owner_tokens_from_topk_ids(ids, topo, 12)
    # By hand: a token leaves its owner GPU (node) when one of its experts is elsewhere.
    rank_of = ids // 2
    valid = ids >= 0
    own = np.arange(6)[:, None, None]
    assert (tokens.leave_gpu_W == (valid & (rank_of != own)).any(-1).sum(-1)).all()
    assert (tokens.leave_node_W == (valid & (rank_of // 2 != own // 2)).any(-1).sum(-1)).all()
    estimate = any_routing_bound(demand, topo, payload_bytes=ROW)
    exact = any_routing_bound(demand, topo, payload_bytes=ROW, tokens=tokens)
    assert exact.exact_tokens
    assert estimate.bound_s <= exact.bound_s * (1 + 1e-12)
    assert (
        exact.bound_s
        <= per_record_bound(demand, topo, payload_bytes=ROW, phase_sync="rank").bound_s
    )
    assert exact.bound_s <= per_record_bound(demand, topo, payload_bytes=ROW).bound_s


def test_owner_tokens_below_the_records_are_rejected():
    topo = RailTopology(num_nodes=4, gpus_per_node=4, rail_gbps=100.0, nvlink_gBps=4.0)
    few = OwnerTokens(leave_gpu_W=np.zeros(16, np.int64), leave_node_W=np.zeros(16, np.int64))
    with pytest.raises(ValueError, match="fewer tokens than its records into one node"):
        any_routing_bound(_hot_owner(), topo, payload_bytes=ROW, tokens=few)


_FAILED = st.sampled_from([None, (0, 0), (1, 1)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([2, 3, 4]),
    g=st.sampled_from([2, 4]),
    density=st.floats(0.05, 0.6),
    skew=st.integers(1, 6),
    nvlink=st.sampled_from([4.0, 40.0]),
    adapters=st.booleans(),
    failed=_FAILED,
)
def test_any_routing_never_above_per_record(seed, n, g, density, skew, nvlink, adapters, failed):
    extra = (
        {"adapter_of_rail": [r // 2 for r in range(g)], "adapter_gbps": 150.0} if adapters else {}
    )
    if failed is not None:
        extra["failed_rails"] = frozenset({failed})
    topo = RailTopology(num_nodes=n, gpus_per_node=g, rail_gbps=100.0, nvlink_gBps=nvlink, **extra)
    demand = random_demand(n, g, seed, density, skew)
    anyr = any_routing_bound(demand, topo, payload_bytes=4096)
    for sync in ("global", "rank"):
        per = per_record_bound(demand, topo, payload_bytes=4096, phase_sync=sync)
        assert anyr.bound_s <= per.bound_s * (1 + 1e-12), (sync, anyr, per)
    assert anyr.bound_s == max(
        anyr.node_nic_out_s, anyr.node_nic_in_s, anyr.gpu_out_s, anyr.gpu_in_s
    )


# Every route with its one-pass options and, where the route has waves, more senders per wave
# and rail chunks; the relaying routes also with a streamed relay (JOINT / FLOW_WAVES over their
# waves, RAIL / FLOW over two chunks); new routes join through names.ROUTES.
_STREAMED = {
    Route.JOINT: PlanOptions(streamed=True),
    Route.FLOW_WAVES: PlanOptions(streamed=True),
    Route.RAIL: PlanOptions(chunks=2, streamed=True),
    Route.FLOW: PlanOptions(chunks=2, streamed=True),
}
_VARIANTS = [
    (route, options)
    for route in ROUTES
    for options in (
        [PlanOptions()]
        + ([_STREAMED[route]] if route in _STREAMED else [])
        + (
            [PlanOptions(fanin=2), PlanOptions(chunks=2)]
            if route in (Route.PERM, Route.JOINT)
            else []
        )
    )
]


def _modelled_times(demand, topo, windows, model):
    """(name, seconds) of every route variant and peer on ``demand``."""
    for route, options in _VARIANTS:
        plan = build_plan(demand, topo, route, options=replace(options, windows=windows))
        t = execute_plan(plan, record_bytes=4096, model=model, demand=demand).total_s
        yield f"{route} {options.fanin}/{options.chunks}{'/streamed' * plan.streamed}", t
    for peer in PEERS:
        yield (
            peer,
            model_peer(peer, demand, topo, record_bytes=4096, model=model, repeats=0)["comm_s"],
        )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.sampled_from([2, 3, 4]),
    g=st.sampled_from([2, 4]),
    density=st.floats(0.05, 0.6),
    skew=st.integers(1, 6),
    pattern=st.sampled_from(["none", "ring", "extreme"]),
    variant=st.sampled_from(sorted(MODELS)),
    alpha=st.sampled_from([0.0, 0.3]),
    nvlink=st.sampled_from([4.0, 40.0]),
)
def test_no_modelled_time_below_either_bound(
    seed, n, g, density, skew, pattern, variant, alpha, nvlink
):
    topo = RailTopology(num_nodes=n, gpus_per_node=g, rail_gbps=100.0, nvlink_gBps=nvlink)
    demand = random_demand(n, g, seed, density, skew, consistent_experts=True)
    if not int(demand.records_WN.sum()):
        return
    windows = None
    if pattern != "none" and n >= 3:
        demand, windows = arrange(demand, pattern, topo)
    model = replace(MODELS[variant], alpha=alpha)
    per = per_record_bound(demand, topo, payload_bytes=4096, phase_sync=model.phase_sync)
    anyr = any_routing_bound(demand, topo, payload_bytes=4096)
    for name, t in _modelled_times(demand, topo, windows, model):
        assert t >= per.bound_s * (1 - 1e-9), (name, t, per)
        assert t >= anyr.bound_s * (1 - 1e-9), (name, t, anyr)
