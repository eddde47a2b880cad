"""Record routes, stage-3 delivery counts and per-rank split sizes against a record-by-record
simulation of the three stages (see conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_railwave.names import ROUTES
from megatron_railwave.planner import (
    PlanOptions,
    build_plan,
    delivery_copies_NGG,
    rank_splits,
    route_records,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import target_masks

PATHS = tuple(map(str, ROUTES))

# Hand case: 2 nodes x 2 GPUs; only rank 0 = GPU (0, 0) has records.
#   token: 0        1        2        3        4
#   node 1 mask 2   mask 1   mask 3   -        mask 2
#   node 0 -        -        -        mask 2   -
HAND_TOPO = RailTopology(num_nodes=2, gpus_per_node=2)
HAND_MASKS = [
    torch.tensor([[0, 2], [0, 1], [0, 3], [2, 0], [0, 2]]),
    torch.zeros(5, 2, dtype=torch.int64),
    torch.zeros(5, 2, dtype=torch.int64),
    torch.zeros(5, 2, dtype=torch.int64),
]


def test_route_records_canonical_order_and_proxy_hand_case(sim_tools):
    demand_from_masks, _ = sim_tools
    demand = demand_from_masks(HAND_MASKS, HAND_TOPO)
    plan = build_plan(demand, HAND_TOPO, "rail")
    # (0 -> 1): 4 records owned by GPU 0 -> quota [2, 2]; GPU 0 keeps 2, GPU 1 is the proxy of 2.
    assert plan.quota_NNG[0, 1].tolist() == [2, 2]
    r = route_records(plan, 0, HAND_MASKS[0])
    # order: node 0 first; then node 1 by (mask, token): (1, t1), (2, t0), (2, t4), (3, t2).
    assert r.token_R.tolist() == [3, 1, 0, 4, 2]
    assert r.node_R.tolist() == [0, 1, 1, 1, 1]
    assert r.mask_R.tolist() == [2, 1, 2, 2, 3]
    # the first keep = 2 records of the pair stay, the rest go to the proxy in order
    assert r.egress_R.tolist() == [0, 0, 0, 1, 1]
    assert r.wave_R.tolist() == [-1, 0, 0, 0, 0]


def test_delivery_copies_hand_case(sim_tools):
    demand_from_masks, _ = sim_tools
    demand = demand_from_masks(HAND_MASKS, HAND_TOPO)
    plan = build_plan(demand, HAND_TOPO, "rail")
    # Into node 1 from node 0: GPU (1, 0) receives t1 (mask 1 -> GPU 0) and t0 (mask 2 -> GPU 1);
    # GPU (1, 1) receives t4 (mask 2 -> GPU 1) and t2 (mask 3 -> GPUs 0 and 1).
    assert delivery_copies_NGG(plan, demand, 1)[0].tolist() == [[1, 1], [1, 2]]
    # Into node 0 (local): owner GPU 0 holds t3 with mask 2 -> one copy to GPU 1.
    assert delivery_copies_NGG(plan, demand, 0)[0].tolist() == [[0, 1], [0, 0]]
    # NATIVE: no proxy, GPU (1, 0) receives all four records: copies to GPU 0: t1, t2; to GPU 1: t0,
    # t2, t4.
    native = build_plan(demand, HAND_TOPO, "native")
    assert delivery_copies_NGG(native, demand, 1)[0].tolist() == [[2, 3], [0, 0]]


def test_route_records_mismatched_counts_raise(sim_tools):
    demand_from_masks, _ = sim_tools
    plan = build_plan(demand_from_masks(HAND_MASKS, HAND_TOPO), HAND_TOPO, "joint")
    changed = HAND_MASKS[0].clone()
    changed[3, 0] = 0  # one record fewer than counted
    with pytest.raises(ValueError, match=r"rank 0: its routing does not match the gathered counts"):
        route_records(plan, 0, changed)


def _random_masks(topo: RailTopology, num_tokens: int, seed: int) -> list[torch.Tensor]:
    """Target masks of every rank from random top-3 routing over 2 experts per rank."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = 2 * topo.world_size
    out = []
    for _ in range(topo.world_size):
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        routing.scatter_(1, scores.topk(min(3, num_experts), dim=1).indices, True)
        out.append(target_masks(routing, topo))
    return out


