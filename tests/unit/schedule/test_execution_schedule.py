"""ExecutionSchedule: phases and dependencies, transfers against a record-by-record simulation,
mirrored combine, wire format bytes, rank views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_railwave.names import ROUTES
from megatron_railwave.planner import PlanOptions, build_plan, chunk_arrival_counts, chunk_sizes
from megatron_railwave.schedule import (
    Direction,
    PhaseKind,
    RecordWireFormat,
    compile_schedule,
    rank_view,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

PATHS = tuple(map(str, ROUTES))
WIRE = RecordWireFormat(
    hidden=8, payload_dtype=torch.bfloat16, probs_dtype=torch.float32, experts_per_node=40
)


def _random_demand(
    topo: RailTopology, seed: int, tokens: int = 30, experts: int = 0, topk: int = 3
) -> DemandCounts:
    gen = torch.Generator().manual_seed(seed)
    experts = experts or 2 * topo.world_size
    maps = []
    for _ in range(topo.world_size):
        idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
        maps.append(torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True))
    return DemandCounts.from_routing_maps(maps, topo)


def test_wire_format_bytes_hand_computed():
    # payload 8 x bf16 = 16 B; probs 40 x fp32 = 160 B; meta = 2 + ceil(40 / 32) = 4 int32 = 16 B.
    assert WIRE.meta_words == 4
    assert WIRE.payload_bytes == 16
    assert WIRE.dispatch_bytes == 16 + 160 + 16
    assert WIRE.combine_bytes == 16
    assert WIRE.dispatch_grad_bytes == 16 + 160


def test_phase_order_and_dependencies_three_waves():
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    plan = build_plan(_random_demand(topo, 0), topo, "joint")
    sched = compile_schedule(plan, WIRE)
    names = [p.name for p in sched.phases]
    assert names == [
        "dispatch.relay",
        "dispatch.deliver[0]",
        "dispatch.rail[0]",
        "dispatch.rail[1]",
        "dispatch.deliver[1]",
        "dispatch.rail[2]",
        "dispatch.deliver[2]",
        "dispatch.deliver[3]",
        "combine.deliver[0]",
        "combine.deliver[1]",
        "combine.rail[0]",
        "combine.deliver[2]",
        "combine.rail[1]",
        "combine.deliver[3]",
        "combine.rail[2]",
        "combine.relay",
    ]
    deps = {p.name: sorted(sched.phases[d].name for d in p.depends_on) for p in sched.phases}
    assert deps["dispatch.rail[0]"] == ["dispatch.relay"]
    assert deps["dispatch.rail[2]"] == ["dispatch.rail[1]"]
    assert deps["dispatch.deliver[0]"] == []
    assert deps["dispatch.deliver[2]"] == ["dispatch.deliver[1]", "dispatch.rail[1]"]
    assert deps["combine.rail[1]"] == ["combine.deliver[2]", "combine.rail[0]"]
    # Combine's local round overlaps the waves, as dispatch's does; later rounds stay in order.
    assert deps["combine.deliver[0]"] == [] and deps["combine.deliver[1]"] == []
    assert deps["combine.deliver[2]"] == ["combine.deliver[1]"]
    assert deps["combine.relay"] == ["combine.rail[2]"]
    for p in (
        sched.phases
    ):  # every dependency is posted earlier: the posting order is a topological order
        assert all(d < p.index for d in p.depends_on)
        assert (p.mirror_of is None) == (p.direction == Direction.DISPATCH)
        assert p.group == ("rail" if p.kind == PhaseKind.RAIL else "node")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("failed", [frozenset(), frozenset({(2, 1)})])
def test_transfers_match_record_simulation(path, failed, sim_tools):
    demand_from_masks, simulate = sim_tools
    topo = RailTopology(num_nodes=3, gpus_per_node=3, failed_rails=failed)
    gen = torch.Generator().manual_seed(5)
    masks = [torch.randint(0, 8, (25, 3), generator=gen) for _ in range(topo.world_size)]
    demand = demand_from_masks(masks, topo)
    plan = build_plan(demand, topo, path)
    sched = compile_schedule(plan, WIRE, demand=demand)
    sim = simulate(plan, masks)
    g = topo.gpus_per_node
    relay = sched.phase("dispatch", "relay")
    src, dst, rows = sched.transfers(relay)
    got = {(int(s) // g, int(s) % g, int(d) % g): int(r) for s, d, r in zip(src, dst, rows)}
    want: dict = {}
    for (s, _d, owner, egress), c in sim.relay.items():
        if owner != egress:
            want[(s, owner, egress)] = want.get((s, owner, egress), 0) + c
    assert got == want
    for v in range(plan.num_waves):
        src, dst, rows = sched.transfers(sched.phase("dispatch", "rail", v))
        got = {(int(s) // g, int(s) % g, int(d) // g): int(r) for s, d, r in zip(src, dst, rows)}
        want = {(s, e, d): c for (s, e, d, w), c in sim.rail.items() if w == v and c}
        assert got == want, v
    for rnd in range(plan.num_waves + 1):
        src, dst, rows = sched.transfers(sched.phase("dispatch", "deliver", rnd))
        got = {(int(s) // g, int(s) % g, int(d) % g): int(r) for s, d, r in zip(src, dst, rows)}
        want = {}
        for (d, arrive, target, _s, r), c in sim.deliver.items():
            if r == rnd and c:
                want[(d, arrive, target)] = want.get((d, arrive, target), 0) + c
        assert got == want, rnd


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("path", PATHS)
def test_combine_mirrors_dispatch_and_rank_views_add_up(path, chunks):
    topo = RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)}))
    demand = _random_demand(topo, 3)
    plan = build_plan(demand, topo, path, options=PlanOptions(chunks=chunks))
    sched = compile_schedule(plan, WIRE, demand=demand)
    for p in sched.combine_phases():
        src, dst, rows = sched.transfers(p)
        m_src, m_dst, m_rows = sched.transfers(sched.phases[p.mirror_of])
        assert torch.equal(src, m_dst) and torch.equal(dst, m_src) and torch.equal(rows, m_rows)
    views = [rank_view(sched, r) for r in range(topo.world_size)]
    for p in sched.phases:
        sent = sum(sum(v.counts(p).send_Q) for v in views)
        received = sum(sum(v.counts(p).recv_Q) for v in views)
        assert sent == received == int(sched.transfers(p)[2].sum()), p.name
    for v in views:
        # Rail transfers of one rank cover exactly its egress rows, each node pair in its wave.
        rail = [v.counts(p).send_Q for p in sched.dispatch_phases() if p.kind == PhaseKind.RAIL]
        assert [sum(col) for col in zip(*rail)] == v.egress_N
        assert v.num_records == int(plan.records_NNG[v.node, :, v.local].sum())


def test_rank_bytes_sum_and_self_copies_excluded():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    demand = _random_demand(topo, 9)
    plan = build_plan(demand, topo, "rail")
    sched = compile_schedule(plan, WIRE, demand=demand)
    per_rank = [sched.rank_bytes(r) for r in range(topo.world_size)]
    rows = sched.wire_rows_P().tolist()
    for p in sched.phases:
        sent = sum(b["sent"][p.index] for b in per_rank)
        assert (
            sent
            == sum(b["received"][p.index] for b in per_rank)
            == rows[p.index] * sched.row_bytes(p)
        )
    deliver = sched.phase("dispatch", "deliver", 1)
    src, dst, r = sched.transfers(deliver)
    assert (
        rows[deliver.index] == int(r[src != dst].sum()) < int(r.sum())
    )  # some copies stay on their GPU


def test_rank_view_needs_its_node_deliveries():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    plan = build_plan(_random_demand(topo, 1), topo, "native")
    with pytest.raises(ValueError, match="compiled without node 0's deliveries"):
        rank_view(compile_schedule(plan, WIRE), 0)


def _pair_rows(sched, phase) -> dict[tuple[int, int], int]:
    src, dst, rows = sched.transfers(phase)
    out: dict[tuple[int, int], int] = {}
    for s, d, r in zip(src.tolist(), dst.tolist(), rows.tolist()):
        out[(s, d)] = out.get((s, d), 0) + r
    return out


@pytest.mark.parametrize("chunks", [2, 3, 5])
@pytest.mark.parametrize("path", ["perm", "joint"])
def test_rail_chunks_split_every_wave_and_its_delivery(path, chunks):
    """Wave v's chunk k is rail[v * c + k]; its rows per rail are chunk_sizes of the quota, and
    the chunks of a wave (and their delivery rounds) add up to the whole wave's transfers."""
    topo = RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)}))
    demand = _random_demand(topo, 11, tokens=23)
    whole = compile_schedule(build_plan(demand, topo, path), WIRE, demand=demand)
    plan = build_plan(demand, topo, path, options=PlanOptions(chunks=chunks))
    sched = compile_schedule(plan, WIRE, demand=demand)
    assert (
        plan.chunks == chunks
        and sched.num_waves == plan.num_waves * chunks == whole.num_waves * chunks
    )
    assert sched.wire_rows_P().sum() == whole.wire_rows_P().sum()
    g = topo.gpus_per_node
    for v in range(plan.num_waves):
        want = _pair_rows(whole, whole.phase("dispatch", "rail", v))
        parts = [
            _pair_rows(sched, sched.phase("dispatch", "rail", v * chunks + k))
            for k in range(chunks)
        ]
        for (s, d), rows in want.items():
            assert [p.get((s, d), 0) for p in parts] == chunk_sizes(rows, chunks).tolist(), (
                v,
                s,
                d,
            )
            assert s % g == d % g  # on one rail
        assert set().union(*parts) <= set(want)
        delivered = _pair_rows(whole, whole.phase("dispatch", "deliver", v + 1))
        got: dict = {}
        for k in range(chunks):
            for key, rows in _pair_rows(
                sched, sched.phase("dispatch", "deliver", v * chunks + k + 1)
            ).items():
                got[key] = got.get(key, 0) + rows
        assert got == delivered, v
    assert _pair_rows(sched, sched.phase("dispatch", "deliver", 0)) == _pair_rows(
        whole, whole.phase("dispatch", "deliver", 0)
    )


