"""The path model's compiled parts against their numpy (the reference): ``ops.arrival_copies``
(csrc/cpu/arrivals.cpp) against ``arrivals``, ``ops.path_estimates`` (csrc/cpu/path_model.cpp)
against ``path_model``'s numpy; random full-form and node-view counts (copies per mask class),
1-8 GPUs per node, failed rails, 1-5 rail chunks, random sending windows (some empty), a single
node. The twins take numpy's float operations in numpy's order: equal bits are checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_railwave import ops
from megatron_railwave.planner import WaveSchedule
from megatron_railwave.selector.arrivals import arrival_copies_NNCGG, arrival_copies_reference
from megatron_railwave.selector.path_model import (
    PathCosts,
    class_copies_NGNKG,
    path_estimates,
    path_features,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, mask_classes
from tests.helpers.ops_cases import random_failed_topology

pytestmark = pytest.mark.skipif(
    ops.load_error() is not None or not ops.compiled_for(torch.device("cpu")),
    reason="the compiled ops did not load (make ext)",
)

# The twins do the reference's float operations in the reference's order (numpy's pairwise sum
# along a last axis included), so the results are compared bit for bit. A numpy that changed its
# summation order would fail here first: the message says so.
_SAME_BITS = (
    "the compiled twin and the numpy reference differ (a change of numpy's summation order?)"
)


def _assert_same_bits(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.array_equal(got.view(np.uint64), want.view(np.uint64)), (
        f"{_SAME_BITS}: max |diff| {np.abs(got - want).max() if got.size else 0.0}"
    )


def _full_demand(rng: np.random.Generator, topo: RailTopology, sparsity: float) -> DemandCounts:
    """Mask histograms with a few masks per (rank, node), some (rank, node) empty."""
    w, n, m = topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node
    wnm = np.zeros((w, n, m), dtype=np.int64)
    for r in range(w):
        for d in range(n):
            if rng.random() < sparsity:
                continue
            masks = rng.integers(1, m, size=int(rng.integers(1, 6)))
            wnm[r, d, masks] += rng.integers(0, 60, size=masks.size)
    return DemandCounts(records_WNM=torch.from_numpy(wnm))


def _node_view_demand(rng: np.random.Generator, topo: RailTopology) -> DemandCounts:
    """Per-rank records and copies per mask class and target GPU only (the count exchange's form),
    as a training step's decision sees them: a class's top bits on every one of its records, its
    low bits drawn; now and then counts no routing could give (the twins must still agree)."""
    w, n, g = topo.world_size, topo.num_nodes, topo.gpus_per_node
    k = mask_classes(g)
    top_bits = k.bit_length() - 1
    low = g - top_bits
    class_records = rng.integers(0, 120, size=(w, n, k))
    if low == 0:
        class_records[..., 0] = 0  # class 0 is the empty mask: no record has it
    copies = np.zeros((w, n, k, g), dtype=np.int64)
    copies[..., :low] = rng.binomial(
        class_records[..., None], rng.uniform(0.05, 0.9, size=(w, n, k, low))
    )
    for c in range(k):
        for b in range(top_bits):
            if c >> b & 1:
                copies[..., c, low + b] = class_records[..., c]
    records = class_records.sum(axis=-1)
    if rng.random() < 0.2:
        copies = copies + rng.integers(0, 3, size=copies.shape)
    return DemandCounts(
        records_WN=torch.from_numpy(records), delivery_WNKG=torch.from_numpy(copies)
    )


def _inputs(demand: DemandCounts) -> tuple[np.ndarray, np.ndarray]:
    return demand.records_NGN().to(torch.float64).numpy(), class_copies_NGNKG(demand)


@settings(max_examples=120, deadline=None)
@given(
    num_nodes=st.integers(1, 6),
    gpus=st.integers(1, 8),
    chunks=st.integers(1, 5),
    failed=st.integers(0, 3),
    sparsity=st.sampled_from([0.0, 0.5]),
    node_view=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_arrival_copies_matches_the_reference(
    num_nodes, gpus, chunks, failed, sparsity, node_view, seed
):
    rng = np.random.default_rng(seed)
    topo = random_failed_topology(rng, num_nodes, gpus, failed)
    assume(topo is not None)  # two nodes without a common healthy rail
    demand = _node_view_demand(rng, topo) if node_view else _full_demand(rng, topo, sparsity)
    records, copies = _inputs(demand)
    got = arrival_copies_NNCGG(records, copies, topo, chunks)
    want = arrival_copies_reference(records, copies, topo, chunks)
    assert got.shape == want.shape == (num_nodes, num_nodes, chunks, gpus, gpus)
    _assert_same_bits(got, want)


def test_the_compiled_ops_step_aside_when_forced_off():
    rng = np.random.default_rng(5)
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    records, copies = _inputs(_node_view_demand(rng, topo))
    old = ops.set_forced_reference(True)
    try:
        assert (
            ops.arrival_copies(
                torch.from_numpy(records),
                torch.from_numpy(copies),
                torch.zeros(4, 4, 8, 8, dtype=torch.int64),
                chunks=2,
            )
            is None
        )
        assert (
            ops.path_estimates(
                torch.zeros(32, 4, dtype=torch.int64),
                torch.zeros(32, 4, 4, 8, dtype=torch.int64),
                torch.ones(4, 4, 8, dtype=torch.bool),
                torch.zeros(4, 4, dtype=torch.int64),
                num_windows=1,
                chunks=1,
                record_bytes=8,
                nvlink_bytes_per_s=1e9,
                rail_bytes_per_s=1e9,
                rail_phase_s=0.0,
                layer_s=0.0,
                combine_share=0.75,
            )
            is None
        )
    finally:
        ops.set_forced_reference(old)
    _assert_same_bits(
        arrival_copies_NNCGG(records, copies, topo, 2),
        arrival_copies_reference(records, copies, topo, 2),
    )


@pytest.mark.parametrize("chunks", [1, 2])
def test_path_features_agree_with_either_implementation(chunks):
    rng = np.random.default_rng(11 + chunks)
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    costs = PathCosts(rail_phase_s=3e-5, layer_s=3.5e-5, chunks=chunks)
    for _ in range(4):
        demand = _node_view_demand(rng, topo)
        compiled = path_features(demand, topo, record_bytes=8192, costs=costs)
        old = ops.set_forced_reference(True)
        try:
            reference = path_features(demand, topo, record_bytes=8192, costs=costs)
        finally:
            ops.set_forced_reference(old)
        _assert_same_bits(compiled, reference)


def test_arrival_copies_rejects_inputs_of_the_wrong_kind():
    records = torch.zeros(2, 4, 2, dtype=torch.float64)
    copies = torch.zeros(2, 4, 2, 4, 4, dtype=torch.float64)
    relay = torch.zeros(2, 2, 4, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="records_NGN must be Double"):
        ops.arrival_copies(records.float(), copies, relay, chunks=1)
    with pytest.raises(ValueError, match="relay_NNGG has shape"):
        ops.arrival_copies(records, copies, relay[:, :, :3], chunks=1)
    with pytest.raises(ValueError, match="class_copies_NGNKG has shape"):  # copies per target alone
        ops.arrival_copies(records, copies.sum(dim=3), relay, chunks=1)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        ops.arrival_copies(records, copies, relay, chunks=0)


def _random_windows(rng: np.random.Generator, num_nodes: int) -> WaveSchedule | None:
    """None (all pairs at once) or every remote pair in one of 1-4 random sending windows."""
    if num_nodes < 2 or rng.random() < 0.3:
        return None
    count = int(rng.integers(1, 5))
    pairs = [(s, d) for s in range(num_nodes) for d in range(num_nodes) if s != d]
    slot = rng.integers(0, count, size=len(pairs))
    waves = tuple(tuple(p for p, w in zip(pairs, slot) if w == k) for k in range(count))
    # Empty windows stay in sometimes (a window that sends nothing is one more phase).
    return WaveSchedule(
        num_nodes=num_nodes, waves=waves if rng.random() < 0.3 else tuple(w for w in waves if w)
    )


def _reference_estimates(demand, topo, **kwargs) -> tuple[float, float]:
    old = ops.set_forced_reference(True)
    try:
        return path_estimates(demand, topo, **kwargs)
    finally:
        ops.set_forced_reference(old)


@settings(max_examples=120, deadline=None)
@given(
    num_nodes=st.integers(1, 9),
    gpus=st.integers(1, 8),
    chunks=st.integers(1, 4),
    failed=st.integers(0, 3),
    node_view=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_path_estimates_match_the_reference(num_nodes, gpus, chunks, failed, node_view, seed):
    rng = np.random.default_rng(seed)
    topo = random_failed_topology(rng, num_nodes, gpus, failed)
    assume(topo is not None)
    demand = _node_view_demand(rng, topo) if node_view else _full_demand(rng, topo, 0.3)
    kwargs = dict(
        record_bytes=int(rng.choice([2, 7168, 8192])),
        windows=_random_windows(rng, num_nodes),
        costs=PathCosts(rail_phase_s=float(rng.uniform(0, 1e-4)), layer_s=3.5e-5, chunks=chunks),
    )
    got = path_estimates(demand, topo, **kwargs)
    want = _reference_estimates(demand, topo, **kwargs)
    assert all(isinstance(v, float) for v in got)
    _assert_same_bits(got, want)


def test_path_estimates_give_the_reference_s_bits_on_a_shipped_size():
    rng = np.random.default_rng(21)
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    for chunks in (1, 2):
        for _ in range(10):
            demand = _node_view_demand(rng, topo)
            kwargs = dict(
                record_bytes=8192,
                windows=_random_windows(rng, 4),
                costs=PathCosts(rail_phase_s=3e-5, layer_s=3.5e-5, chunks=chunks),
            )
            _assert_same_bits(
                path_estimates(demand, topo, **kwargs), _reference_estimates(demand, topo, **kwargs)
            )


def test_path_estimates_reject_inputs_of_the_wrong_kind():
    n, g = 2, 4
    args = [
        torch.zeros(n * g, n, dtype=torch.int64),
        torch.zeros(n * g, n, 4, g, dtype=torch.int64),
        torch.ones(n, n, g, dtype=torch.bool),
        torch.zeros(n, n, dtype=torch.int64),
    ]
    kwargs = dict(
        num_windows=1,
        chunks=1,
        record_bytes=8,
        nvlink_bytes_per_s=1e9,
        rail_bytes_per_s=1e9,
        rail_phase_s=0.0,
        layer_s=0.0,
        combine_share=0.75,
    )
    assert ops.path_estimates(*args, **kwargs).shape == (2,)
    with pytest.raises(ValueError, match="window_NN must be Long"):
        ops.path_estimates(*args[:3], args[3].int(), **kwargs)
    with pytest.raises(ValueError, match="copies_WNKG has shape"):
        ops.path_estimates(args[0], args[1][:, :, :3], *args[2:], **kwargs)
    with pytest.raises(ValueError, match="copies_WNKG has shape"):  # copies per target alone
        ops.path_estimates(args[0], args[1].sum(dim=2), *args[2:], **kwargs)
    with pytest.raises(ValueError, match="records_WN must be Long"):
        ops.path_estimates(args[0].double(), *args[1:], **kwargs)


@pytest.mark.parametrize("gpus", [1, 3, 4, 8])
def test_arrival_copies_match_the_reference_on_fractional_counts(gpus):
    # The op takes any float64 counts (the path model passes whole ones): with fractions no sum is
    # exact any more, so every value must be derived in the reference's way.
    rng = np.random.default_rng(gpus)
    topo = RailTopology(num_nodes=3, gpus_per_node=gpus)
    records, copies = _inputs(_node_view_demand(rng, topo))
    scale = rng.uniform(0.3, 0.9)
    for chunks in (1, 3):
        _assert_same_bits(
            arrival_copies_NNCGG(records * scale, copies * scale, topo, chunks),
            arrival_copies_reference(records * scale, copies * scale, topo, chunks),
        )
