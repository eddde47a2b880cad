"""Plan execution on the flow model: hand-worked stage times, waves vs incast, the NVLink
decomposition against one joint simulation, fabric links and config errors."""

from dataclasses import replace
from pathlib import Path as FsPath

import numpy as np
import pytest
import torch

from megatron_railwave.netmodel import (
    FlowSet,
    NetModelConfig,
    PhaseGraph,
    build_fabric,
    execute_plan,
    load_netmodel_config,
    simulate,
    simulate_plan,
)
from megatron_railwave.netmodel.execute import _delivery_VNGG
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

CONFIGS = FsPath(__file__).resolve().parents[3] / "configs"
MB = 1e6
# 1 GB/s rails (8 Gbit/s), 2 GB/s NVLink; records of exactly 1 MB; no fixed costs, no incast.
PLAIN = NetModelConfig(alpha=0.0, wave_latency_s=0.0, metadata_bytes=0, rel_tol=0.0, nvlink_rel_tol=0.0)


def _topo(n, g, **kw):
    return RailTopology(num_nodes=n, gpus_per_node=g, rail_gbps=8.0, nvlink_gBps=2.0, **kw)


def _demand(n, g, cells):
    """cells: {(rank, dst_node, mask): records}."""
    rec = torch.zeros(n * g, n, 1 << g, dtype=torch.int64)
    for (w, d, m), c in cells.items():
        rec[w, d, m] = c
    return DemandCounts(records_WNM=rec, experts_WE=torch.zeros(n * g, n * g, dtype=torch.int64))


def test_execute_native_two_nodes_hand_worked():
    # 2 nodes x 2 GPUs. GPU (0,0) owns 3 records for node 1, all for GPU (1,1) (mask 0b10).
    # NATIVE: no relay; rail (0,0)->(1,0) 3 MB at 1 GB/s = 3 ms; delivery (1,0)->(1,1) 3 MB at
    # 2 GB/s = 1.5 ms. Dispatch 4.5 ms; combine the same backwards: 4.5 ms.
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    plan = build_plan(demand, topo, "native")
    t = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand)
    assert t.relay_s == 0.0
    assert t.rail_s_V == pytest.approx((3e-3,))
    # Round 0 delivers the local node's records (none here); round 1 the rail wave.
    assert t.delivery_s_V == pytest.approx((0.0, 1.5e-3))
    assert t.dispatch_s == pytest.approx(4.5e-3) and t.combine_s == pytest.approx(4.5e-3)
    assert simulate_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand) == pytest.approx(9e-3)
    np.testing.assert_allclose(t.nic_egress_bytes_NR, [[3 * MB, 0], [0, 0]])
    np.testing.assert_allclose(t.nic_ingress_bytes_NR, [[0, 0], [3 * MB, 0]])


def test_execute_rail_balance_two_nodes_hand_worked():
    # Same demand under RAIL: quota over GPUs [1, 2] (rem 1, rotation (0 + 1) mod 2 = 1 gives
    # GPU 1 the extra). Relay (0,0)->(0,1) 2 MB at 2 GB/s = 1 ms; rails 1 MB and 2 MB in parallel
    # = 2 ms; delivery: 1 record (1,0)->(1,1) = 0.5 ms, the 2 on (1,1) are already there.
    # Dispatch 1 + 2 + 0.5 = 3.5 ms, combine 3.5 ms.
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    plan = build_plan(demand, topo, "rail")
    assert plan.quota_NNG[0, 1].tolist() == [1, 2]
    t = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand)
    assert t.relay_s == pytest.approx(1e-3)
    assert t.rail_s_V == pytest.approx((2e-3,))
    assert t.delivery_s_V == pytest.approx((0.0, 0.5e-3))  # round 0: no local records
    assert t.total_s == pytest.approx(7e-3)
    np.testing.assert_allclose(t.nic_shares(), [2 / 3, 1 / 3])


def _three_to_one():
    # 3 nodes x 1 GPU: nodes 1 and 2 each send 1 record (1 MB) to node 0. No NVLink stage (G = 1).
    topo = _topo(3, 1)
    return topo, _demand(3, 1, {(1, 0, 1): 1, (2, 0, 1): 1})


