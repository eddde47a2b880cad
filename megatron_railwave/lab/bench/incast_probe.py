"""k-to-1 incast probe: how a cluster's receiver ports lose goodput when several nodes send at once.

Letters: N nodes, G GPUs per node (one rail each), W = N * G ranks; rank r is GPU r % G of node
r // G (the exchange's placement).

For k = 1 .. N - 1, nodes 1..k send ``nbytes`` each to node 0 at the same time, rail-aligned as the
exchange's rail phases are: GPU (s, l) -> GPU (0, l) for every rail l, so every receiver port of
node 0 has k senders. Each sample starts after a barrier and lasts until the slowest rank has
finished (an all-reduce MAX of the per-rank elapsed time). Under max-min sharing k senders into one
port take k times as long as one; the measured ``slowdown(k) = t(k) / (k t(1))`` is what the flow
model's incast law (``netmodel.IncastModel``) charges beyond that (``summarize_incast_probe`` also
takes the port's line rate, for senders that cannot fill it alone), so

    alpha = least squares of slowdown(k) - 1 = alpha * min(k - 1, k_sat)

(``netmodel.incast.alpha_from_slowdowns``) is the number to put in a netmodel YAML (as
``megatron_railwave/configs/netmodel/*.yaml``) for this fabric. The flow model's two presets
bracket what is published: the default presets (alpha 0.0042, about max-min, like DeepEP's
InfiniBand figures) and the paper-incast presets (alpha 4.9121: a 3-sender port at 9.2% goodput,
the paper's fabric; docs/netmodel.md).

It runs in any initialised process group: under ``torchrun`` on a GPU cluster (NCCL; tensors on the
local CUDA device) or on the spawned gloo processes of ``bench.launch`` (CPU; on loopback there are
no rails, so only the mechanics are tested there). Not yet run on hardware.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave.lab.netmodel.incast import alpha_from_slowdowns

__all__ = [
    "IncastProbeRow",
    "ProbeRun",
    "incast_probe_worker",
    "probe_local",
    "probe_torchrun",
    "summarize_incast_probe",
    "write_incast_model",
]


def incast_probe_worker(
    rank: int,
    world: int,
    gpus_per_node: int,
    nbytes: int,
    repeats: int,
    warmups: int = 1,
    max_senders: int | None = None,
) -> dict[int, list[float]]:
    """Run the probe on this rank (every rank of the default group must call it).

    Args:
        rank, world: this rank and the default group's size, W = N * G with N >= 2.
        gpus_per_node: G.
        nbytes: bytes each sending GPU sends per sample (large enough to be bandwidth bound:
            tens of MiB on a 400 Gb/s rail).
        repeats, warmups: timed and discarded samples per k.
        max_senders: largest k (default N - 1); node 0 holds k receive buffers of ``nbytes``.

    Returns:
        {k: [seconds per timed sample]} (the same on every rank: the slowest rank's times).

    Raises:
        RuntimeError: on every rank, when a receiver did not get its senders' bytes.
    """
    if world % gpus_per_node or world // gpus_per_node < 2:
        raise ValueError(
            f"the probe needs W = N x G ranks with N >= 2, got W={world}, G={gpus_per_node}"
        )
    if nbytes < 1 or repeats < 1 or warmups < 0:
        raise ValueError(
            f"need nbytes >= 1, repeats >= 1, warmups >= 0, got {nbytes}, {repeats}, {warmups}"
        )
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    nodes = world // gpus_per_node
    top = nodes - 1 if max_senders is None else min(max_senders, nodes - 1)
    node, local = divmod(rank, gpus_per_node)
    # Each sender's bytes carry its node number, so a receive from the wrong peer shows.
    send = torch.full((nbytes,), node % 256, dtype=torch.uint8, device=device)
    recv = (
        [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(top)]
        if node == 0
        else []
    )
    elapsed = torch.zeros(1, dtype=torch.float64, device=device)
    times: dict[int, list[float]] = {}
    for k in range(1, top + 1):
        ops = []
        if 1 <= node <= k:
            ops.append(dist.P2POp(dist.isend, send, local))  # to GPU (0, local)
        if node == 0:
            ops += [
                dist.P2POp(dist.irecv, recv[s - 1], s * gpus_per_node + local)
                for s in range(1, k + 1)
            ]
        samples = []
        for sample in range(warmups + repeats):
            dist.barrier()
            start = time.perf_counter()
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            if on_gpu:
                torch.cuda.synchronize(device)
            elapsed.fill_(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if sample >= warmups:
                samples.append(float(elapsed.item()))  # a probe, not the exchange's hot path
        times[k] = samples
    bad = torch.zeros(1, dtype=torch.float64, device=device)
    if node == 0:
        bad.fill_(float(sum(not bool((r == s % 256).all()) for s, r in enumerate(recv, start=1))))
    dist.all_reduce(bad, op=dist.ReduceOp.SUM)
    if bad.item():
        raise RuntimeError(
            f"incast probe: {int(bad.item())} receive buffer(s) on node 0 do not hold their "
            f"sender's "
            "bytes; check that rank r is GPU r % G of node r // G (torchrun: --nproc-per-node G)"
        )
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


def summarize_incast_probe(
    times: dict[int, list[float]], nbytes: int, *, k_sat: int = 2, port_gbps: float | None = None
) -> dict[str, Any]:
    """Per-k rows and the fitted alpha (``k_free`` 1, the flow model's saturating law).

    The max-min time of k senders is k x t(1) when one sender fills the port. When the port's
    rate is known (``port_gbps``) it is ``max(t(1), k x nbytes / rate)`` instead, so a sender that
    cannot fill the port alone (one NCCL peer on few channels, a small ``nbytes``) is not read as
    a fabric without loss; ``sender_limited`` says when the one-sender goodput is under 80% of it.
    Each sample starts when a rank leaves the barrier, so barrier skew adds a little to every t(k)
    (most to t(1)): keep ``nbytes`` large.

    Args:
        times: ``incast_probe_worker``'s result (keys 1 .. max k).
        nbytes: bytes per sending GPU per sample.
        k_sat: the law's saturation (the presets' 2); the fit uses k = 2 .. 1 + k_sat (larger k
            are reported, not fitted: the law is flat there).
        port_gbps: one receiver port's line rate in Gb/s, if known.
    """
    if 1 not in times or len(times) < 2:
        raise ValueError(f"need samples for k = 1 and at least one k > 1, got k = {sorted(times)}")
    if port_gbps is not None and not port_gbps > 0:
        raise ValueError(f"port_gbps must be > 0, got {port_gbps}")
    one = statistics.median(times[1])
    rows = []
    for k in sorted(times):
        median = statistics.median(times[k])
        reference = k * one if port_gbps is None else max(one, k * nbytes * 8 / (port_gbps * 1e9))
        rows.append(
            IncastProbeRow(
                senders=k,
                median_s=median,
                port_goodput_gbps=k * nbytes * 8 / median / 1e9,
                slowdown=median / reference,
            )
        )
    fit = [r for r in rows if 1 < r.senders <= 1 + k_sat]
    alpha = alpha_from_slowdowns(
        [r.senders for r in fit], [r.slowdown for r in fit], k_free=1, k_sat=k_sat
    )
    sender_limited = port_gbps is not None and rows[0].port_goodput_gbps < 0.8 * port_gbps
    return {
        "nbytes": nbytes,
        "k_sat": k_sat,
        "port_gbps": port_gbps,
        "alpha": alpha,
        "goodput_at_3_senders": 1.0 / (1.0 + min(2, k_sat) * alpha),
        "fitted_senders": [r.senders for r in fit],
        "sender_limited": sender_limited,
        "rows": [asdict(r) for r in rows],
    }


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """What one probe measured (``probe_local``, ``probe_torchrun``)."""

    times: dict[int, list[float]]
    """Per k, the seconds of every timed sample (``incast_probe_worker``)."""
    nodes: int
    gpus_per_node: int
    nbytes: int
    backend: str
    rank: int
    """This process's rank: only rank 0 reports."""


def probe_local(
    nodes: int,
    gpus_per_node: int,
    *,
    nbytes: int,
    repeats: int,
    warmups: int,
    max_senders: int,
    timeout_s: float,
) -> ProbeRun:
    """The probe on ``nodes x gpus_per_node`` spawned gloo processes of this machine (loopback:
    a mechanics check)."""
    from megatron_railwave.lab.bench.launch import run_gloo_processes

    if nodes < 3 or gpus_per_node < 1:
        raise ValueError(
            f"--local needs N >= 3 nodes (k = 2 senders at least) and G >= 1, got "
            f"{nodes},{gpus_per_node}"
        )
    times = run_gloo_processes(
        incast_probe_worker,
        nodes * gpus_per_node,
        gpus_per_node,
        nbytes,
        repeats,
        warmups,
        max_senders,
        timeout_s=timeout_s,
    )[0]
    return ProbeRun(
        times=times,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nbytes=nbytes,
        backend="gloo (local)",
        rank=0,
    )


def probe_torchrun(
    *, gpus_per_node: int | None, nbytes: int, repeats: int, warmups: int, max_senders: int
) -> ProbeRun:
    """The probe in the process group torchrun set up (one process per GPU; NCCL when CUDA is
    there, else gloo); ``gpus_per_node`` None: ``LOCAL_WORLD_SIZE``.

    Collective: every rank of ``WORLD_SIZE`` takes part; the layout is checked on every rank
    before the process group starts.
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "0"))
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    gpus = gpus_per_node or int(local_world or "0")
    if world < 1 or gpus < 1 or world % gpus or world // gpus < 3:
        raise ValueError(
            f"--torchrun needs WORLD_SIZE = N x G with N >= 3 (torchrun sets WORLD_SIZE and "
            f"LOCAL_WORLD_SIZE; or pass --gpus-per-node), got WORLD_SIZE={world}, G={gpus}"
        )
    rank_env, local_rank = (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )
    if local_rank != rank_env % gpus:
        # The probe's node of a rank is rank // G: it must be the machine the rank runs on.
        raise ValueError(
            f"rank {rank_env} has LOCAL_RANK {local_rank}, not rank % G = {rank_env % gpus}: "
            f"launch "
            f"one process per GPU with torchrun --nproc-per-node G so that rank r is GPU r % "
            f"G of "
            f"node r // G (G = "
            f"{gpus}{'' if local_world is None else ', LOCAL_WORLD_SIZE ' + local_world})"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        times = incast_probe_worker(
            dist.get_rank(), world, gpus, nbytes, repeats, warmups, max_senders
        )
        backend = dist.get_backend()
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    return ProbeRun(
        times=times,
        nodes=world // gpus,
        gpus_per_node=gpus,
        nbytes=nbytes,
        backend=backend,
        rank=rank,
    )


def write_incast_model(
    path: str, base: Any, summary: dict[str, Any], base_path: str | None
) -> None:
    """Write the netmodel YAML of ``railwave probe-incast --write-model``: ``base`` (a
    ``NetModelConfig``, from ``base_path`` or built in) with the measured alpha, ``k_free`` 1 and
    the probe's ``k_sat``, and the measurement under ``calibration``."""
    import dataclasses

    import yaml

    model = dataclasses.replace(
        base, alpha=round(summary["alpha"], 4), k_free=1, k_sat=summary["k_sat"]
    )
    data = {
        "model": model.to_dict(),
        "calibration": {
            "method": "railwave probe-incast (k-to-1 slowdown beyond max-min, least squares)",
            "base_model": base_path or "built-in NetModelConfig",
            "nbytes": summary["nbytes"],
            "port_gbps": summary["port_gbps"],
            "fitted_senders": summary["fitted_senders"],
            "rows": summary["rows"],
        },
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# Network model parameters with the incast alpha measured by railwave probe-incast.\n"
        )
        yaml.safe_dump(data, f, sort_keys=False)