CASES = [
    # (nodes, gpus, failed rails, fanin, phase)
    (3, 4, {(1, 2)}, 1, 0),
    (4, 3, {(0, 0), (3, 2)}, 2, 5),
    (1, 4, set(), 1, 0),
    (3, 1, set(), 1, 1),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("n", "g", "failed", "fanin", "phase"), CASES)
def test_three_stages_match_plan_splits_and_delivery_counts(
    sim_tools, path, n, g, failed, fanin, phase
):
    demand_from_masks, simulate = sim_tools
    topo = RailTopology(num_nodes=n, gpus_per_node=g, failed_rails=frozenset(failed))
    masks = _random_masks(topo, num_tokens=10, seed=n * 10 + g)
    demand = demand_from_masks(masks, topo)
    plan = build_plan(demand, topo, path, options=PlanOptions(fanin=fanin), phase=phase)
    sim = simulate(plan, masks)

    # Every record routed once, and every target GPU in its mask gets exactly one copy.
    expected = {(w, t, d) for w, m in enumerate(masks) for t, d in torch.nonzero(m).tolist()}
    assert set(sim.records) == expected and set(sim.records.values()) <= {1}
    want = {
        (w, t, d, j) for (w, t, d) in expected for j in range(g) if int(masks[w][t, d]) >> j & 1
    }
    assert set(sim.delivered) == want and set(sim.delivered.values()) == ({1} if want else set())

    # Stage 1 and 2 counts are the plan's relay and quota.
    for s, d, o, l in itertools.product(range(n), range(n), range(g), range(g)):
        if s != d:
            assert sim.relay[(s, d, o, l)] == int(plan.relay_NNGG[s, d, o, l])
    for s, d, l in itertools.product(range(n), range(n), range(g)):
        if s != d:
            assert sum(sim.rail[(s, l, d, v)] for v in range(plan.num_waves)) == int(
                plan.quota_NNG[s, d, l]
            )

    # Stage 3 counts follow from the mask histogram alone.
    for d in range(n):
        brute = torch.zeros(n, g, g, dtype=torch.int64)
        for (dd, arrive, j, s, _), c in sim.deliver.items():
            if dd == d:
                brute[s, arrive, j] += c
        assert torch.equal(delivery_copies_NGG(plan, demand, d), brute)

    # Split sizes: brute force, and what rank a sends to rank b is what b expects from a.
    splits = [rank_splits(plan, demand, w) for w in range(topo.world_size)]
    rounds = plan.num_waves + 1  # round 0: local records; round v + 1: wave v
    for w, sp in enumerate(splits):
        s, me = topo.node_of(w), topo.local_of(w)
        assert sp.num_rounds == rounds
        assert sp.relay_send_G == [
            0 if l == me else sum(sim.relay[(s, d, me, l)] for d in range(n)) for l in range(g)
        ]
        assert sp.relay_recv_G == [
            0 if o == me else sum(sim.relay[(s, d, o, me)] for d in range(n)) for o in range(g)
        ]
        assert sp.rail_send_VN == [
            [sim.rail[(s, me, d, v)] for d in range(n)] for v in range(plan.num_waves)
        ]
        assert sp.rail_recv_VN == [
            [sim.rail[(x, me, s, v)] for x in range(n)] for v in range(plan.num_waves)
        ]
        assert sp.deliver_send_VG == [
            [sum(sim.deliver[(s, me, j, x, v)] for x in range(n)) for j in range(g)]
            for v in range(rounds)
        ]
        assert sp.deliver_recv_VG == [
            [sum(sim.deliver[(s, l, me, x, v)] for x in range(n)) for l in range(g)]
            for v in range(rounds)
        ]
    for a, b in itertools.product(range(topo.world_size), repeat=2):
        (sa, la), (sb, lb) = (
            (topo.node_of(a), topo.local_of(a)),
            (topo.node_of(b), topo.local_of(b)),
        )
        if sa == sb and a != b:
            assert splits[a].relay_send_G[lb] == splits[b].relay_recv_G[la]
            for v in range(rounds):
                assert splits[a].deliver_send_VG[v][lb] == splits[b].deliver_recv_VG[v][la]
        if la == lb:
            for v in range(plan.num_waves):
                assert splits[a].rail_send_VN[v][sb] == splits[b].rail_recv_VN[v][sa]
