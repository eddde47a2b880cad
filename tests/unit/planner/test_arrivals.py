"""arrival_mask_counts_NGM predicts exactly the masks of the records that arrive at each GPU,
in the order the exchange receives them (owner ascending, then mask ascending)."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.names import Route
from megatron_railwave.planner import (
    arrival_mask_counts_NGM,
    build_plan,
    delivery_copies_NGG,
    route_records,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import mask_bits


@pytest.mark.parametrize("path", list(Route))
@pytest.mark.parametrize("failed", [frozenset(), frozenset({(1, 0)})])
def test_arrival_masks_match_routed_records(path, failed, sim_tools):
    demand_from_masks, _ = sim_tools
    topo = RailTopology(num_nodes=3, gpus_per_node=3, failed_rails=failed)
    gen = torch.Generator().manual_seed(11)
    masks = [torch.randint(0, 8, (40, 3), generator=gen) for _ in range(topo.world_size)]
    demand = demand_from_masks(masks, topo)
    plan = build_plan(demand, topo, path)
    routes = [route_records(plan, r, masks[r]) for r in range(topo.world_size)]
    g = topo.gpus_per_node
    for d in range(topo.num_nodes):
        for l in range(g):
            counts = arrival_mask_counts_NGM(plan, demand, d, l)
            for s in range(topo.num_nodes):
                for owner in range(g):
                    rt = routes[s * g + owner]
                    sel = (rt.node_R == d) & (rt.egress_R == l)
                    # Records the owner sends via GPU l, in its canonical (mask-sorted) order.
                    expected = rt.mask_R[sel]
                    predicted = torch.repeat_interleave(torch.arange(1 << g), counts[s, owner])
                    assert torch.equal(predicted, expected), (d, l, s, owner)
            # Summed with the mask bits, the same counts give the delivery copies.
            copies = torch.einsum("sgm,mj->sj", counts, mask_bits(g))
            assert torch.equal(copies, delivery_copies_NGG(plan, demand, d)[:, l, :])