def test_rail_chunks_leave_native_and_rail_whole():
    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    demand = _random_demand(topo, 2)
    for path in ("native", "rail"):
        assert build_plan(demand, topo, path, options=PlanOptions(chunks=4)).chunks == 1
    one_node = RailTopology(num_nodes=1, gpus_per_node=2)
    assert (
        build_plan(
            _random_demand(one_node, 2), one_node, "joint", options=PlanOptions(chunks=4)
        ).chunks
        == 1
    )  # one node: no waves
    with pytest.raises(ValueError, match=r"chunks must be an integer in 1..64"):
        PlanOptions(chunks=0)


def test_chunk_arrival_counts_cut_each_block_in_order():
    rng = np.random.default_rng(0)
    arrival = rng.integers(0, 4, size=(5, 3, 8))
    for chunks in (1, 2, 3, 7):
        cut = chunk_arrival_counts(arrival, chunks)  # [N, c, G, M]
        assert (cut.sum(axis=1) == arrival).all()
        assert (
            cut.reshape(5, chunks, -1).sum(axis=2)
            == chunk_sizes(arrival.reshape(5, -1).sum(axis=1), chunks)
        ).all()
        # Chunk k takes a contiguous run of the (owner, mask) order: once a later chunk holds a
        # cell's records, no earlier chunk holds any of a later cell.
        flat = cut.reshape(5, chunks, -1)
        for n in range(5):
            last = -1
            for k in range(chunks):
                cells = np.flatnonzero(flat[n, k])
                if cells.size:
                    assert cells[0] >= last
                    last = cells[-1]


