"""The arrival model (`arrivals`): expected copies per arrival GPU and rail chunk from per-owner
counts, against hand-worked lists and the compiled schedule's delivery transfers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_railwave.arrivals import arrival_copies_NNCGG, prefix_copies
from megatron_railwave.planner import Path
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.delivery_cases import dispatch_deliveries, subset_demand


def test_prefix_copies_walks_masks_in_ascending_order():
    # 10 records, all for GPU 0, half also for GPU 1: sorted, 0b01 x 5 then 0b11 x 5 (the
    # independent-bit model is exact here). The first 5 carry 5 copies for GPU 0 and none for 1.
    got = prefix_copies(np.array([10.0]), np.array([[10.0, 5.0]]), np.array([[0.0, 5.0, 7.0, 10.0]]))[0]
    assert got == pytest.approx(np.array([[0, 0], [5, 0], [7, 2], [10, 5]], dtype=float), abs=1e-9)


def test_prefix_copies_ends_at_the_owner_s_copies_and_never_decreases():
    rng = np.random.default_rng(3)
    records = rng.integers(1, 200, 40).astype(float)
    copies = np.minimum(rng.random((40, 8)) * records[:, None] * 0.6, records[:, None])
    copies[:, 0] = np.maximum(copies[:, 0], 0.3 * records)  # every owner reaches some GPU often
    x = np.sort(rng.random((40, 6)) * records[:, None], axis=1)
    x = np.concatenate([np.zeros((40, 1)), x, records[:, None]], axis=1)
    got = prefix_copies(records, copies, x)
    assert got[:, 0] == pytest.approx(np.zeros_like(copies), abs=1e-9)
    assert got[:, -1] == pytest.approx(copies, rel=1e-6, abs=1e-6)
    assert np.all(np.diff(got, axis=1) >= -1e-9)


def _one_mask_demand(topo: RailTopology, seed: int) -> DemandCounts:
    """Every owner sends each other node records of one target mask (its own): the independent-
    bit model is exact, so the arrival model must match the compiled schedule's counts."""
    gen = torch.Generator().manual_seed(seed)
    w, n, m = topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node
    wnm = torch.zeros(w, n, m, dtype=torch.int64)
    masks = torch.randint(1, m, (w, n), generator=gen)
    counts = torch.randint(0, 40, (w, n), generator=gen)
    wnm.scatter_(2, masks[:, :, None], counts[:, :, None])
    return DemandCounts(records_WNM=wnm)


def _subset_demand(topo: RailTopology, seed: int) -> DemandCounts:
    return subset_demand(topo, np.random.default_rng(seed))


@pytest.mark.parametrize("make_demand", [_one_mask_demand, _subset_demand], ids=["one-mask", "subsets"])
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize("topo", [RailTopology(num_nodes=3, gpus_per_node=4),
                                  RailTopology(num_nodes=4, gpus_per_node=3, failed_rails=frozenset({(2, 1)}))],
                         ids=["3x4", "4x3-failed-rail"])
def test_arrivals_match_the_compiled_schedule_where_target_bits_are_independent(topo, chunks, make_demand):
    n, g = topo.num_nodes, topo.gpus_per_node
    for seed in range(4):
        demand = make_demand(topo, seed)
        copies_NGNG = demand.copies_WNG().double().numpy().reshape(n, g, n, g)
        got = arrival_copies_NNCGG(demand.records_NGN().double().numpy(), copies_NGNG, topo, chunks)
        plan, rounds = dispatch_deliveries(demand, topo, Path.JOINT, chunks)
        for step, src, dst, rows in rounds:
            if step == 0:
                continue
            want = np.zeros((n, g, g))  # [d, arrival, target]
            np.add.at(want, (dst // g, src % g, dst % g), rows)
            wave, chunk = divmod(step - 1, chunks)
            senders = [(d, s) for d in range(n) for s in range(n) if s != d and plan.pair_wave_NN[s, d] == wave]
            model = np.zeros((n, g, g))
            for d, s in senders:
                model[d] += got[s, d, chunk]
            off = ~np.eye(g, dtype=bool)  # the schedule lists no transfer for a copy that stays
            assert model[:, off] == pytest.approx(want[:, off], abs=1e-6), (seed, step)
