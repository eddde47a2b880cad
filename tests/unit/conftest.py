"""Pure-Python reference for the planner tests: demand from target masks and a record-by-record
simulation of the three stages (relay to the proxy, rail transfer, delivery to the targets).

Letters: N nodes, G GPUs per node, M = 2**G masks, T tokens of one rank, W ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from megatron_railwave.planner import PathPlan, route_records
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts


def demand_from_masks(masks_by_rank: list[torch.Tensor], topo: RailTopology) -> DemandCounts:
    """DemandCounts from every rank's [T, N] target masks (experts_WE unused by the planner:
    zeros)."""
    n, m = topo.num_nodes, 1 << topo.gpus_per_node
    rows = []
    for masks_TN in masks_by_rank:
        keys = (torch.arange(n) * m + masks_TN).flatten()
        rec = torch.bincount(keys, minlength=n * m).view(n, m)
        rec[:, 0] = 0
        rows.append(rec)
    return DemandCounts(
        records_WNM=torch.stack(rows), experts_WE=torch.zeros(topo.world_size, 1, dtype=torch.int64)
    )


@dataclass
class Simulation:
    """Counters keyed by tuples, filled record by record.

    relay[(s, d, owner, egress)]: remote records of owner GPU (s, owner) leaving on GPU (s, egress).
    rail[(s, egress, d, wave)]: records on the rail GPU (s, egress) -> GPU (d, egress).
    deliver[(d, arrive, target, s, round)]: copies that GPU (d, arrive) hands to GPU (d, target)
        (round 0: the local node's records; round v + 1: rail wave v).
    delivered[(rank, token, d, target)]: copies of a token that reach a target GPU.
    records[(rank, token, d)]: how often each record was routed.
    """

    relay: Counter
    rail: Counter
    deliver: Counter
    delivered: Counter
    records: Counter


def simulate(plan: PathPlan, masks_by_rank: list[torch.Tensor]) -> Simulation:
    topo = plan.topology
    g = topo.gpus_per_node
    sim = Simulation(Counter(), Counter(), Counter(), Counter(), Counter())
    for rank, masks_TN in enumerate(masks_by_rank):
        s, own = topo.node_of(rank), topo.local_of(rank)
        r = route_records(plan, rank, masks_TN)
        for tok, d, mask, egress, wave in zip(
            r.token_R.tolist(),
            r.node_R.tolist(),
            r.mask_R.tolist(),
            r.egress_R.tolist(),
            r.wave_R.tolist(),
        ):
            assert mask == int(masks_TN[tok, d]) and mask != 0
            sim.records[(rank, tok, d)] += 1
            if d == s:
                assert egress == own and wave == -1  # the local node needs no rail and no relay
                arrive, rnd = own, 0
            else:
                assert topo.pair_gpu_eligible(s, d)[egress], "a record left on a failed rail"
                assert wave == int(plan.pair_wave_NN[s, d]) >= 0
                sim.relay[(s, d, own, egress)] += 1
                sim.rail[(s, egress, d, wave)] += 1
                arrive, rnd = egress, wave + 1  # round 0 is the local node's records
            for j in range(g):
                if mask >> j & 1:
                    sim.deliver[(d, arrive, j, s, rnd)] += 1
                    sim.delivered[(rank, tok, d, j)] += 1
    return sim


@pytest.fixture
def sim_tools():
    return demand_from_masks, simulate
