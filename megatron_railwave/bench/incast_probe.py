"""k-to-1 incast probe: how a cluster's receiver ports lose goodput when several nodes send at once.

Letters: N nodes, G GPUs per node (one rail each), W = N * G ranks; rank r is GPU r % G of node
r // G (the exchange's placement).

For k = 1 .. N - 1, nodes 1..k send ``nbytes`` each to node 0 at the same time, rail-aligned as the
exchange's rail phases are: GPU (s, l) -> GPU (0, l) for every rail l, so every receiver port of
node 0 has k senders. Each sample starts after a barrier and lasts until the slowest rank has
finished (an all-reduce MAX of the per-rank elapsed time). Under max-min sharing k senders into one
port take k times as long as one; the measured ``slowdown(k) = t(k) / (k t(1))`` is what the flow
model's incast law (``netmodel.IncastModel``) charges beyond that, so

    alpha = least squares of slowdown(k) - 1 = alpha * min(k - 1, k_sat)

(``netmodel.incast.alpha_from_slowdowns``) is the number to put in a ``configs/netmodel/*.yaml``
for this fabric. The flow model's two presets bracket what is published: the default presets
(alpha 0.0042, about max-min, like DeepEP's InfiniBand figures) and the paper-incast presets
(alpha 4.9121: a 3-sender port at 9.2% goodput, the paper's fabric; docs/netmodel.md).

It runs in any initialised process group: under ``torchrun`` on a GPU cluster (NCCL; tensors on the
local CUDA device) or on the spawned gloo processes of ``bench.launch`` (CPU; on loopback there are
no rails, so only the mechanics are tested there). Not yet run on hardware.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..netmodel.incast import alpha_from_slowdowns

__all__ = ["IncastProbeRow", "incast_probe_worker", "summarize_incast_probe"]


def incast_probe_worker(rank: int, world: int, gpus_per_node: int, nbytes: int, repeats: int,
                        warmups: int = 1) -> dict[int, list[float]]:
    """Run the probe on this rank (every rank of the default group must call it).

    Args:
        rank, world: this rank and the default group's size, W = N * G with N >= 2.
        gpus_per_node: G.
        nbytes: bytes each sending GPU sends per sample (large enough to be bandwidth bound:
            tens of MiB on a 400 Gb/s rail).
        repeats, warmups: timed and discarded samples per k.

    Returns:
        {k: [seconds per timed sample]} (the same on every rank: the slowest rank's times).
    """
    if world % gpus_per_node or world // gpus_per_node < 2:
        raise ValueError(f"the probe needs W = N x G ranks with N >= 2, got W={world}, G={gpus_per_node}")
    if nbytes < 1 or repeats < 1 or warmups < 0:
        raise ValueError(f"need nbytes >= 1, repeats >= 1, warmups >= 0, got {nbytes}, {repeats}, {warmups}")
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    nodes = world // gpus_per_node
    node, local = divmod(rank, gpus_per_node)
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    recv = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(nodes - 1)] if node == 0 else []
    elapsed = torch.zeros(1, dtype=torch.float64, device=device)
    times: dict[int, list[float]] = {}
    for k in range(1, nodes):
        ops = []
        if 1 <= node <= k:
            ops.append(dist.P2POp(dist.isend, send, local))  # to GPU (0, local)
        if node == 0:
            ops += [dist.P2POp(dist.irecv, recv[s - 1], s * gpus_per_node + local) for s in range(1, k + 1)]
        samples = []
        for sample in range(warmups + repeats):
            dist.barrier()
            start = time.perf_counter()
            for work in (dist.batch_isend_irecv(ops) if ops else []):
                work.wait()
            if on_gpu:
                torch.cuda.synchronize(device)
            elapsed.fill_(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if sample >= warmups:
                samples.append(float(elapsed.item()))  # a probe, not the exchange's hot path
        times[k] = samples
    if node == 0 and recv and not all(bool((r == 1).all()) for r in recv):
        raise RuntimeError("incast probe: a receive buffer does not hold the sent bytes")
    return times


@dataclass(frozen=True, kw_only=True, slots=True)
class IncastProbeRow:
    """One sender count of the probe."""

    senders: int
    """k: nodes sending to node 0 at once (on every rail)."""
    median_s: float
    port_goodput_gbps: float
    """k x nbytes x 8 / median_s / 1e9: what one receiver port of node 0 delivered, Gb/s."""
    slowdown: float
    """median_s / (k x median_s at k = 1): 1 under max-min sharing."""


def summarize_incast_probe(times: dict[int, list[float]], nbytes: int, *, k_sat: int = 2) -> dict[str, Any]:
    """Per-k rows and the fitted alpha (``k_free`` 1, the flow model's saturating law).

    Args:
        times: ``incast_probe_worker``'s result (keys 1 .. N - 1).
        nbytes: bytes per sending GPU per sample.
        k_sat: the law's saturation (the presets' 2); the fit uses k up to 1 + k_sat.
    """
    if 1 not in times or len(times) < 2:
        raise ValueError(f"need samples for k = 1 and at least one k > 1, got k = {sorted(times)}")
    one = statistics.median(times[1])
    rows = []
    for k in sorted(times):
        median = statistics.median(times[k])
        rows.append(IncastProbeRow(senders=k, median_s=median, port_goodput_gbps=k * nbytes * 8 / median / 1e9,
                                   slowdown=median / (k * one)))
    fit = [r for r in rows if 1 < r.senders <= 1 + k_sat]
    alpha = alpha_from_slowdowns([r.senders for r in fit], [r.slowdown for r in fit], k_free=1, k_sat=k_sat)
    return {"nbytes": nbytes, "k_sat": k_sat, "alpha": alpha, "goodput_at_3_senders": 1.0 / (1.0 + min(2, k_sat) * alpha),
            "rows": [asdict(r) for r in rows]}