def test_execute_waves_avoid_the_incast_penalty():
    # NATIVE sends both at once into node 0's port: alpha = 1, k = 2 -> the port runs at
    # 1 / (1 + 1) GB/s, 2 MB take 4 ms. PERM (cyclic, 2 waves) sends one per wave: 1 + 1 ms.
    # Without a penalty max-min shares the port: 2 ms either way.
    topo, demand = _three_to_one()
    model = replace(PLAIN, alpha=1.0)
    native = execute_plan(build_plan(demand, topo, "native"), record_bytes=int(MB), model=model, demand=demand)
    perm = execute_plan(build_plan(demand, topo, "perm"), record_bytes=int(MB), model=model, demand=demand)
    assert native.dispatch_s == pytest.approx(4e-3)
    assert perm.dispatch_s == pytest.approx(2e-3)
    assert perm.rail_s_V == pytest.approx((1e-3, 1e-3))
    for path in ("native", "perm"):
        plain = execute_plan(build_plan(demand, topo, path), record_bytes=int(MB), model=PLAIN, demand=demand)
        assert plain.dispatch_s == pytest.approx(2e-3)


def test_execute_wave_latency_paid_per_rail_phase():
    # PERM on 3 nodes: 2 waves, each paid in dispatch and in combine: 4 x 10 us on top of 4 ms.
    topo, demand = _three_to_one()
    model = replace(PLAIN, wave_latency_s=1e-5)
    t = execute_plan(build_plan(demand, topo, "perm"), record_bytes=int(MB), model=model, demand=demand)
    assert t.total_s == pytest.approx(4e-3 + 4e-5)


def test_execute_metadata_bytes_travel_with_every_record():
    topo, demand = _three_to_one()
    model = replace(PLAIN, metadata_bytes=1000)
    t = execute_plan(build_plan(demand, topo, "perm"), record_bytes=int(MB) - 1000, model=model, demand=demand)
    assert t.total_s == pytest.approx(4e-3)


def test_execute_pipelined_delivery_runs_during_the_rails():
    # Native hand-worked case: pipelined dispatch = max(rail 3 ms, delivery 1.5 ms) = 3 ms.
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    t = execute_plan(build_plan(demand, topo, "native"), record_bytes=int(MB),
                     model=replace(PLAIN, delivery="pipelined"), demand=demand)
    assert t.dispatch_s == pytest.approx(3e-3) and t.combine_s == pytest.approx(3e-3)


def test_execute_without_masks_spreads_copies_evenly():
    # demand=None: each record goes to delivery_fanout GPUs spread over the G GPUs, here 2 / 2:
    # 3 MB to (1,1) from (1,0), same as the exact masks above.
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    plan = build_plan(demand, topo, "native")
    model = replace(PLAIN, delivery_fanout=2.0)
    exact = execute_plan(plan, record_bytes=int(MB), model=model, demand=demand)
    even = execute_plan(plan, record_bytes=int(MB), model=model)
    assert even.delivery_s_V == pytest.approx(exact.delivery_s_V)


def _random_demand(topo, seed):
    rng = np.random.default_rng(seed)
    n, g = topo.num_nodes, topo.gpus_per_node
    rec = torch.from_numpy(rng.poisson(3.0, size=(n * g, n, 1 << g)) * (rng.random((n * g, n, 1 << g)) < 0.2))
    rec[:, :, 0] = 0
    return DemandCounts(records_WNM=rec, experts_WE=torch.zeros(n * g, n * g, dtype=torch.int64))


