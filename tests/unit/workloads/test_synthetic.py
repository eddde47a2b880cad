"""The successive-sampling top-k sampler and the simple synthetic workload."""

import numpy as np
import pytest
import torch

from megatron_railwave.lab.workloads import (
    demand_from_topk_ids,
    one_destination_topk_ids,
    sample_topk_ids,
    synthetic_routing_maps,
)
from megatron_railwave.topology import RailTopology


def _gumbel_inclusion(weights_E, k, n, rng):
    keys = np.log(weights_E)[None, :] + rng.gumbel(size=(n, weights_E.size))
    top = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    return np.bincount(top.ravel(), minlength=weights_E.size) / n


def test_sample_topk_ids_distinct_sorted_and_seeded():
    w = np.random.default_rng(0).lognormal(size=(3, 32))
    a = sample_topk_ids(w, num_tokens=500, topk=6, rng=np.random.default_rng(7))
    b = sample_topk_ids(w, num_tokens=500, topk=6, rng=np.random.default_rng(7))
    assert a.shape == (3, 500, 6) and a.dtype == np.int16
    assert (np.diff(a, axis=-1) > 0).all()
    assert np.array_equal(a, b)


def test_sample_topk_ids_matches_gumbel_topk_inclusion():
    # Row 0: two dominant experts and near-zero ones (exercises the exact completion path);
    # row 1: mild skew. Inclusion frequencies must match Gumbel top-k (same distribution).
    w = np.array([[1000.0, 500.0] + [1.0] * 6 + [0.01] * 8, [5.0] * 8 + [1.0] * 8])
    n = 40000
    ids = sample_topk_ids(w, num_tokens=n, topk=4, rng=np.random.default_rng(1))
    rng = np.random.default_rng(2)
    for row in range(2):
        got = np.bincount(ids[row].ravel(), minlength=16) / n
        ref = _gumbel_inclusion(w[row], 4, n, rng)
        np.testing.assert_allclose(got, ref, atol=0.012)


def test_synthetic_routing_maps_keeps_signature():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    maps = synthetic_routing_maps(topo, num_tokens=16, num_experts=8, topk=2, seed=3)
    again = synthetic_routing_maps(topo, num_tokens=16, num_experts=8, topk=2, seed=3)
    assert len(maps) == 4 and all(m.shape == (16, 8) and m.dtype == torch.bool for m in maps)
    assert all(int(m.sum(dim=1).min()) == 2 == int(m.sum(dim=1).max()) for m in maps)
    assert all(torch.equal(a, b) for a, b in zip(maps, again))


def test_one_destination_topk_ids_sends_every_source_node_to_one_node():
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    ids = one_destination_topk_ids(
        topo, records_per_gpu=20, destination=1, source_weights=(1.0, 0.5, 2.0)
    )
    demand = demand_from_topk_ids(ids, topo, topo.world_size)
    records_WN = demand.records_WN.numpy()
    expected = np.zeros((32, 4), dtype=np.int64)
    for node, count in zip((0, 2, 3), (20, 10, 40)):
        expected[node * 8 : (node + 1) * 8, 1] = count
    assert (records_WN == expected).all()  # node 1 sends nothing, every source rail the same count
    assert ids.dtype == np.int64 and ids.shape == (32, 40, 1)
    per_gpu = np.bincount(ids[ids >= 0].ravel() - 8, minlength=8)
    assert (
        per_gpu.min() == per_gpu.max() == (20 + 10 + 40) * 8 // 8
    )  # uniform over the destination GPUs
    with pytest.raises(ValueError, match="source weights"):
        one_destination_topk_ids(topo, records_per_gpu=20, source_weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="source weights"):
        one_destination_topk_ids(topo, records_per_gpu=20, source_weights=(1.0, float("inf"), 1.0))
    with pytest.raises(ValueError, match="destination"):
        one_destination_topk_ids(topo, records_per_gpu=20, destination=4)
    with pytest.raises(ValueError, match="records_per_gpu"):
        one_destination_topk_ids(topo, records_per_gpu=2.5)
    with pytest.raises(ValueError, match="at least 2 nodes"):
        one_destination_topk_ids(RailTopology(num_nodes=1, gpus_per_node=8), records_per_gpu=4)
