"""Plan execution on the flow model: hand-worked stage times, waves vs incast, ports shared by
overlapping phases, streamed delivery and combine overlap, fabric links and config errors.

The model sends the compiled schedule's rows: a dispatch row is the payload plus fp32 probs and
metadata (16 bytes with one expert per node, ``num_experts=1`` below), so hand-worked times of
1 MB records hold to ~1e-4."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_railwave.lab.netmodel import (
    NetModelConfig,
    build_fabric,
    execute_plan,
    load_netmodel_config,
    simulate_plan,
)
from megatron_railwave.lab.netmodel.execute import model_wire
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.schedule import RecordWireFormat
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

CONFIGS = Path(__file__).resolve().parents[3] / "megatron_railwave" / "configs"
MB = 1e6
# 1 GB/s rails (8 Gbit/s), 2 GB/s NVLink; 1 MB payload per record; no fixed costs, no incast.
PLAIN = NetModelConfig(
    alpha=0.0,
    k_sat=None,
    wave_latency_s=0.0,
    count_exchange_s=0.0,
    railbalance_barrier_s=0.0,
    railbalance_quota_s=0.0,
    num_experts=1,
    rel_tol=0.0,
)


def approx(value, rel=1e-4):
    return pytest.approx(value, rel=rel)


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
    assert t.rail_s_V == approx((3e-3,))
    # Round 0 delivers the local node's records (none here); round 1 the rail wave.
    assert t.delivery_s_V == approx((0.0, 1.5e-3))
    assert t.dispatch_s == approx(4.5e-3) and t.combine_s == approx(4.5e-3)
    assert simulate_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand) == approx(9e-3)
    np.testing.assert_allclose(t.nic_egress_bytes_NR, [[3 * (MB + 16), 0], [0, 0]])
    np.testing.assert_allclose(t.nic_ingress_bytes_NR, [[0, 0], [3 * (MB + 16), 0]])


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
    assert t.relay_s == approx(1e-3)
    assert t.rail_s_V == approx((2e-3,))
    assert t.delivery_s_V == approx((0.0, 0.5e-3))  # round 0: no local records
    assert t.total_s == approx(7e-3)
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
    native = execute_plan(
        build_plan(demand, topo, "native"), record_bytes=int(MB), model=model, demand=demand
    )
    perm = execute_plan(
        build_plan(demand, topo, "perm"), record_bytes=int(MB), model=model, demand=demand
    )
    assert native.dispatch_s == approx(4e-3)
    assert perm.dispatch_s == approx(2e-3)
    assert perm.rail_s_V == approx((1e-3, 1e-3))
    for path in ("native", "perm"):
        plain = execute_plan(
            build_plan(demand, topo, path), record_bytes=int(MB), model=PLAIN, demand=demand
        )
        assert plain.dispatch_s == approx(2e-3)


def test_execute_wave_latency_paid_per_rail_phase():
    # PERM on 3 nodes: 2 waves, each paid in dispatch and in combine: 4 x 10 us on top of 4 ms.
    topo, demand = _three_to_one()
    model = replace(PLAIN, wave_latency_s=1e-5)
    t = execute_plan(
        build_plan(demand, topo, "perm"), record_bytes=int(MB), model=model, demand=demand
    )
    assert t.total_s == approx(4e-3 + 4e-5)


def test_execute_rows_carry_the_wire_formats_bytes():
    # Dispatch rows: 1 MB payload (500,000 bf16) + 1 fp32 prob + 3 int32 metadata words = 1e6 + 16
    # bytes; combine rows: the payload only. PERM, 2 waves of one record each way.
    topo, demand = _three_to_one()
    wire = RecordWireFormat(
        hidden=500_000, payload_dtype=torch.bfloat16, probs_dtype=torch.float32, experts_per_node=1
    )
    t = execute_plan(build_plan(demand, topo, "perm"), wire=wire, model=PLAIN, demand=demand)
    assert t.dispatch_s == pytest.approx(2 * (1e6 + 16) / 1e9, rel=1e-12)
    assert t.combine_s == pytest.approx(2e-3, rel=1e-12)
    with pytest.raises(ValueError, match="needs record_bytes"):
        execute_plan(build_plan(demand, topo, "perm"), model=PLAIN)


def test_execute_streamed_delivery_runs_during_the_rails():
    # Native hand-worked case: streamed dispatch = max(rail 3 ms, delivery 1.5 ms) = 3 ms; combine
    # mirrors it (partial sums leave on the rail while the targets return them).
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    t = execute_plan(
        build_plan(demand, topo, "native"),
        record_bytes=int(MB),
        model=replace(PLAIN, delivery="streamed"),
        demand=demand,
    )
    assert t.dispatch_s == approx(3e-3) and t.combine_s == approx(3e-3)


def _relay_and_local_demand():
    # 2 x 2. GPU (0,0) owns 3 records for node 1 (target GPU (1,1)) and 2 local records for GPU
    # (0,1). RAIL: quota [1, 2] on node 0's GPUs, so 2 records relay (0,0) -> (0,1), the same
    # NVLink ports as the 2 local copies (0,0) -> (0,1) of deliver[0], which runs at the same time.
    return _topo(2, 2), _demand(2, 2, {(0, 1, 0b10): 3, (0, 0, 0b10): 2})


def test_execute_overlapping_phases_share_nvlink_ports():
    # Dispatch: relay and deliver[0] both push 2 MB through out-port (0,0) and in-port (0,1) at
    # once: 4 MB at 2 GB/s, both end at 2 ms (1 ms each if each had the ports to itself). Rails
    # 1 MB and 2 MB in parallel: 2 ms (2 -> 4 ms); deliver[1] (1,0) -> (1,1) 1 MB: 0.5 ms -> 4.5 ms.
    # Combine (exchange order): cdeliver[0] returns the 2 local copies (1 ms) while cdeliver[1]
    # (0.5 ms), the rails back (2 ms, -> 2.5) and the relay back (1 ms, -> 3.5) run: the local
    # round overlaps the waves, as in dispatch: 3.5 ms.
    topo, demand = _relay_and_local_demand()
    plan = build_plan(demand, topo, "rail")
    assert plan.quota_NNG[0, 1].tolist() == [1, 2]
    t = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand)
    assert t.relay_s == approx(2e-3) and t.delivery_s_V == approx((2e-3, 0.5e-3))
    assert t.dispatch_s == approx(4.5e-3) and t.combine_s == approx(3.5e-3)
    # The busiest NVLink port carries 4 MB (+ the 1 MB delivery on node 1 elsewhere) in dispatch.
    assert t.bound_dispatch_s == approx(2e-3) and t.bound_combine_s == approx(2e-3)


def test_execute_model_config_refuses_the_removed_combine_overlap_key():
    with pytest.raises(ValueError, match="'combine_overlap' was removed"):
        NetModelConfig.from_dict({"combine_overlap": False})


def test_execute_per_call_costs_add_up_on_the_critical_path():
    # RAIL, (0,0) owns 3 records for node 1 only: count exchange 7 us before dispatch,
    # RailBalance barrier 3 us and quota 2 us before the relay (on the critical path), 11 us per
    # rail phase (x 2). (With local records too, deliver[0] would use the relay's ports alone
    # during those 5 us and the relay would still end when the ports drain: hidden.)
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    plan = build_plan(demand, topo, "rail")
    base = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand).total_s
    costs = replace(
        PLAIN,
        count_exchange_s=7e-6,
        railbalance_barrier_s=3e-6,
        railbalance_quota_s=2e-6,
        wave_latency_s=11e-6,
    )
    got = execute_plan(plan, record_bytes=int(MB), model=costs, demand=demand).total_s
    assert got - base == pytest.approx(7e-6 + 5e-6 + 2 * 11e-6, rel=1e-6)
    # NATIVE pays no RailBalance steps.
    native = build_plan(demand, topo, "native")
    n0 = execute_plan(native, record_bytes=int(MB), model=PLAIN, demand=demand).total_s
    n1 = execute_plan(native, record_bytes=int(MB), model=costs, demand=demand).total_s
    assert n1 - n0 == pytest.approx(7e-6 + 2 * 11e-6, rel=1e-6)


def test_execute_wave_jitter_is_the_expected_max_over_ranks():
    # 3 x 1 PERM: 4 rail phases over W = 3 ranks, each late by jitter x H_3 = 1 + 1/2 + 1/3.
    topo, demand = _three_to_one()
    plan = build_plan(demand, topo, "perm")
    base = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand).total_s
    got = execute_plan(
        plan, record_bytes=int(MB), model=replace(PLAIN, wave_jitter_s=6e-6), demand=demand
    ).total_s
    assert got - base == pytest.approx(4 * 6e-6 * (11 / 6), rel=1e-6)


def test_execute_without_masks_spreads_copies_evenly():
    # demand=None: each record goes to delivery_fanout GPUs spread over the G GPUs, here 2 / 2:
    # 3 MB to (1,1) from (1,0), same as the exact masks above.
    topo = _topo(2, 2)
    demand = _demand(2, 2, {(0, 1, 0b10): 3})
    plan = build_plan(demand, topo, "native")
    model = replace(PLAIN, delivery_fanout=2.0)
    exact = execute_plan(plan, record_bytes=int(MB), model=model, demand=demand)
    even = execute_plan(plan, record_bytes=int(MB), model=model)
    assert even.delivery_s_V == approx(exact.delivery_s_V)


def _random_demand(topo, seed):
    rng = np.random.default_rng(seed)
    n, g = topo.num_nodes, topo.gpus_per_node
    rec = torch.from_numpy(
        rng.poisson(3.0, size=(n * g, n, 1 << g)) * (rng.random((n * g, n, 1 << g)) < 0.2)
    )
    rec[:, :, 0] = 0
    return DemandCounts(records_WNM=rec, experts_WE=torch.zeros(n * g, n * g, dtype=torch.int64))


def test_execute_is_deterministic_and_bound_is_below_maxmin():
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    demand = _random_demand(topo, 3)
    plan = build_plan(demand, topo, "joint")
    a = execute_plan(plan, record_bytes=8192, demand=demand)
    b = execute_plan(plan, record_bytes=8192, demand=demand)
    assert a.total_s == b.total_s and a.delivery_s_V == b.delivery_s_V
    # 'ports' merges each phase's NVLink flows per port: a relaxation, between the bound and maxmin.
    ports = execute_plan(
        plan, record_bytes=8192, demand=demand, model=NetModelConfig(nvlink="ports")
    )
    assert a.bound_s * (1 - 1e-3) <= ports.total_s <= a.total_s * (1 + 2e-3)


def test_execute_windows_run_in_order_like_waves():
    # NATIVE with RING windows on 3 x 1 is the cyclic schedule: same time as PERM.
    from megatron_railwave.planner import cyclic_schedule

    topo = _topo(3, 1)
    demand = _demand(3, 1, {(0, 1, 1): 2, (1, 2, 1): 1, (2, 0, 1): 3, (0, 2, 1): 1})
    windows = cyclic_schedule(3)
    native = execute_plan(
        build_plan(demand, topo, "native", options=PlanOptions(windows=windows)),
        record_bytes=int(MB),
        model=PLAIN,
        demand=demand,
    )
    perm = execute_plan(
        build_plan(demand, topo, "perm"), record_bytes=int(MB), model=PLAIN, demand=demand
    )
    assert native.total_s == approx(perm.total_s)
    assert len(native.rail_s_V) == 2 and native.rail_s_V == approx((3e-3, 1e-3))


def test_fabric_h20_adapters_and_leaf_groups():
    topo = RailTopology(
        num_nodes=4,
        gpus_per_node=8,
        rail_gbps=200.0,
        adapter_of_rail=(0, 0, 1, 1, 2, 2, 3, 3),
        adapter_gbps=400.0,
    )
    fab = build_fabric(topo, nodes_per_leaf=2, spine_oversubscription=2.0)
    # links: 64 NVLink + 2 x 32 NIC + 2 x 16 adapter + 2 x (8 rails x 2 leaf groups)
    assert fab.num_links == 64 + 64 + 32 + 32
    assert int(fab.network.receiver_port_L.sum()) == 32
    same = fab.rail_links_FH([0], [1], [3])[0]
    cross = fab.rail_links_FH([0], [2], [3])[0]
    assert (same >= 0).sum() == 4 and (cross >= 0).sum() == 6
    cap = fab.network.capacity_Bps_L
    assert cap[fab.adapter_up_NA[0, 1]] == approx(50e9)
    assert cap[fab.leaf_up_RQ[3, 0]] == approx(2 * 25e9 / 2.0)


def test_spine_oversubscription_slows_cross_leaf_traffic():
    # 2 nodes, one per leaf group, oversubscription 2: the spine uplink is half a port.
    topo, demand = _topo(2, 2), _demand(2, 2, {(0, 1, 0b01): 2})
    plan = build_plan(demand, topo, "native")
    flat = execute_plan(plan, record_bytes=int(MB), model=PLAIN, demand=demand)
    spine = execute_plan(
        plan,
        record_bytes=int(MB),
        model=replace(PLAIN, nodes_per_leaf=1, spine_oversubscription=2.0),
        demand=demand,
    )
    assert flat.rail_s_V == approx((2e-3,)) and spine.rail_s_V == approx((4e-3,))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -1.0}, r"IncastModel.alpha must be a finite number >= 0"),
        (
            {"wave_latency_s": float("nan")},
            r"NetModelConfig.wave_latency_s must be a finite number >= 0",
        ),
        (
            {"count_exchange_s": -1e-6},
            r"NetModelConfig.count_exchange_s must be a finite number >= 0",
        ),
        ({"num_experts": 0}, r"NetModelConfig.num_experts must be an int >= 1"),
        ({"k_sat": 0}, r"IncastModel.k_sat must be an int >= 1 or None"),
        ({"nvlink": "fast"}, r"NetModelConfig.nvlink must be 'maxmin' or 'ports', got 'fast'"),
        ({"delivery": "later"}, r"NetModelConfig.delivery must be 'after_rail' or 'streamed'"),
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
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ValueError, match=r"netmodel config .*bad.yaml' is not valid YAML"):
        load_netmodel_config(bad)


def test_execute_single_node_has_only_local_delivery():
    topo = _topo(1, 2)
    demand = _demand(1, 2, {(0, 0, 0b10): 4})
    t = execute_plan(
        build_plan(demand, topo, "joint"), record_bytes=int(MB), model=PLAIN, demand=demand
    )
    assert t.rail_s_V == () and t.dispatch_s == approx(2e-3) and t.combine_s == approx(2e-3)


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
        return (
            (1 - torch.eye(self.n, dtype=torch.int64))
            .view(self.n, 1, self.n)
            .expand(self.n, self.g, self.n)
            .clone()
        )

    def masks_into(self, node: int) -> torch.Tensor:
        out = torch.zeros(self.n * self.g, 1 << self.g, dtype=torch.int64)
        ranks = torch.arange(self.n * self.g)
        out[ranks, 1 << (ranks % self.g)] = 1
        out[node * self.g : (node + 1) * self.g] = 0
        return out


def _hand_worked_rail_ms(senders_per_port: list[int], alpha: float) -> float:
    """Dispatch + combine of 1 MB records on 1 GB/s rails, per the docstring above."""
    return 2 * sum(k * (1 + alpha * (k - 1)) for k in senders_per_port)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
@pytest.mark.parametrize(
    ("path", "fanin", "senders_per_port"),
    [
        ("native", 1, [15]),  # all 15 remote nodes at once
        ("joint", 1, [1] * 15),  # cyclic: one sender per port, 15 waves
        ("joint", 4, [4, 4, 4, 3]),  # bounded fan-in 4: shifts 1-4, 5-8, 9-12, 13-15
        ("perm", 16, [15]),  # fan-in >= N - 1: one wave with every pair
    ],
)
def test_execute_rail_aligned_all_to_all_hand_worked(alpha, path, fanin, senders_per_port):
    # 16 nodes x 2 GPUs: e.g. NATIVE with alpha 0.5: 15 MB into every port at 1 / (1 + 0.5 x 14)
    # GB/s = 120 ms each way, 240 ms; JOINT cyclic: 15 waves of 1 ms each way = 30 ms at any alpha.
    topo = _topo(16, 2)
    demand = _RailAlignedAllToAll(16, 2)
    plan = build_plan(demand.records_NGN(), topo, path, options=PlanOptions(fanin=fanin))
    assert plan.relayed_records() == 0
    t = execute_plan(
        plan,
        record_bytes=int(MB),
        model=replace(PLAIN, alpha=alpha, nodes_per_leaf=0),
        demand=demand,
    )
    assert len(t.rail_s_V) == len(senders_per_port)
    assert t.rail_s_V == approx(tuple(k * (1 + alpha * (k - 1)) * 1e-3 for k in senders_per_port))
    assert t.relay_s == 0.0 and all(d == 0.0 for d in t.delivery_s_V)
    assert t.total_s == approx(_hand_worked_rail_ms(senders_per_port, alpha) * 1e-3)


@pytest.mark.slow
def test_execute_256x8_layer_timing(capsys):
    # 256 x 8 = 2048 GPUs. (1) The rail-aligned all-to-all, worked by hand (see
    # _RailAlignedAllToAll): cyclic 255 waves of 1 ms each way = 510 ms at any alpha; fan-in 16:
    # 15 waves of 16 senders and one of 15, each way: 2 x (15 x 16 x (1 + 15 a) + 15 x (1 + 14 a))
    # ms. (2) One synthetic GLM-4.5-Air-shaped layer: no better than its busiest NIC allows, and the
    # model's CPU time printed (docs/netmodel.md "Speed").
    import time

    from megatron_railwave.lab.bench.netmodel_bench import layer_demands

    alpha = 0.1
    topo = _topo(256, 8)
    uniform = _RailAlignedAllToAll(256, 8)
    for fanin, senders in ((1, [1] * 255), (16, [16] * 15 + [15])):
        plan = build_plan(uniform.records_NGN(), topo, "joint", options=PlanOptions(fanin=fanin))
        c0 = time.process_time()
        t = execute_plan(
            plan,
            record_bytes=int(MB),
            model=replace(PLAIN, alpha=alpha, nodes_per_leaf=0),
            demand=uniform,
        )
        print(
            f"256x8 rail-aligned all-to-all, joint fanin {fanin}: {t.total_s * 1e3:.1f} ms "
            f"modelled, "
            f"{time.process_time() - c0:.1f} s CPU"
        )
        # Dispatch rows carry probs and metadata beyond the 1 MB payload; combine rows do not.
        wire = model_wire(topo, int(MB), PLAIN)
        per_direction_ms = _hand_worked_rail_ms(senders, alpha) / 2
        want_s = per_direction_ms * (wire.dispatch_bytes + wire.combine_bytes) / MB * 1e-3
        assert t.total_s == approx(want_s, rel=1e-6)
    assert _hand_worked_rail_ms([1] * 255, alpha) == 510.0
    assert _hand_worked_rail_ms([16] * 15 + [15], alpha) == approx(2 * (15 * 16 * 2.5 + 15 * 2.4))

    topo = RailTopology(num_nodes=256, gpus_per_node=8)
    demand = layer_demands(topo, layer=1, step=0, tokens=256, seed=0)
    model = NetModelConfig()
    for fanin in (1, 16):
        plan = build_plan(demand.records_NGN(), topo, "joint", options=PlanOptions(fanin=fanin))
        c0 = time.process_time()
        t = execute_plan(plan, record_bytes=8192, demand=demand, model=model)
        print(
            f"256x8 joint fanin {fanin}: {t.total_s * 1e3:.2f} ms modelled, "
            f"{time.process_time() - c0:.1f} s CPU"
        )
        # Each way, the busiest NIC must push its bytes at the line rate at best.
        busiest = max(float(t.nic_egress_bytes_NR.max()), float(t.nic_ingress_bytes_NR.max()))
        assert t.total_s >= 2 * busiest / topo.rail_bytes_per_s
        assert len(t.rail_s_V) == plan.num_waves