@pytest.mark.parametrize(
    "payload,probs,want",
    [
        (torch.bfloat16, torch.float32, 8336),
        (torch.bfloat16, torch.bfloat16, 8272),
        (torch.float32, torch.float32, 16528),
    ],
)
def test_dispatch_rows_are_16_byte_multiples_at_glm_size(payload, probs, want):
    # GLM-4.5-Air on 4 x 8: H = 4096, E_node = 32. Unpadded rows were 8192 + 128 + 12 = 8332 and
    # 8192 + 64 + 12 = 8268 bytes: not 16-byte multiples, so row copies fell back to 4-byte
    # accesses.
    wire = RecordWireFormat(
        hidden=4096, payload_dtype=payload, probs_dtype=probs, experts_per_node=32
    )
    assert wire.dispatch_bytes == want and want % 16 == 0
    assert wire.dispatch_grad_bytes % 16 == 0 and wire.combine_bytes % 16 == 0


def test_dispatch_row_not_padded_where_int32_words_cannot_align_it():
    # 2 + 2 B before the meta: 3 words make 16 B, no pad. 2 + 4 = 6 B: no number of int32 words
    # aligns it.
    wire = RecordWireFormat(
        hidden=1, payload_dtype=torch.float16, probs_dtype=torch.float16, experts_per_node=1
    )
    assert wire.meta_words == 3 and wire.dispatch_bytes == 2 + 2 + 12 == 16
    odd = RecordWireFormat(
        hidden=1, payload_dtype=torch.float16, probs_dtype=torch.float32, experts_per_node=1
    )
    assert (
        odd.meta_words == 3 and odd.dispatch_bytes == 2 + 4 + 12
    )  # 6 B before the meta: left unpadded


