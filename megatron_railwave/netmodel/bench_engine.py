"""Time the max-min engine on synthetic rail all-to-all flow sets (a script, not a test).

Cluster: N nodes x G GPUs, one NIC per GPU; GPU (n, l) has an uplink (id n*G + l) and a
downlink (id N*G + n*G + l), both 50 GB/s; downlinks are the receiver ports. Traffic: every
GPU (s, l) sends to GPU (d, l) for all d != s (same rail, one switch), i.e. F = N(N-1)G flows
of two links each. Patterns:
    all-at-once  one phase with all F flows (NATIVE);
    waves        N-1 chained phases, wave k: node s -> node (s + k) mod N (PERMUTATION).
Sizes: ``uniform`` (every flow the same) or ``random`` (gamma, CV 0.5, whole 14 KiB tokens),
total remote payload 56 MiB per GPU on average.

    python -m megatron_railwave.netmodel.bench_engine --nodes 4 64 256 --json out/bench_engine.json

Prints wall and CPU seconds per case (CPU time is the fair number on a shared machine).

Measured (CPU seconds, one core of the shared 2-core dev machine, numpy 2.4, 2026-11):
    256 x 8, 522,240 flows   uniform sizes   random sizes (rel_tol 1e-3 / 1e-2)
    all-at-once              0.3 (1 event)   65-83 (1,286 events) / 9-13 (174 events)
    255 waves                0.2             0.3 / 0.3
    64 x 8, 32,256 flows: random all-at-once 4-5.5 / 0.75; everything else < 0.2.
Uniform sizes finish in one event per phase; dense traffic with many distinct sizes is
the slow case (events ~ log(T_end / T_first) / rel_tol, ~200 water-filling rounds each).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from megatron_railwave.netmodel import FlowSet, IncastModel, Network, PhaseGraph, simulate

__all__ = ["main", "rail_all_to_all"]

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--sizes", nargs="+", choices=["uniform", "random"], default=["uniform", "random"])
    parser.add_argument("--rel-tol", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--alpha", type=float, default=0.0, help="incast alpha (0 = pure max-min)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)

    incast = IncastModel(alpha=args.alpha)
    rows = []
    print(f"{'nodes':>5} {'gpus':>4} {'pattern':>11} {'sizes':>7} {'rel_tol':>7} {'flows':>8} "
          f"{'events':>7} {'makespan_ms':>11} {'seconds':>8} {'cpu_s':>8}")
    for n in args.nodes:
        for sizes in args.sizes:
            for waves in (False, True):
                network, flows, phases = rail_all_to_all(n, args.gpus_per_node, waves=waves, sizes=sizes)
                for rel_tol in args.rel_tol:
                    t0, c0 = time.perf_counter(), time.process_time()
                    res = simulate(network, flows, phases, incast=incast, rel_tol=rel_tol)
                    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
                    row = {
                        "nodes": n,
                        "gpus_per_node": args.gpus_per_node,
                        "pattern": "waves" if waves else "all-at-once",
                        "sizes": sizes,
                        "rel_tol": rel_tol,
                        "alpha": args.alpha,
                        "flows": flows.num_flows,
                        "events": res.num_events,
                        "makespan_s": res.makespan_s,
                        "seconds": seconds,
                        "cpu_seconds": cpu_seconds,
                    }
                    rows.append(row)
                    print(f"{n:>5} {args.gpus_per_node:>4} {row['pattern']:>11} {sizes:>7} {rel_tol:>7.0e} "
                          f"{row['flows']:>8} {res.num_events:>7} {1e3 * res.makespan_s:>11.3f} {seconds:>8.2f} {cpu_seconds:>8.2f}",
                          flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