def _joint_simulation(plan, demand, model, record_bytes):
    """Reference: every stage's flows (NVLink too) in one simulation, same phase graph."""
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    fabric = build_fabric(topo, nodes_per_leaf=model.nodes_per_leaf)
    row = record_bytes + model.metadata_bytes
    v = plan.num_waves
    rounds = v + 1  # round 0: local records; round w + 1: rail wave w
    remote = ~torch.eye(n, dtype=torch.bool)
    relay = (plan.relay_NNGG * remote.view(n, n, 1, 1)).sum(1).numpy() * row
    deliv = _delivery_VNGG(plan, demand, model.delivery_fanout) * row
    rail = [1 + w for w in range(v)]
    dl = [1 + v + r for r in range(rounds)]
    rdl = [1 + v + rounds + r for r in range(rounds)]
    rrail = [1 + v + 2 * rounds + w for w in range(v)]
    rrelay = 1 + 2 * v + 2 * rounds
    deps = [()] * (rrelay + 1)
    lat = np.zeros(rrelay + 1)
    deps[dl[0]] = (0,)
    deps[rdl[0]] = (dl[-1], rail[-1]) if v else (dl[-1],)
    for w in range(v):
        deps[rail[w]] = (rail[w - 1], dl[w - 1]) if w else (0,)
        deps[dl[w + 1]] = (rail[w], dl[w])
        deps[rrail[w]] = (rdl[w + 1],) + ((rrail[w - 1],) if w else ())
        deps[rdl[w + 1]] = (rdl[w],) + ((rrail[w - 2],) if w >= 2 else ())
        lat[rail[w]] = lat[rrail[w]] = model.wave_latency_s
    deps[rrelay] = (rrail[-1], rdl[-1])
    sizes, links, phases, senders = [], [], [], []

    def add(size, link, phase, sender):
        sizes.append(size), links.append(link), phases.append(phase), senders.append(sender)

    eye = np.eye(g, dtype=bool)
    for q, (mat, back) in enumerate([(relay, rrelay)] + [(deliv[r], rdl[r]) for r in range(rounds)]):
        fwd = 0 if q == 0 else dl[q - 1]
        node, a, b = np.nonzero(mat * ~eye)
        for nd, x, y in zip(node, a, b):
            add(mat[nd, x, y], fabric.nvlink_links_FH([nd], [x], [y])[0], fwd, 10**6)
            add(mat[nd, x, y], fabric.nvlink_links_FH([nd], [y], [x])[0], back, 10**6)
    quota = (plan.quota_NNG * remote.unsqueeze(-1)).numpy()
    for s, d, l in zip(*np.nonzero(quota)):
        w = int(plan.pair_wave_NN[s, d])
        add(quota[s, d, l] * row, fabric.rail_links_FH([s], [d], [l])[0], rail[w], s * g + l)
        add(quota[s, d, l] * row, fabric.rail_links_FH([d], [s], [l])[0], rrail[w], d * g + l)
    flows = FlowSet(size_bytes_F=np.array(sizes, dtype=float), links_FH=np.array(links),
                    phase_F=np.array(phases), sender_F=np.array(senders))
    res = simulate(fabric.network, flows, PhaseGraph(depends_on=tuple(deps), latency_s_Q=lat),
                   incast=model.incast(), rel_tol=0.0)
    return res.makespan_s


@pytest.mark.parametrize("path", ["native", "rail", "perm", "joint"])
@pytest.mark.parametrize("seed", [0, 1])
def test_execute_nvlink_decomposition_equals_one_joint_simulation(path, seed):
    # NVLink phases never overlap and share no link with the rails, so simulating them apart
    # and inserting their durations is exact (incast on, fixed costs on).
    topo = RailTopology(num_nodes=4, gpus_per_node=4)
    demand = _random_demand(topo, seed)
    model = NetModelConfig(alpha=0.5, wave_latency_s=2e-5, rel_tol=0.0, nvlink_rel_tol=0.0)
    plan = build_plan(demand, topo, path)
    got = execute_plan(plan, record_bytes=8192, model=model, demand=demand).total_s
    assert got == pytest.approx(_joint_simulation(plan, demand, model, 8192), rel=1e-9)


def test_execute_is_deterministic_and_bound_is_below_maxmin():
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    demand = _random_demand(topo, 3)
    plan = build_plan(demand, topo, "joint")
    a = execute_plan(plan, record_bytes=8192, demand=demand)
    b = execute_plan(plan, record_bytes=8192, demand=demand)
    assert a.total_s == b.total_s and a.delivery_s_V == b.delivery_s_V
    bound = execute_plan(plan, record_bytes=8192, demand=demand, model=NetModelConfig(nvlink="bound"))
    assert bound.total_s <= a.total_s * (1 + 1e-2)  # maxmin batches events within nvlink_rel_tol
    assert all(x <= y * (1 + 2e-2) for x, y in zip(bound.delivery_s_V, a.delivery_s_V))


def test_execute_windows_run_in_order_like_waves():
    # NATIVE with RING windows on 3 x 1 is the cyclic schedule: same time as PERM.
    from megatron_railwave.planner import cyclic_schedule

    topo = _topo(3, 1)
    demand = _demand(3, 1, {(0, 1, 1): 2, (1, 2, 1): 1, (2, 0, 1): 3, (0, 2, 1): 1})
    windows = cyclic_schedule(3)
    native = execute_plan(build_plan(demand, topo, "native", options=PlanOptions(windows=windows)),
                          record_bytes=int(MB), model=PLAIN, demand=demand)
    perm = execute_plan(build_plan(demand, topo, "perm"), record_bytes=int(MB), model=PLAIN, demand=demand)
    assert native.total_s == pytest.approx(perm.total_s)
    assert len(native.rail_s_V) == 2 and native.rail_s_V == pytest.approx((3e-3, 1e-3))