@pytest.mark.parametrize(
    ("path", "chunks"), [("joint", 1), ("joint", 3), ("rail", 3), ("flow", 2), ("flow-waves", 2)]
)
def test_streamed_relay_moves_each_rail_phase_part_before_it(path, chunks):
    """A streamed relay: relay part u into proxy l plus l's kept part u is exactly what l sends
    in rail phase u; the parts add up to the whole relay; rail[u] waits for relay[u] only (and
    rail[u - 1]), relay parts run in order, and combine returns part u after combine.rail[u]."""
    from megatron_railwave.planner import relay_chunk_rows_NNGGC

    topo = RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)}))
    demand = _random_demand(topo, 7, tokens=29)
    whole = compile_schedule(
        build_plan(demand, topo, path, options=PlanOptions(chunks=chunks)), WIRE, demand=demand
    )
    plan = build_plan(demand, topo, path, options=PlanOptions(chunks=chunks, streamed=True))
    sched = compile_schedule(plan, WIRE, demand=demand)
    V = plan.num_rail_phases
    assert plan.streamed and plan.num_relay_phases == V > 1 and plan.chunks == chunks
    # The same rail and delivery transfers (RAIL takes chunks only when streamed); the relay rows
    # split over the parts.
    same = whole.plan.chunks == chunks
    assert same == (path != "rail")
    for kind, steps in (("rail", V), ("deliver", V + 1)) if same else ():
        for v in range(steps):
            assert _pair_rows(sched, sched.phase("dispatch", kind, v)) == _pair_rows(
                whole, whole.phase("dispatch", kind, v)
            ), (kind, v)
    total: dict = {}
    for u in range(V):
        for key, rows in _pair_rows(sched, sched.phase("dispatch", "relay", u)).items():
            total[key] = total.get(key, 0) + rows
    assert total == _pair_rows(whole, whole.phase("dispatch", "relay"))
    # Part u into proxy (s, l) + its kept part u == its rail[u] sends.
    g = topo.gpus_per_node
    parts = relay_chunk_rows_NNGGC(plan)  # [s, d, o, l, k]
    wave = plan.pair_wave_NN.numpy()
    for u in range(V):
        into = {}
        for (_, dst), rows in _pair_rows(sched, sched.phase("dispatch", "relay", u)).items():
            into[dst] = into.get(dst, 0) + rows
        sent = {}
        for (src, _), rows in _pair_rows(sched, sched.phase("dispatch", "rail", u)).items():
            sent[src] = sent.get(src, 0) + rows
        for rank in range(topo.world_size):
            s, l = divmod(rank, g)
            kept = sum(
                int(parts[s, d, l, l, u % chunks])
                for d in range(topo.num_nodes)
                if wave[s, d] == u // chunks
            )
            assert into.get(rank, 0) + kept == sent.get(rank, 0), (u, rank)
    deps = {p.name: sorted(sched.phases[d].name for d in p.depends_on) for p in sched.phases}
    assert deps["dispatch.rail[0]"] == ["dispatch.relay[0]"]
    assert deps["dispatch.rail[1]"] == ["dispatch.rail[0]", "dispatch.relay[1]"]
    assert deps["dispatch.relay[1]"] == ["dispatch.relay[0]"]
    assert deps["combine.relay[0]"] == ["combine.rail[0]"]
    assert deps[f"combine.relay[{V - 1}]"] == [f"combine.rail[{V - 1}]", f"combine.relay[{V - 2}]"]
    for p in sched.phases:  # the posting order stays a topological order
        assert all(d < p.index for d in p.depends_on)


def test_streamed_relay_is_off_where_nothing_streams():
    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    demand = _random_demand(topo, 2)
    streamed = PlanOptions(streamed=True)
    # NATIVE / PERM relay nothing (healthy rails); RAIL / FLOW have one rail phase unchunked.
    for path in ("native", "perm", "rail", "flow"):
        plan = build_plan(demand, topo, path, options=streamed)
        assert not plan.streamed and plan.num_relay_phases == 1, path
        assert compile_schedule(plan, WIRE).phase("dispatch", "relay").name == "dispatch.relay"
    assert build_plan(demand, topo, "joint", options=streamed).streamed
    with pytest.raises(ValueError, match="streamed must be a bool"):
        PlanOptions(streamed=1)
