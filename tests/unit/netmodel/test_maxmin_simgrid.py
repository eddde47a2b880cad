"""Cross-check of the max-min engine against SimGrid (CM02, zero latency, Full update).

SimGrid runs under the system interpreter (Debian's python3-simgrid) through
`megatron_railwave.lab.netmodel.simgrid_check`; the test is skipped when that is missing.
"""

import numpy as np
import pytest

from megatron_railwave.lab.netmodel import FlowSet, Network, simulate
from megatron_railwave.lab.netmodel.simgrid_check import (
    SYSTEM_PYTHON,
    simgrid_available,
    simulate_in_simgrid,
)

pytestmark = [
    pytest.mark.simgrid,
    pytest.mark.skipif(
        not simgrid_available(),
        reason=f"{SYSTEM_PYTHON} cannot import simgrid (install with: apt-get install -y "
        f"python3-simgrid)",
    ),
]


def _random_flow_set(seed: int):
    rng = np.random.default_rng(seed)
    num_links = int(rng.integers(2, 7))
    num_flows = int(rng.integers(20, 41))
    capacity_L = rng.uniform(1e8, 1e9, size=num_links)
    links_FH = np.full((num_flows, 3), -1)
    for f in range(num_flows):
        hops = int(rng.integers(1, min(3, num_links) + 1))
        links_FH[f, :hops] = rng.choice(num_links, size=hops, replace=False)
    size_F = rng.integers(1_000_000, 100_000_000, size=num_flows).astype(np.float64)
    return capacity_L, size_F, links_FH


@pytest.mark.parametrize("seed", range(6))
def test_maxmin_matches_simgrid_on_random_flow_sets(seed):
    capacity_L, size_F, links_FH = _random_flow_set(seed)
    ours = simulate(
        Network(capacity_Bps_L=capacity_L),
        FlowSet(size_bytes_F=size_F, links_FH=links_FH),
        rel_tol=0.0,
    ).finish_s_F
    theirs = simulate_in_simgrid(capacity_L, size_F, links_FH)
    np.testing.assert_allclose(ours, theirs, rtol=0.01)


def test_maxmin_matches_simgrid_on_shared_bottleneck():
    # The hand-worked case: links 100 and 50 B/s; f0 on link 0, f1 on both, f2 on link 1.
    capacity_L = np.array([100.0, 50.0])
    size_F = np.array([100.0, 100.0, 100.0])
    links_FH = np.array([[0, -1], [0, 1], [1, -1]])
    theirs = simulate_in_simgrid(capacity_L, size_F, links_FH)
    np.testing.assert_allclose(theirs, [4.0 / 3.0, 4.0, 4.0], rtol=1e-9)


@pytest.mark.parametrize("rel_tol", [0.0, 1e-3])
def test_maxmin_matches_simgrid_on_rail_all_to_all(rel_tol):
    # 4 nodes x 8 GPUs, GPU (s, l) -> GPU (d, l) for all d != s: 96 flows, 64 NIC links.
    rng = np.random.default_rng(7)
    nodes, gpus = 4, 8
    world = nodes * gpus
    src = np.repeat(np.arange(nodes), (nodes - 1) * gpus)
    dst = (src + np.tile(np.repeat(np.arange(1, nodes), gpus), nodes)) % nodes
    rail = np.tile(np.arange(gpus), nodes * (nodes - 1))
    links_FH = np.stack([src * gpus + rail, world + dst * gpus + rail], axis=1)
    size_F = rng.integers(1_000_000, 50_000_000, size=src.size).astype(np.float64)
    capacity_L = np.full(2 * world, 50e9)
    ours = simulate(
        Network(capacity_Bps_L=capacity_L),
        FlowSet(size_bytes_F=size_F, links_FH=links_FH),
        rel_tol=rel_tol,
    ).finish_s_F
    theirs = simulate_in_simgrid(capacity_L, size_F, links_FH)
    np.testing.assert_allclose(ours, theirs, rtol=0.01)
