"""The delivery maps built from the counts alone (``exchange.layout._delivery_runs``) against the
maps read off explicit arrival masks (every row's mask, its target hits, the nonzeros of each
round's [G, rows] hit matrix: what the layout computed before it stopped looking at masks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_railwave.exchange.layout import _deliver_index, _delivery_runs


def _maps_from_masks(rows_C: np.ndarray, cells_R: np.ndarray, g: int) -> list[np.ndarray]:
    """Per round, arrival row of each delivered copy, target-major: from the rows' masks."""
    m = 1 << g
    out, cell = [], 0
    for size in cells_R:
        counts = rows_C[cell : cell + size]
        masks = np.repeat(np.arange(size) % m, counts)  # every arriving row's mask, in order
        hit_GA = (masks[None, :] >> np.arange(g)[:, None]) & 1
        out.append(np.nonzero(hit_GA)[1])  # row-major: target j, then row
        cell += size
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("g", [1, 2, 3, 8])
def test_delivery_runs_match_the_maps_read_off_the_masks(seed: int, g: int) -> None:
    rng = np.random.default_rng(seed * 10 + g)
    m = 1 << g
    # Round 0: the GPU's own records by mask; rounds >= 1: some sources x G owners x M masks,
    # rounds without sources and cells without rows included, few masks used (as in real layers).
    sources_R = rng.integers(0, 4, size=int(rng.integers(0, 6)))
    cells_R = np.concatenate([[m], sources_R * g * m]).astype(np.int64)
    total = int(cells_R.sum())
    rows_C = np.where(rng.random(total) < 0.15, rng.integers(1, 9, size=total), 0).astype(np.int64)
    runs = _delivery_runs(own_M=rows_C[:m], arrive=rows_C[m:], cells_R=cells_R, g=g)
    maps = _deliver_index(runs, torch.from_numpy(runs.shift_and_length.reshape(-1, 2)))
    expected = _maps_from_masks(rows_C, cells_R, g)
    assert len(maps) == len(expected) == cells_R.size
    for got, want in zip(maps, expected):
        assert got.tolist() == want.tolist()
    starts = np.concatenate([[0], np.cumsum(cells_R)])
    assert runs.arrivals_R == [int(rows_C[a:b].sum()) for a, b in zip(starts, starts[1:])]
    assert runs.copies_R == [e.size for e in expected]


def test_delivery_runs_of_no_rows() -> None:
    runs = _delivery_runs(
        own_M=np.zeros(4, np.int64), arrive=np.zeros(8, np.int64), cells_R=np.array([4, 8]), g=2
    )
    maps = _deliver_index(runs, torch.from_numpy(runs.shift_and_length.reshape(-1, 2)))
    assert [t.numel() for t in maps] == [0, 0] and runs.arrivals_R == [0, 0]


def test_build_layout_refuses_a_view_whose_local_counts_disagree() -> None:
    from dataclasses import replace

    from megatron_railwave.exchange.layout import build_layout
    from megatron_railwave.planner import build_plan
    from megatron_railwave.schedule import RecordWireFormat, compile_for_rank
    from megatron_railwave.topology import RailTopology
    from megatron_railwave.traffic import DemandCounts

    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    rng = np.random.default_rng(0)
    records = rng.integers(1, 4, size=(4, 2, 4)).astype(np.int64)
    records[:, :, 0] = 0  # mask 0 is "no record"
    demand = DemandCounts(
        records_WNM=torch.from_numpy(records), experts_WE=torch.zeros(4, 1, dtype=torch.int64)
    )
    plan = build_plan(demand, topo, "joint")
    wire = RecordWireFormat(
        hidden=4, payload_dtype=torch.float32, probs_dtype=torch.float32, experts_per_node=2
    )
    compiled = compile_for_rank(plan, wire, demand=demand, node=0, rank=1)
    n_rec = compiled.view.num_records
    node_R = torch.zeros(n_rec, dtype=torch.int64)
    counts = compiled.view.owner_category_counts
    bad = replace(compiled.view, owner_category_counts=counts[:-1] + [counts[-1] + 1])
    with pytest.raises(RuntimeError, match="rank 1: its local-node records by mask sum to"):
        build_layout(plan, bad, token_R=node_R, node_R=node_R, counts=compiled.layout_counts)