def test_fabric_h20_adapters_and_leaf_groups():
    topo = RailTopology(num_nodes=4, gpus_per_node=8, rail_gbps=200.0, adapter_of_rail=(0, 0, 1, 1, 2, 2, 3, 3),
                        adapter_gbps=400.0)
    fab = build_fabric(topo, nodes_per_leaf=2, spine_oversubscription=2.0)
    # links: 64 NVLink + 2 x 32 NIC + 2 x 16 adapter + 2 x (8 rails x 2 leaf groups)
    assert fab.num_links == 64 + 64 + 32 + 32
    assert int(fab.network.receiver_port_L.sum()) == 32
    same = fab.rail_links_FH([0], [1], [3])[0]
    cross = fab.rail_links_FH([0], [2], [3])[0]
    assert (same >= 0).sum() == 4 and (cross >= 0).sum() == 6
    cap = fab.network.capacity_Bps_L
    assert cap[fab.adapter_up_NA[0, 1]] == pytest.approx(50e9)
    assert cap[fab.leaf_up_RQ[3, 0]] == pytest.approx(2 * 25e9 / 2.0)


def test_spine_oversubscription_slows_cross_leaf_traffic():
    # 2 nodes, one per leaf group, oversubscription 2: the spine uplink is half a port.
    topo, demand = _topo(2, 2), _demand(2, 2, {(0, 1, 0b01): 2})
    plan = build_plan(demand, topo, "native")
    flat = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand)
    spine = execute_plan(plan, record_bytes=int(MB), model=replace(PLAIN, nodes_per_leaf=1, spine_oversubscription=2.0),
                         demand=demand)
    assert flat.rail_s_V == pytest.approx((2e-3,)) and spine.rail_s_V == pytest.approx((4e-3,))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -1.0}, r"IncastModel.alpha must be a finite number >= 0"),
        ({"wave_latency_s": float("nan")}, r"NetModelConfig.wave_latency_s must be a finite number >= 0"),
        ({"metadata_bytes": 1.5}, r"NetModelConfig.metadata_bytes must be an int >= 0"),
        ({"nvlink": "fast"}, r"NetModelConfig.nvlink must be 'maxmin' or 'bound', got 'fast'"),
        ({"delivery": "later"}, r"NetModelConfig.delivery must be 'after_rail' or 'pipelined'"),
        ({"rel_tol": 0.5}, r"NetModelConfig.rel_tol must be in \[0, 0.1\], got 0.5"),
        ({"spine_oversubscription": 0.5}, r"spine_oversubscription must be a finite number >= 1"),
        ({"nodes_per_leaf": -2}, r"nodes_per_leaf must be an int >= 0"),
    ],
)
def test_netmodel_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NetModelConfig(**kwargs)


