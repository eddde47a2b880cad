"""Property tests over random topologies (2-16 nodes, 1-8 GPUs, failed rails) and routing.

Invariants, for every path (NATIVE, RAIL, PERM, JOINT):
  * every record is routed once, on a rail that is healthy at both ends, and the stage counts
    are the plan's (relay, quota, delivery copies from the mask histogram);
  * RAIL / JOINT: per-rail counts of each remote node pair differ by at most one;
  * PERM / JOINT: at most f remote senders per receiver per wave (f = 1: the cyclic schedule);
  * every ordered remote pair is in exactly one wave;
  * the same inputs give the same plan.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_railwave.names import Route
from megatron_railwave.planner import (
    EligiblePolicy,
    PlanOptions,
    all_at_once,
    bounded_fanin_schedule,
    build_plan,
    delivery_copies_NGG,
    eligible_NNG,
    rank_splits,
    route_records,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, mask_bits

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def topologies(draw, max_nodes: int = 16) -> RailTopology:
    n = draw(st.integers(2, max_nodes))
    g = draw(st.integers(1, 8))
    # One rail stays healthy on every node, so every node pair keeps a path; any other rail may
    # fail.
    spine = draw(st.integers(0, g - 1))
    candidates = [(node, rail) for node in range(n) for rail in range(g) if rail != spine]
    failed = draw(st.sets(st.sampled_from(candidates), max_size=8)) if candidates else set()
    return RailTopology(num_nodes=n, gpus_per_node=g, failed_rails=frozenset(failed))


def make_case(
    topo: RailTopology,
    *,
    num_tokens: int,
    density: float,
    seed: int,
    policy: EligiblePolicy,
    fanin: int,
    phase: int,
):
    """(topology, per-rank [T, N] target masks, demand, plan options, phase) from a seed."""
    gen = torch.Generator().manual_seed(seed)
    n, g = topo.num_nodes, topo.gpus_per_node
    w = topo.world_size
    masks = torch.randint(1, 1 << g, (w, num_tokens, n), generator=gen)
    masks *= torch.rand(w, num_tokens, n, generator=gen) < density
    keys = torch.arange(n) * (1 << g) + masks  # [W, T, N]
    records_WNM = torch.zeros(w, n << g, dtype=torch.int64)
    records_WNM.scatter_add_(1, keys.reshape(w, -1), torch.ones_like(keys.reshape(w, -1)))
    records_WNM = records_WNM.view(w, n, 1 << g)
    records_WNM[:, :, 0] = 0
    demand = DemandCounts(records_WNM=records_WNM, experts_WE=torch.zeros(w, 1, dtype=torch.int64))
    rail_mask = torch.rand(n, g, generator=gen) < 0.5 if policy == EligiblePolicy.MASK else None
    options = PlanOptions(policy=policy, rail_mask_NG=rail_mask, fanin=fanin)
    return topo, list(masks), demand, options, phase


@st.composite
def workloads(draw, max_nodes: int = 16):
    return make_case(
        draw(topologies(max_nodes)),
        num_tokens=draw(st.integers(1, 8)),
        density=draw(st.sampled_from([0.2, 0.6, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        policy=draw(st.sampled_from(list(EligiblePolicy))),
        fanin=draw(st.integers(1, 3)),
        phase=draw(st.integers(0, 40)),
    )


# Always-run corners: the largest topology with failed rails, one GPU per node, two nodes.
_FAILED_16x8 = frozenset({(0, 1), (3, 0), (3, 7), (7, 2), (15, 6), (15, 5)})
CORNERS = [
    make_case(
        RailTopology(num_nodes=16, gpus_per_node=8, failed_rails=_FAILED_16x8),
        num_tokens=8,
        density=0.6,
        seed=1,
        policy=EligiblePolicy.ALL,
        fanin=1,
        phase=3,
    ),
    make_case(
        RailTopology(num_nodes=16, gpus_per_node=8, failed_rails=_FAILED_16x8),
        num_tokens=4,
        density=1.0,
        seed=2,
        policy=EligiblePolicy.ACTIVE,
        fanin=4,
        phase=0,
    ),
    make_case(
        RailTopology(num_nodes=5, gpus_per_node=1),
        num_tokens=3,
        density=0.6,
        seed=3,
        policy=EligiblePolicy.ALL,
        fanin=2,
        phase=1,
    ),
    make_case(
        RailTopology(num_nodes=2, gpus_per_node=8, failed_rails=frozenset({(1, 3)})),
        num_tokens=6,
        density=0.2,
        seed=4,
        policy=EligiblePolicy.MASK,
        fanin=1,
        phase=7,
    ),
]


def _with_corners(test):
    for case in CORNERS:
        test = example(case)(test)
    return test


def _pair_eligible_NNG(topo: RailTopology) -> torch.Tensor:
    n = topo.num_nodes
    return torch.tensor([[topo.pair_gpu_eligible(s, d) for d in range(n)] for s in range(n)])


@SETTINGS
@_with_corners
@given(workloads())
def test_every_record_delivered_once_on_healthy_rails(case):
    topo, masks, demand, options, phase = case
    n, g = topo.num_nodes, topo.gpus_per_node
    healthy_NNG = _pair_eligible_NNG(topo)
    bits = mask_bits(g)
    w = topo.world_size
    # every record of every rank, as flat [n_rec] tensors of (rank, token, node)
    rank_all, token_all, node_all = torch.nonzero(torch.stack(masks), as_tuple=True)
    expected = (rank_all * 64 + token_all) * n + node_all  # unique record ids, T <= 8 < 64
    for path in Route:
        plan = build_plan(demand, topo, path, options=options, phase=phase)
        routes = [route_records(plan, rank, masks[rank]) for rank in range(w)]
        counts = torch.tensor([r.token_R.numel() for r in routes])
        rank_R = torch.repeat_interleave(torch.arange(w), counts)
        token_R, node_R, mask_R, egress_R, wave_R = (
            torch.cat([getattr(r, k) for r in routes])
            for k in ("token_R", "node_R", "mask_R", "egress_R", "wave_R")
        )
        src_R, own_R = rank_R // g, rank_R % g
        # exactly the records of the routing, each once, with its own mask
        ids = (rank_R * 64 + token_R) * n + node_R
        assert torch.equal(torch.sort(ids).values, torch.sort(expected).values)
        assert torch.equal(mask_R, torch.stack(masks)[rank_R, token_R, node_R])
        remote = node_R != src_R
        assert bool(healthy_NNG[src_R[remote], node_R[remote], egress_R[remote]].all()), (
            "failed rail used"
        )
        assert bool((egress_R[~remote] == own_R[~remote]).all()) and bool(
            (wave_R[~remote] == -1).all()
        )
        assert torch.equal(wave_R[remote], plan.pair_wave_NN[src_R[remote], node_R[remote]])
        ones = torch.ones_like(rank_R)
        sent_NNG = torch.zeros(n, n, g, dtype=torch.int64).index_put_(
            (src_R, node_R, egress_R), ones, accumulate=True
        )
        relay_NNGG = torch.zeros(n, n, g, g, dtype=torch.int64).index_put_(
            (src_R, node_R, own_R, egress_R), ones, accumulate=True
        )
        assert torch.equal(sent_NNG, plan.quota_NNG)
        assert torch.equal(relay_NNGG, plan.relay_NNGG)
        # stage 3: copies into node d by (source node, arriving GPU, target GPU)
        copies_DNGG = torch.zeros(n, n, g, g, dtype=torch.int64).index_put_(
            (node_R, src_R, egress_R), bits[mask_R], accumulate=True
        )
        for d in range(n):
            assert torch.equal(delivery_copies_NGG(plan, demand, d), copies_DNGG[d])


@SETTINGS
@_with_corners
@given(workloads())
def test_balanced_paths_per_rail_counts_within_one(case):
    topo, _, demand, options, phase = case
    n = topo.num_nodes
    for path in (Route.RAIL, Route.JOINT):
        plan = build_plan(demand, topo, path, options=options, phase=phase)
        eligible = eligible_NNG(topo, plan.records_NNG, options.policy, options.rail_mask_NG)
        load_NRN = plan.rail_load_NRN()
        for s in range(n):
            for d in range(n):
                if s == d:
                    continue
                rails = load_NRN[s, :, d][eligible[s, d]]  # identity rails: GPU l on rail l
                assert int(rails.max() - rails.min()) <= 1
                assert int(load_NRN[s, :, d][~eligible[s, d]].sum()) == 0
                assert int(rails.sum()) == int(plan.records_NNG[s, d].sum())


@SETTINGS
@_with_corners
@given(workloads())
def test_waved_paths_bound_senders_per_receiver_per_wave(case):
    topo, _, demand, options, phase = case
    n, f = topo.num_nodes, options.fanin
    for path in (Route.PERM, Route.JOINT):
        plan = build_plan(demand, topo, path, options=options, phase=phase)
        assert plan.num_waves == -(-(n - 1) // f)
        for v in range(plan.num_waves):
            in_wave = plan.pair_wave_NN == v  # [s, d]
            assert int(in_wave.sum(dim=0).max()) <= f and int(in_wave.sum(dim=1).max()) <= f
            if f == 1:
                assert in_wave.sum(dim=0).tolist() == [1] * n  # one-to-one
            # per receiver port (d, l): remote sender nodes with records on that rail in wave v
            senders_NG = ((plan.quota_NNG > 0) & in_wave.unsqueeze(-1)).sum(dim=0)
            assert int(senders_NG.max()) <= f


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(1, 8))
def test_every_ordered_remote_pair_exactly_once(n, f):
    for sched in (bounded_fanin_schedule(n, f), all_at_once(n)):
        pairs = [p for wave in sched.waves for p in wave]
        assert len(pairs) == len(set(pairs)) == n * (n - 1)
        table = sched.pair_wave_NN()
        off = ~torch.eye(n, dtype=torch.bool)
        assert bool((table[off] >= 0).all()) and bool((table[off] < max(sched.num_waves, 1)).all())
        assert bool((table.diagonal() == -1).all())


@SETTINGS
@given(workloads(max_nodes=8))
def test_same_inputs_same_plan(case):
    topo, masks, demand, options, phase = case
    twin = DemandCounts(
        records_WNM=demand.records_WNM.clone(), experts_WE=demand.experts_WE.clone()
    )
    for path in Route:
        a = build_plan(demand, topo, path, options=options, phase=phase)
        b = build_plan(twin, topo, path, options=options, phase=phase)
        for field in ("records_NNG", "quota_NNG", "relay_NNGG", "pair_wave_NN"):
            assert torch.equal(getattr(a, field), getattr(b, field))
        assert a.schedule == b.schedule
        rank = topo.world_size - 1
        ra, rb = route_records(a, rank, masks[rank]), route_records(b, rank, masks[rank].clone())
        for k in ("token_R", "node_R", "mask_R", "egress_R", "wave_R"):
            assert torch.equal(getattr(ra, k), getattr(rb, k))
        assert rank_splits(a, demand, rank) == rank_splits(b, twin, rank)
