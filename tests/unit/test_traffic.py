"""Records, demand counts and the descriptors B, rho_g and kappa, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import (
    DemandCounts,
    MiB,
    SelectorScales,
    dtype_bytes,
    local_demand,
    mask_bits,
    rail_imbalance,
    receiver_concentration,
    target_masks,
    traffic_stats,
)


def _routing(num_tokens: int, num_experts: int, rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for t, experts in enumerate(rows):
        out[t, experts] = True
    return out


# 2 nodes x 2 GPUs, 8 experts: 2 per rank, rank r owns experts 2r and 2r+1.
#   rank 0 = GPU (0,0): e0 e1 | rank 1 = (0,1): e2 e3 | rank 2 = (1,0): e4 e5 | rank 3 = (1,1): e6
# e7
TOPO_2x2 = RailTopology(num_nodes=2, gpus_per_node=2)
ROUTING = _routing(
    4,
    8,
    [
        [0, 3],  # node 0: GPUs 0 and 1 -> mask 0b11 = 3; node 1: none
        [4, 5],  # node 1: GPU 0 (both experts on rank 2) -> mask 1; one record, not two
        [7, 1],  # node 0: GPU 0 -> mask 1; node 1: GPU 1 -> mask 2
        [],  # no expert: no record
    ],
)


def test_target_masks_dedup_per_node():
    assert target_masks(ROUTING, TOPO_2x2).tolist() == [[3, 0], [0, 1], [1, 2], [0, 0]]


def test_local_demand_counts_records_and_expert_pairs():
    records_NM, experts_E = local_demand(ROUTING, TOPO_2x2)
    # node 0: one record with mask 1 (token 2), one with mask 3 (token 0)
    # node 1: one with mask 1 (token 1), one with mask 2 (token 2)
    assert records_NM.tolist() == [[0, 1, 0, 1], [0, 1, 1, 0]]
    assert experts_E.tolist() == [1, 1, 0, 1, 1, 1, 0, 1]


def test_demand_counts_records_ngn_and_copies():
    empty = torch.zeros(4, 8, dtype=torch.bool)
    demand = DemandCounts.from_routing_maps([ROUTING, empty, empty, empty], TOPO_2x2)
    assert demand.world_size == 4 and demand.num_nodes == 2
    # records_NGN[s, g, d]: GPU (0, 0) owns 2 records for node 0 and 2 for node 1.
    assert demand.records_NGN()[0].tolist() == [[2, 2], [0, 0]]
    # copies: mask 3 gives one copy to each GPU of node 0, mask 1 one to GPU 0.
    assert demand.copies_WNG()[0].tolist() == [[2, 1], [1, 1]]


def test_target_masks_experts_not_divisible_raises():
    with pytest.raises(
        ValueError, match=r"num_experts=6 is not divisible by the expert-parallel size 4"
    ):
        target_masks(torch.zeros(2, 6, dtype=torch.bool), TOPO_2x2)


def test_demand_counts_world_size_mismatch_raises():
    with pytest.raises(
        ValueError, match=r"2 nodes x 2 GPUs = 4 ranks, but the expert-parallel group has 3"
    ):
        DemandCounts.from_routing_maps([ROUTING] * 3, TOPO_2x2)


def test_mask_bits_layout():
    # row m holds the bits of m, least significant first
    assert mask_bits(2).tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]


@pytest.mark.parametrize(("name", "size"), [("bf16", 2), ("fp16", 2), ("fp32", 4), ("fp8", 1)])
def test_dtype_bytes_names(name, size):
    assert dtype_bytes(name) == size


def test_dtype_bytes_torch_dtype_and_unknown_name():
    assert dtype_bytes(torch.bfloat16) == 2 and dtype_bytes(torch.float32) == 4
    with pytest.raises(ValueError, match=r"unknown dtype name 'int3'"):
        dtype_bytes("int3")


def _load(entries: dict[tuple[int, int, int], int], n: int, r: int) -> torch.Tensor:
    out = torch.zeros(n, r, n, dtype=torch.int64)
    for (s, rail, d), v in entries.items():
        out[s, rail, d] = v
    return out


def test_rail_imbalance_max_over_mean_ignores_local():
    # 2 nodes x 2 rails; remote egress per (node, rail) = [[6, 2], [4, 4]], mean 4, max 6.
    # The local entries (0, 0, 0) = 100 and (1, 1, 1) = 50 need no rail and are ignored.
    load = _load(
        {(0, 0, 1): 6, (0, 1, 1): 2, (1, 0, 0): 4, (1, 1, 0): 4, (0, 0, 0): 100, (1, 1, 1): 50},
        2,
        2,
    )
    assert rail_imbalance(load, RailTopology(num_nodes=2, gpus_per_node=2)) == pytest.approx(1.5)


def test_rail_imbalance_mean_over_healthy_rails_only():
    # rail 1 of node 1 failed: egress [[6, 2], [8, -]], mean over 3 healthy ports = 16/3, max 8.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, failed_rails=frozenset({(1, 1)}))
    load = _load({(0, 0, 1): 6, (0, 1, 1): 2, (1, 0, 0): 8}, 2, 2)
    assert rail_imbalance(load, topo) == pytest.approx(8 / (16 / 3))


def test_rail_imbalance_no_traffic_is_one():
    assert (
        rail_imbalance(
            torch.zeros(2, 2, 2, dtype=torch.int64), RailTopology(num_nodes=2, gpus_per_node=2)
        )
        == 1.0
    )


def test_receiver_concentration_equal_and_dominant_senders():
    # 3 nodes, 1 rail, all pairs in one window. Into node 2: 5 from node 0 and 5 from node 1 ->
    # (5 + 5)^2 / (25 + 25) = 2. Into node 0: 9 from node 1, 1 from node 2 -> 100 / 82.
    load = _load({(0, 0, 2): 5, (1, 0, 2): 5, (1, 0, 0): 9, (2, 0, 0): 1}, 3, 1)
    one_window = torch.tensor([[-1, 0, 0], [0, -1, 0], [0, 0, -1]])
    assert receiver_concentration(load, one_window) == pytest.approx(2.0)
    only_node0 = _load({(1, 0, 0): 9, (2, 0, 0): 1}, 3, 1)
    assert receiver_concentration(only_node0, one_window) == pytest.approx(100 / 82)
    # Cyclic waves (wave k: s -> s + k + 1 mod 3) put the two senders of node 2 apart: kappa = 1.
    cyclic = torch.tensor([[-1, 0, 1], [1, -1, 0], [0, 1, -1]])
    assert receiver_concentration(load, cyclic) == pytest.approx(1.0)
    assert receiver_concentration(torch.zeros(3, 1, 3), one_window) == 1.0


def test_traffic_stats_b_rho_kappa_and_coords():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    # records_NGN[s, g, d]; remote records per GPU: (0,0): 3, (0,1): 1, (1,0): 0, (1,1): 4
    records_NGN = torch.tensor([[[7, 3], [0, 1]], [[0, 0], [4, 9]]])
    load = _load({(0, 0, 1): 3, (0, 1, 1): 1, (1, 1, 0): 4}, 2, 2)
    windows = torch.tensor([[-1, 0], [0, -1]])
    st = traffic_stats(records_NGN, load, windows, topo, record_bytes=1024)
    assert st.B_mean_bytes == 2 * 1024 and st.B_max_bytes == 4 * 1024
    assert st.rho_g == pytest.approx(4 / 2)  # egress [[3, 1], [0, 4]], mean 2
    assert st.kappa == pytest.approx(1.0)
    assert st.records_total == 24 and st.remote_records == 8
    # default scales: 56 MiB, R - 1 = 1, max(N - 2, 1) = 1
    assert st.coords == pytest.approx((math.log2(2048 / (56 * MiB)), 1.0, 0.0))
    assert set(st.to_dict()) == {
        "B_mean_bytes",
        "B_max_bytes",
        "rho_g",
        "kappa",
        "coords",
        "records_total",
        "remote_records",
    }


def test_selector_scales_defaults_follow_topology():
    # The paper's 4 nodes x 8 rails: (rho_g - 1) / 7 and (kappa - 1) / 2.
    assert SelectorScales().resolve(RailTopology(num_nodes=4, gpus_per_node=8)) == (
        56 * MiB,
        7.0,
        2.0,
    )
    assert SelectorScales(payload_ref_bytes=1.0, rho_scale=3.0, kappa_scale=5.0).resolve(
        TOPO_2x2
    ) == (1.0, 3.0, 5.0)
