"""Demand forms: one scaling rule for dense, sparse and request counts; sparse equals dense."""

import numpy as np
import pytest
import torch

from megatron_railwave.lab.workloads import (
    GlmAirWorkload,
    demand_from_topk_ids,
    glm_air_layer_ids,
    scaled_counts,
    scaled_demand,
    sparse_demand_from_topk_ids,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts


def test_scaled_demand_rounds_every_count_half_to_even():
    rec = torch.tensor([[[0, 3, 1, 2]]])
    demand = DemandCounts(records_WNM=rec, experts_WE=torch.tensor([[5, 3]]))
    assert scaled_demand(demand, 1.5).records_WNM.tolist() == [[[0, 4, 2, 3]]]  # 4.5 -> 4, 1.5 -> 2
    assert scaled_demand(demand, 1.5).experts_WE.tolist() == [
        [8, 4]
    ]  # (token, expert) pairs scale too
    assert scaled_demand(demand, 1.0) is demand
    assert scaled_demand(rec, 1.5).tolist() == [[[0, 4, 2, 3]]]  # a request's record counts
    assert scaled_counts(np.array([1, 3]), 0.5).tolist() == [0, 2]  # 0.5 -> 0, 1.5 -> 2
    with pytest.raises(ValueError, match="scale must be > 0, got 0"):
        scaled_demand(demand, 0)


def test_sparse_and_dense_scale_alike():
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    ids = glm_air_layer_ids(topo, 5, GlmAirWorkload(num_tokens=64))
    dense = demand_from_topk_ids(ids, topo, 128)
    sparse = sparse_demand_from_topk_ids(ids, topo, 128, chunk=5)
    for scale in (0.5, 1.7):
        d, s = scaled_demand(dense, scale), scaled_demand(sparse, scale)
        for node in range(4):
            assert torch.equal(s.masks_into(node), d.masks_into(node))
        assert torch.equal(s.records_NGN(), d.records_NGN())
