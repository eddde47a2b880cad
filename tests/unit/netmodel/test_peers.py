"""Peers on the flow model: Megatron's all-to-all (no de-duplication, PXN; NCCL's rotating node
rounds or flat), DeepEP direct (one copy per target GPU, PXN) and the FAST-style
Birkhoff-von-Neumann schedule."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel import NetModelConfig
from megatron_railwave.lab.netmodel.execute import fabric_for
from megatron_railwave.lab.netmodel.peers import (
    bvn_waves,
    copies_WW,
    deepep_direct_program,
    fast_program,
    gpu_copies_WW,
    megatron_program,
)
from megatron_railwave.lab.netmodel.program import run_program
from megatron_railwave.planner import build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

FREE = NetModelConfig(
    alpha=0.0,
    k_sat=None,
    wave_latency_s=0.0,
    count_exchange_s=0.0,
    railbalance_barrier_s=0.0,
    railbalance_quota_s=0.0,
    num_experts=1,
    rel_tol=0.0,
)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 7), seed=st.integers(0, 10_000), density=st.floats(0.1, 1.0))
def test_bvn_waves_are_one_to_one_and_cover_the_demand(n, seed, density):
    rng = np.random.default_rng(seed)
    records = rng.integers(0, 50, size=(n, n)) * (rng.random((n, n)) < density)
    waves = bvn_waves(records)
    off = records * (1 - np.eye(n, dtype=np.int64))
    total = sum(waves, np.zeros((n, n), dtype=np.int64))
    np.testing.assert_array_equal(total, off)
    for w in waves:
        assert ((w > 0).sum(axis=0) <= 1).all() and ((w > 0).sum(axis=1) <= 1).all()
        assert np.diag(w).sum() == 0
    assert len(waves) <= max(n * n - 2 * n + 2, 0)


def test_bvn_of_a_permutation_is_one_wave_and_of_uniform_is_n_minus_1():
    # 4 nodes, s -> s + 1: a single permutation. Uniform all-to-all: the N - 1 shifts.
    shift = np.roll(np.eye(4, dtype=np.int64), 1, axis=1) * 5
    assert len(bvn_waves(shift)) == 1
    uniform = 3 * (1 - np.eye(4, dtype=np.int64))
    waves = bvn_waves(uniform)
    assert len(waves) == 3 and all(w.sum() == 12 for w in waves)


def _one_token_demand():
    # 2 nodes x 2 GPUs, 2 experts per GPU (E = 8). GPU (0,0) routes token a to experts 6 and 7 and
    # token b to expert 6, all on GPU (1,1): Megatron sends 3 copies; the record view 2 records.
    experts = torch.zeros(4, 8, dtype=torch.int64)
    experts[0, 6], experts[0, 7] = 2, 1
    rec = torch.zeros(4, 2, 4, dtype=torch.int64)
    rec[0, 1, 0b10] = 2
    return DemandCounts(records_WNM=rec, experts_WE=experts)


def test_megatron_sends_every_copy_through_pxn_by_hand():
    # Copies: 3 from rank 0 to rank 3. PXN: NVLink (0,0) -> (0,1) at 2 GB/s, then rail 1 at 1 GB/s,
    # one streamed flow: 3 x (1e6 + 4) B at 1 GB/s = 3.000012 ms dispatch; combine 3 ms back.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    demand = _one_token_demand()
    assert copies_WW(demand, topo)[0, 3] == 3
    program = megatron_program(demand, topo, record_bytes=1_000_000, model=FREE, rounds="flat")
    fabric = fabric_for(topo, 32, 1.0)
    run = run_program(fabric, program, incast=FREE.incast(), rel_tol=0.0)
    assert run.dispatch_s == pytest.approx(3 * (1e6 + 4) / 1e9) and run.combine_s == pytest.approx(
        3e-3
    )
    link_bytes = program.link_bytes_DL(fabric.num_links)
    nvl_out_00, nic_up_01 = 0, int(fabric.nic_up_NR[0, 1])
    assert link_bytes[0, nvl_out_00] == pytest.approx(3 * (1e6 + 4))  # the PXN hop
    assert link_bytes[0, nic_up_01] == pytest.approx(3 * (1e6 + 4))  # the destination GPU's rail
    assert link_bytes[0, int(fabric.nic_up_NR[0, 0])] == 0


def test_megatron_rotating_rounds_send_one_node_shift_at_a_time_by_hand():
    # 3 nodes x 1 GPU, 1 expert per GPU, 1 GB/s rails. Every node sends 2 copies to each other
    # node. Flat: all 12 copies at once, each receiver port has 2 senders and every port carries 4
    # rows out and 4 in, 4 ms a direction. Rotating: round 1 (s -> s + 1) and
    # round 2 (s -> s + 2), each one-to-one, 2 ms each: the same 4 ms at alpha 0; with an incast
    # penalty only the flat all-to-all slows down.
    topo = RailTopology(num_nodes=3, gpus_per_node=1, rail_gbps=8.0, nvlink_gBps=2.0)
    experts = 2 * (1 - torch.eye(3, dtype=torch.int64))
    demand = DemandCounts(records_WNM=torch.zeros(3, 3, 2, dtype=torch.int64), experts_WE=experts)
    fabric = fabric_for(topo, 32, 1.0)
    lossy = NetModelConfig(
        alpha=1.0, k_sat=None, wave_latency_s=0.0, count_exchange_s=0.0, num_experts=1, rel_tol=0.0
    )
    times = {}
    for rounds in ("flat", "rotating"):
        for name, model in (("free", FREE), ("lossy", lossy)):
            program = megatron_program(
                demand, topo, record_bytes=1_000_000, model=model, rounds=rounds
            )
            times[rounds, name] = run_program(
                fabric, program, incast=model.incast(), rel_tol=0.0
            ).dispatch_s
    rotating = megatron_program(demand, topo, record_bytes=1_000_000, model=FREE)
    assert (
        sum(n.startswith("dispatch.alltoall[") for n in rotating.names) == 3
    )  # rounds 0 (local), 1, 2
    assert times["flat", "free"] == pytest.approx(4e-3 * (1 + 4 / 1e6))
    assert times["rotating", "free"] == pytest.approx(4e-3 * (1 + 4 / 1e6))
    assert times["rotating", "lossy"] == pytest.approx(times["rotating", "free"])
    assert (
        times["flat", "lossy"] > 1.5 * times["flat", "free"]
    )  # 2 senders per port: half the goodput


def test_deepep_direct_sends_one_copy_per_target_gpu_by_hand():
    # The demand of _one_token_demand: 2 records from GPU (0,0) into node 1 with mask {1}: DeepEP
    # direct sends 2 copies (Megatron 3), PXN over rail 1; rows carry 1e6 B + fp32 probs of the
    # E / W = 2 experts of the target GPU.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    demand = _one_token_demand()
    assert gpu_copies_WW(demand, topo)[0, 3] == 2 and gpu_copies_WW(demand, topo).sum() == 2
    model = NetModelConfig(
        alpha=0.0, wave_latency_s=0.0, count_exchange_s=0.0, num_experts=8, rel_tol=0.0
    )
    program = deepep_direct_program(demand, topo, record_bytes=1_000_000, model=model)
    fabric = fabric_for(topo, 32, 1.0)
    run = run_program(fabric, program, incast=model.incast(), rel_tol=0.0)
    assert run.dispatch_s == pytest.approx(2 * (1e6 + 8) / 1e9) and run.combine_s == pytest.approx(
        2e-3
    )
    assert program.link_bytes_DL(fabric.num_links)[0, int(fabric.nic_up_NR[0, 1])] == pytest.approx(
        2 * (1e6 + 8)
    )


def _random_fast_program(seed: int):
    """A random 4 x 2 demand, its RAIL plan, BvN waves and FAST program (record 1000 B)."""
    topo = RailTopology(num_nodes=4, gpus_per_node=2, rail_gbps=8.0, nvlink_gBps=2.0)
    rng = np.random.default_rng(seed)
    rec = torch.from_numpy(rng.poisson(3.0, size=(8, 4, 4)))
    rec[:, :, 0] = 0
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.zeros(8, 8, dtype=torch.int64))
    plan = build_plan(demand, topo, "rail")
    waves = bvn_waves(plan.records_NNG.sum(dim=-1).numpy())
    return topo, plan, waves, fast_program(plan, demand, waves, record_bytes=1000, model=FREE)


def test_fast_program_moves_the_rail_plans_bytes_in_bvn_waves():
    # Random 4 x 2 demand: the FAST program's rail bytes equal the RAIL plan's (split over waves),
    # and each wave is one-to-one between nodes.
    topo, plan, waves, program = _random_fast_program(0)
    fabric = fabric_for(topo, 32, 1.0)
    rail_phases = [q for q, name in enumerate(program.names) if name.startswith("dispatch.rail")]
    assert len(rail_phases) == len(waves)
    nvl = program.flows.nvlink_F if hasattr(program.flows, "nvlink_F") else program.nvlink_F
    sel = np.isin(program.flows.phase_F, rail_phases) & ~nvl
    remote = (
        plan.quota_NNG.sum().item() - torch.diagonal(plan.quota_NNG, dim1=0, dim2=1).sum().item()
    )
    assert program.flows.size_bytes_F[sel].sum() == pytest.approx(remote * (1000 + 4 + 12))
    run = run_program(fabric, program, incast=FREE.incast(), rel_tol=0.0)
    assert run.total_s >= run.bound_s


def test_fast_program_overlaps_the_combine_local_round_like_the_schedule():
    # The schedule lets combine.deliver[1] start without combine.deliver[0] (the local round
    # overlaps the waves); the FAST program must give its combine the same overlap, and keep
    # later rounds in order.
    _, _, waves, program = _random_fast_program(1)
    assert len(waves) >= 2
    index = {name: q for q, name in enumerate(program.names)}
    local, first, second = (index[f"combine.deliver[{r}]"] for r in range(3))
    assert local not in program.depends_on[first]
    assert program.depends_on[first] == (index["experts"],)
    assert first in program.depends_on[second]