def test_netmodel_configs_load_and_match_the_defaults(tmp_path):
    h800 = load_netmodel_config(CONFIGS / "netmodel" / "h800_4x8.yaml")
    assert h800 == NetModelConfig()  # the built-in defaults are the H800 calibration
    h20 = load_netmodel_config(CONFIGS / "netmodel" / "h20_4x8.yaml")
    assert h20.alpha == h800.alpha
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  alpha: 0.1\n  beta: 2\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['beta'\]"):
        load_netmodel_config(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_netmodel_config(tmp_path / "none.yaml")


def test_execute_single_node_has_only_local_delivery():
    topo = _topo(1, 2)
    demand = _demand(1, 2, {(0, 0, 0b10): 4})
    t = execute_plan(build_plan(demand, topo, "joint"), record_bytes=int(MB), model=PLAIN, demand=demand)
    assert t.rail_s_V == () and t.dispatch_s == pytest.approx(2e-3) and t.combine_s == pytest.approx(2e-3)


class _RailAlignedAllToAll:
    """Every GPU (s, l) sends one record to GPU (d, l) of every other node d (a `MaskSource`).

    By hand, for any path: the records already sit on their owner's rail (RailBalance moves
    none), each arrives on its target GPU (no NVLink copy), so only the rails cost time. A wave
    in which every receiver port has k senders moves k records through each port:
    k x (1 + alpha (k - 1)) record times (k_free = 1). Combine sends the same back.
    """

    def __init__(self, n: int, g: int) -> None:
        self.n, self.g = n, g

    def records_NGN(self) -> torch.Tensor:
        return (1 - torch.eye(self.n, dtype=torch.int64)).view(self.n, 1, self.n).expand(self.n, self.g, self.n).clone()

    def masks_into(self, node: int) -> torch.Tensor:
        out = torch.zeros(self.n * self.g, 1 << self.g, dtype=torch.int64)
        ranks = torch.arange(self.n * self.g)
        out[ranks, 1 << (ranks % self.g)] = 1
        out[node * self.g:(node + 1) * self.g] = 0
        return out


def _hand_worked_rail_ms(senders_per_port: list[int], alpha: float) -> float:
    """Dispatch + combine of 1 MB records on 1 GB/s rails, per the docstring above."""
    return 2 * sum(k * (1 + alpha * (k - 1)) for k in senders_per_port)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize(("path", "fanin", "senders_per_port"), [
    ("native", 1, [15]),               # all 15 remote nodes at once
    ("joint", 1, [1] * 15),            # cyclic: one sender per port, 15 waves
    ("joint", 4, [4, 4, 4, 3]),        # bounded fan-in 4: shifts 1-4, 5-8, 9-12, 13-15
    ("perm", 16, [15]),                # fan-in >= N - 1: one wave with every pair
])
def test_execute_rail_aligned_all_to_all_hand_worked(alpha, path, fanin, senders_per_port):
    # 16 nodes x 2 GPUs: e.g. NATIVE with alpha 0.5: 15 MB into every port at 1 / (1 + 0.5 x 14)
    # GB/s = 120 ms each way, 240 ms; JOINT cyclic: 15 waves of 1 ms each way = 30 ms at any alpha.
    topo = _topo(16, 2)
    demand = _RailAlignedAllToAll(16, 2)
    plan = build_plan(demand.records_NGN(), topo, path, options=PlanOptions(fanin=fanin))
    assert plan.relayed_records() == 0
    t = execute_plan(plan, record_bytes=int(MB), model=replace(PLAIN, alpha=alpha, nodes_per_leaf=0),
                     demand=demand)
    assert len(t.rail_s_V) == len(senders_per_port)
    assert t.rail_s_V == pytest.approx(tuple(k * (1 + alpha * (k - 1)) * 1e-3 for k in senders_per_port))
    assert t.relay_s == 0.0 and all(d == 0.0 for d in t.delivery_s_V)
    assert t.total_s == pytest.approx(_hand_worked_rail_ms(senders_per_port, alpha) * 1e-3)


@pytest.mark.slow
def test_execute_256x8_layer_timing(capsys):
    # 256 x 8 = 2048 GPUs. (1) The rail-aligned all-to-all, worked by hand (see
    # _RailAlignedAllToAll): cyclic 255 waves of 1 ms each way = 510 ms at any alpha; fan-in 16:
    # 15 waves of 16 senders and one of 15, each way: 2 x (15 x 16 x (1 + 15 a) + 15 x (1 + 14 a)) ms.
    # (2) One synthetic GLM-4.5-Air-shaped layer: no better than its busiest NIC allows, and the
    # model's CPU time printed (docs/netmodel.md "Speed").
    import time

    from megatron_railwave.commands.bench import layer_demands

    alpha = 0.1
    topo = _topo(256, 8)
    uniform = _RailAlignedAllToAll(256, 8)
    for fanin, senders in ((1, [1] * 255), (16, [16] * 15 + [15])):
        plan = build_plan(uniform.records_NGN(), topo, "joint", options=PlanOptions(fanin=fanin))
        c0 = time.process_time()
        t = execute_plan(plan, record_bytes=int(MB), model=replace(PLAIN, alpha=alpha, nodes_per_leaf=0),
                         demand=uniform)
        print(f"256x8 rail-aligned all-to-all, joint fanin {fanin}: {t.total_s * 1e3:.1f} ms modelled, "
              f"{time.process_time() - c0:.1f} s CPU")
        assert t.total_s == pytest.approx(_hand_worked_rail_ms(senders, alpha) * 1e-3, rel=1e-6)
    assert _hand_worked_rail_ms([1] * 255, alpha) == 510.0
    assert _hand_worked_rail_ms([16] * 15 + [15], alpha) == pytest.approx(2 * (15 * 16 * 2.5 + 15 * 2.4))

    topo = RailTopology(num_nodes=256, gpus_per_node=8)
    demand = layer_demands(topo, layer=1, step=0, tokens=256, seed=0)
    model = NetModelConfig()
    row = 8192 + model.metadata_bytes
    for fanin in (1, 16):
        plan = build_plan(demand.records_NGN(), topo, "joint", options=PlanOptions(fanin=fanin))
        c0 = time.process_time()
        t = execute_plan(plan, record_bytes=8192, demand=demand, model=model)
        print(f"256x8 joint fanin {fanin}: {t.total_s * 1e3:.2f} ms modelled, {time.process_time() - c0:.1f} s CPU")
        # Each way, the busiest NIC must push its bytes at the line rate at best.
        busiest = max(float(t.nic_egress_bytes_NR.max()), float(t.nic_ingress_bytes_NR.max()))
        assert t.total_s >= 2 * busiest / topo.rail_bytes_per_s
        assert len(t.rail_s_V) == plan.num_waves
