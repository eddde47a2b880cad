"""The testbed's strict port bound (``testbed.experiment.port_bound``) on layouts worked out by
hand.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, K top-k, E experts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_railwave.lab.testbed.experiment import port_bound
from megatron_railwave.names import parse_route
from megatron_railwave.planner import build_plan
from megatron_railwave.schedule import RecordWireFormat, compile_schedule
from megatron_railwave.telemetry.capture import demand_from_topk_ids
from megatron_railwave.topology import RailTopology

_WIRE = RecordWireFormat(
    hidden=64, payload_dtype=torch.bfloat16, probs_dtype=torch.float32, experts_per_node=2
)


def _ids(rows: list[list[int]]) -> np.ndarray:
    """[W, T, 1] expert ids, one expert per token."""
    return np.asarray(rows, dtype=np.int64)[:, :, None]


def test_port_bound_two_nodes_one_rail_by_hand():
    # 2 nodes x 1 GPU, E = 4 (experts 0-1 on node 0, 2-3 on node 1), K = 1.
    # Rank 0: 3 tokens to node 1 and 1 kept at home; rank 1: 1 token to node 0, 3 kept.
    topo = RailTopology(num_nodes=2, gpus_per_node=1)
    demand = demand_from_topk_ids(_ids([[2, 3, 2, 0], [0, 2, 3, 3]]), topo, 4)
    schedule = compile_schedule(build_plan(demand, topo, parse_route("native")), _WIRE)
    d, c, rate = _WIRE.dispatch_bytes, _WIRE.combine_bytes, 1000.0
    out = port_bound(schedule, rate)
    # Whole layer: rank 0 sends 3 dispatch rows + 1 combine row; receives 1 + 3.
    assert out["port_bound_s"] == pytest.approx((3 * d + c) / rate)
    assert out["nic_bytes_NR"] == [[3 * d + c + d + 3 * c], [d + 3 * c + 3 * d + c]]


def test_port_bound_rail_balance_halves_a_one_rail_layer():
    # 2 nodes x 2 GPUs, E = 8 (2 per rank). Only the GPU-0 ranks send off-node (rank 0 -> expert 4
    # on node 1, rank 2 -> expert 0 on node 0); the GPU-1 ranks keep their tokens at home. NATIVE
    # sends on the source GPU's rail, so rail 0 carries everything; RAIL spreads it over both.
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    ids = _ids([[4] * 8, [0] * 8, [0] * 8, [4] * 8])
    demand = demand_from_topk_ids(ids, topo, 8)
    bounds = {
        path: port_bound(compile_schedule(build_plan(demand, topo, parse_route(path)), _WIRE), 1e6)
        for path in ("native", "rail")
    }
    assert bounds["rail"]["port_bound_s"] == pytest.approx(bounds["native"]["port_bound_s"] / 2)
    # NATIVE: rail 0 carries everything on both nodes; RAIL: both rails equal.
    assert [row[1] for row in bounds["native"]["nic_bytes_NR"]] == [0, 0]
    assert all(row[0] == row[1] for row in bounds["rail"]["nic_bytes_NR"])
