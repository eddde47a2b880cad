"""Time the max-min engine on synthetic rail all-to-all flow sets (a script, not a test).

Cluster: N nodes x G GPUs, one NIC per GPU; GPU (n, l) has an uplink (id n*G + l) and a
downlink (id N*G + n*G + l), both 50 GB/s; downlinks are the receiver ports. Traffic: every
GPU (s, l) sends to GPU (d, l) for all d != s (same rail, one switch), i.e. F = N(N-1)G flows
of two links each. Patterns:
    all-at-once  one phase with all F flows (NATIVE);
    waves        N-1 chained phases, wave k: node s -> node (s + k) mod N (PERMUTATION).
Sizes: ``uniform`` (every flow the same) or ``random`` (gamma, CV 0.5, whole 14 KiB tokens),
total remote payload 56 MiB per GPU on average.

    railwave netmodel bench-engine --nodes 4 64 256 --json out/bench_engine.json

``time_engine`` yields one row per case with wall and CPU seconds (CPU time is the fair number on
a shared machine); the command prints them.

Measured (CPU seconds, one core of the shared 2-core dev machine, numpy 2.4, 2026-11):
    256 x 8, 522,240 flows   uniform sizes   random sizes (rel_tol 1e-3 / 1e-2)
    all-at-once              0.3 (1 event)   65-83 (1,286 events) / 9-13 (174 events)
    255 waves                0.2             0.3 / 0.3
    64 x 8, 32,256 flows: random all-at-once 4-5.5 / 0.75; everything else < 0.2.
Uniform sizes finish in one event per phase; dense traffic with many distinct sizes is
the slow case (events ~ log(T_end / T_first) / rel_tol, ~200 water-filling rounds each).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from megatron_railwave.lab.netmodel import FlowSet, IncastModel, Network, PhaseGraph, simulate

__all__ = ["rail_all_to_all", "time_engine"]

NIC_BPS = 50e9
TOKEN_BYTES = 7168 * 2  # one BF16 token of hidden size 7168
PAYLOAD_PER_GPU = 56 * 2**20


def rail_all_to_all(
    num_nodes: int, gpus_per_node: int, *, waves: bool, sizes: str, seed: int = 0
) -> tuple[Network, FlowSet, PhaseGraph]:
    """Rail-aligned all-to-all flow set (see the module docstring)."""
    n, g = num_nodes, gpus_per_node
    world = n * g
    src = np.repeat(np.arange(n), (n - 1) * g)
    shift = np.tile(np.repeat(np.arange(1, n), g), n)  # wave k = shift k
    rail = np.tile(np.arange(g), n * (n - 1))
    dst = (src + shift) % n
    links_FH = np.stack([src * g + rail, world + dst * g + rail], axis=1)
    mean = PAYLOAD_PER_GPU / max(n - 1, 1)
    if sizes == "uniform":
        size_F = np.full(src.size, mean)
    else:
        rng = np.random.default_rng(seed)
        tokens = np.round(rng.gamma(4.0, mean / TOKEN_BYTES / 4.0, size=src.size))
        size_F = tokens * TOKEN_BYTES
    rx_L = np.zeros(2 * world, dtype=bool)
    rx_L[world:] = True
    network = Network(capacity_Bps_L=np.full(2 * world, NIC_BPS), receiver_port_L=rx_L)
    if waves:
        flows = FlowSet(size_bytes_F=size_F, links_FH=links_FH, phase_F=shift - 1)
        phases = PhaseGraph.chain(n - 1)
    else:
        flows = FlowSet(size_bytes_F=size_F, links_FH=links_FH)
        phases = PhaseGraph.independent(1)
    return network, flows, phases


def time_engine(
    nodes: Sequence[int],
    gpus_per_node: int,
    *,
    sizes: Sequence[str] = ("uniform", "random"),
    rel_tols: Sequence[float] = (1e-3, 1e-2),
    alpha: float = 0.0,
) -> Iterator[dict[str, Any]]:
    """Time ``simulate`` on every case; yields one row per case as soon as it is done.

    Args:
        nodes: N of each cluster (G = ``gpus_per_node``).
        sizes: flow size patterns, "uniform" and/or "random".
        rel_tols: the engine's event batching tolerances.
        alpha: incast alpha (0 = pure max-min).

    Returns:
        Rows: nodes, gpus_per_node, pattern ("all-at-once" / "waves"), sizes, rel_tol, alpha, flows,
        events, makespan_s, seconds (wall), cpu_seconds.
    """
    for n in nodes:
        if n < 2:
            raise ValueError(f"--nodes {n}: the rail all-to-all needs at least 2 nodes")
    for name in sizes:
        if name not in ("uniform", "random"):
            raise ValueError(f"sizes {name!r}: choose 'uniform' or 'random'")
    incast = IncastModel(alpha=alpha)
    for n in nodes:
        for size_name in sizes:
            for waves in (False, True):
                network, flows, phases = rail_all_to_all(
                    n, gpus_per_node, waves=waves, sizes=size_name
                )
                for rel_tol in rel_tols:
                    t0, c0 = time.perf_counter(), time.process_time()
                    res = simulate(network, flows, phases, incast=incast, rel_tol=rel_tol)
                    yield {
                        "nodes": n,
                        "gpus_per_node": gpus_per_node,
                        "pattern": "waves" if waves else "all-at-once",
                        "sizes": size_name,
                        "rel_tol": rel_tol,
                        "alpha": alpha,
                        "flows": flows.num_flows,
                        "events": res.num_events,
                        "makespan_s": res.makespan_s,
                        "seconds": time.perf_counter() - t0,
                        "cpu_seconds": time.process_time() - c0,
                    }
