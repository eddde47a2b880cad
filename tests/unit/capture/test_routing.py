"""Routing conversions: routing map <-> top-k ids, and demand straight from ids."""

import numpy as np
import pytest
import torch

from megatron_railwave.telemetry.capture import (
    demand_from_topk_ids,
    routing_map_from_topk_ids,
    topk_ids_from_routing_map,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts


def test_topk_ids_from_routing_map_sorts_and_pads():
    # Token 0 -> experts 5, 1; token 1 -> none; token 2 -> 0, 2, 7 (K = 3).
    rmap = torch.zeros(3, 8, dtype=torch.bool)
    rmap[0, [5, 1]] = True
    rmap[2, [7, 0, 2]] = True
    ids = topk_ids_from_routing_map(rmap, 3)
    assert ids.dtype == np.int16
    assert ids.tolist() == [[1, 5, -1], [-1, -1, -1], [0, 2, 7]]
    assert torch.equal(routing_map_from_topk_ids(ids, 8), rmap)


def test_topk_ids_from_routing_map_rejects_rows_over_topk():
    rmap = torch.zeros(2, 8, dtype=torch.bool)
    rmap[1, :3] = True
    with pytest.raises(ValueError, match=r"row 1 selects 3 experts but topk=2"):
        topk_ids_from_routing_map(rmap, 2)


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (3, 4), (4, 2)])
def test_demand_from_topk_ids_matches_routing_maps(nodes, gpus):
    topo = RailTopology(num_nodes=nodes, gpus_per_node=gpus)
    world, num_experts, k = topo.world_size, 4 * topo.world_size, 3
    rng = np.random.default_rng(nodes * 10 + gpus)
    ids = np.stack(
        [
            np.stack([rng.choice(num_experts, k, replace=False) for _ in range(20)])
            for _ in range(world)
        ]
    ).astype(np.int16)
    ids[0, 3, 1:] = -1  # a token with one expert
    ids[1, 4, :] = -1  # a padding token
    maps = [routing_map_from_topk_ids(ids_TK, num_experts) for ids_TK in ids]
    ref = DemandCounts.from_routing_maps(maps, topo)
    got = demand_from_topk_ids(ids, topo, num_experts)
    assert torch.equal(got.records_WNM, ref.records_WNM)
    assert torch.equal(got.experts_WE, ref.experts_WE)
