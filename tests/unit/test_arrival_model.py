"""The arrival model (`arrivals`): expected copies per arrival GPU and rail chunk from per-owner
counts, against hand-worked lists and the compiled schedule's delivery transfers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_railwave.names import Route
from megatron_railwave.selector.arrivals import arrival_copies_NNCGG, prefix_copies
from megatron_railwave.selector.path_model import class_copies_NGNKG
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, mask_classes
from tests.helpers.delivery_cases import dispatch_deliveries, subset_demand


def test_prefix_copies_walks_masks_in_ascending_order():
    # 10 records, all for GPU 0, half also for GPU 1: sorted, 0b01 x 5 then 0b11 x 5. With 2 GPUs
    # per node every mask is its own class: the first 5 carry 5 copies for GPU 0 and none for 1.
    class_copies = np.array([[[0.0, 0.0], [5.0, 0.0], [0.0, 0.0], [5.0, 5.0]]])
    got = prefix_copies(np.array([10.0]), class_copies, np.array([[0.0, 5.0, 7.0, 10.0]]))[0]
    assert got == pytest.approx(np.array([[0, 0], [5, 0], [7, 2], [10, 5]], dtype=float), abs=1e-9)


def test_prefix_copies_walks_the_low_bits_inside_a_class():
    # 4 GPUs: classes by bits 3 and 2. Class 0: 4 records, masks 0b0001 x 2 then 0b0011 x 2 (bit 0
    # on all, bit 1 on half: independent, exact); class 2 (bit 3): 6 records, masks 0b1000 x 3 then
    # 0b1010 x 3 (the empty low mask is a record's too here).
    class_copies = np.zeros((1, 4, 4))
    class_copies[0, 0] = [4, 2, 0, 0]
    class_copies[0, 2] = [0, 3, 0, 6]
    got = prefix_copies(
        np.array([10.0]), class_copies, np.array([[2.0, 3.0, 4.0, 5.0, 8.0, 10.0]])
    )[0]
    want = [[2, 0, 0, 0], [3, 1, 0, 0], [4, 2, 0, 0], [4, 2, 0, 1], [4, 3, 0, 4], [4, 5, 0, 6]]
    assert got == pytest.approx(np.array(want, dtype=float), abs=1e-9)


def _random_class_copies(
    rng: np.random.Generator, lists: int, g: int
) -> tuple[np.ndarray, np.ndarray]:
    """(records [I], class copies [I, K, G]) that some routing could give: a class's top bits on
    each of its records, its low bits' copies at most its records, every class-0 record with a
    low bit (at least one low target gets all of them)."""
    k = mask_classes(g)
    top_bits = k.bit_length() - 1
    low = g - top_bits
    class_records = rng.integers(1, 80, size=(lists, k)).astype(float)
    copies = np.zeros((lists, k, g))
    copies[..., :low] = np.floor(rng.random((lists, k, low)) * class_records[..., None] * 0.7)
    copies[:, 0, 0] = class_records[:, 0]
    for c in range(1, k):
        for b in range(top_bits):
            if c >> b & 1:
                copies[:, c, low + b] = class_records[:, c]
    return class_records.sum(axis=1), copies


def test_prefix_copies_ends_at_the_owner_s_copies_and_never_decreases():
    rng = np.random.default_rng(3)
    records, class_copies = _random_class_copies(rng, 40, 8)
    x = np.sort(rng.random((40, 6)) * records[:, None], axis=1)
    x = np.concatenate([np.zeros((40, 1)), x, records[:, None]], axis=1)
    got = prefix_copies(records, class_copies, x)
    assert got[:, 0] == pytest.approx(np.zeros((40, 8)), abs=1e-9)
    assert got[:, -1] == pytest.approx(class_copies.sum(axis=1), rel=1e-6, abs=1e-6)
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


def _mask_per_class_demand(topo: RailTopology, seed: int) -> DemandCounts:
    """Every owner sends each other node records of one mask per mask class, their low bits
    different in each class: bits correlated across the classes (copies per target alone would
    not show which targets travel together), independent inside each: the model is exact."""
    gen = torch.Generator().manual_seed(seed)
    w, n, g = topo.world_size, topo.num_nodes, topo.gpus_per_node
    k = mask_classes(g)
    low = g - (k.bit_length() - 1)
    wnm = torch.zeros(w, n, 1 << g, dtype=torch.int64)
    for c in range(k):
        patterns = torch.randint(1 if c == 0 else 0, 1 << low, (w, n), generator=gen)
        wnm.scatter_add_(
            2, ((c << low) + patterns)[:, :, None], torch.randint(0, 30, (w, n, 1), generator=gen)
        )
    return DemandCounts(records_WNM=wnm)


@pytest.mark.parametrize(
    "make_demand",
    [_one_mask_demand, _subset_demand, _mask_per_class_demand],
    ids=["one-mask", "subsets", "mask-per-class"],
)
@pytest.mark.parametrize("chunks", [1, 2, 3])
@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=3, gpus_per_node=4),
        RailTopology(num_nodes=4, gpus_per_node=3, failed_rails=frozenset({(2, 1)})),
    ],
    ids=["3x4", "4x3-failed-rail"],
)
def test_arrivals_match_the_compiled_schedule_where_target_bits_are_independent(
    topo, chunks, make_demand
):
    n, g = topo.num_nodes, topo.gpus_per_node
    for seed in range(4):
        demand = make_demand(topo, seed)
        got = arrival_copies_NNCGG(
            demand.records_NGN().double().numpy(), class_copies_NGNKG(demand), topo, chunks
        )
        plan, rounds = dispatch_deliveries(demand, topo, Route.JOINT, chunks)
        for step, src, dst, rows in rounds:
            if step == 0:
                continue
            want = np.zeros((n, g, g))  # [d, arrival, target]
            np.add.at(want, (dst // g, src % g, dst % g), rows)
            wave, chunk = divmod(step - 1, chunks)
            senders = [
                (d, s)
                for d in range(n)
                for s in range(n)
                if s != d and plan.pair_wave_NN[s, d] == wave
            ]
            model = np.zeros((n, g, g))
            for d, s in senders:
                model[d] += got[s, d, chunk]
            off = ~np.eye(g, dtype=bool)  # the schedule lists no transfer for a copy that stays
            assert model[:, off] == pytest.approx(want[:, off], abs=1e-6), (seed, step)
