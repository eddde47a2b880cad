"""Worker functions (targets for :func:`run_workers`) that check and measure a testbed.

Letters: N nodes, G GPUs per node (= rails), W = N * G ranks.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from megatron_railwave.lab.testbed.launch import WorkerContext, make_groups, run_workers
from megatron_railwave.lab.testbed.netns import TestbedSpec, nic_counters

__all__ = ["alltoall_check", "incast_goodput", "incast_probe", "sleep_probe"]


def _alltoall(group: Any, my_index: int, size: int, numel: int, tag: float) -> int:
    """all_to_all_single of ``numel`` float32 per peer; element = tag + 1000 * src + dst. Returns
    the number of mismatching elements."""
    import torch
    import torch.distributed as dist

    send_PS = torch.arange(size, dtype=torch.float32).repeat_interleave(numel)
    send_PS += tag + 1000.0 * my_index
    recv_PS = torch.empty_like(send_PS)
    dist.all_to_all_single(recv_PS, send_PS, group=group)
    want_PS = (
        tag + 1000.0 * torch.arange(size, dtype=torch.float32).repeat_interleave(numel) + my_index
    )
    return int((recv_PS != want_PS).sum())


def alltoall_check(ctx: WorkerContext, rail_numel: int, node_numel: int) -> dict[str, int]:
    """One all_to_all in this rank's rail group, then one in its node group; count wrong elements.

    Rail group l sends ``rail_numel * (l + 1)`` float32 per peer, so each rail's NIC counters show
    a different, predictable volume; node groups send ``node_numel`` per peer.

    Collective: yes (default, rail and node groups).
    """
    import torch.distributed as dist

    groups = make_groups(ctx)
    dist.barrier()
    rail_bad = _alltoall(groups.rail, ctx.node, ctx.spec.nodes, rail_numel * (ctx.local + 1), 0.5)
    node_bad = _alltoall(groups.node, ctx.local, ctx.spec.gpus_per_node, node_numel, tag=0.25)
    dist.barrier()
    return {"rank": ctx.rank, "rail_bad": rail_bad, "node_bad": node_bad}


def incast_probe(
    ctx: WorkerContext, senders: list[int], receiver: int, nbytes: int, repeats: int
) -> dict[str, Any]:
    """Every rank in ``senders`` sends ``nbytes`` to node ``receiver`` at once, on rail 0.

    Uses rail group 0 (ranks ``(n, 0)``); other ranks only take part in the barriers. The
    receiver times each repeat from a barrier to the last byte; returns those times (s).

    Collective: yes (default and rail groups).
    """
    import torch
    import torch.distributed as dist

    groups = make_groups(ctx)
    gpus = ctx.spec.gpus_per_node
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    bufs = {s: torch.empty_like(buf) for s in senders} if ctx.rank == receiver * gpus else {}
    times = []
    # Warm up one round (connections are already up after new_group; this fills caches).
    for rep in range(repeats + 1):
        dist.barrier(group=groups.rail_groups[0]) if ctx.local == 0 else None
        t0 = time.perf_counter()
        works = []
        if ctx.local == 0 and ctx.node in senders:
            works.append(dist.isend(buf, dst=receiver * gpus, group=groups.rail))
        if bufs:
            works += [dist.irecv(bufs[s], src=s * gpus, group=groups.rail) for s in senders]
        for w in works:
            w.wait()
        if rep > 0:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"rank": ctx.rank, "times": times}


def incast_goodput(
    spec: TestbedSpec,
    fan_in: int,
    nbytes: int = 4 << 20,
    repeats: int = 3,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Goodput into one receiver port when ``fan_in`` nodes send ``nbytes`` each to node 0 on rail
    0.

    Needs ``spec.nodes >= fan_in + 1``. Returns the median receiver time, the port goodput in Mbit/s
    (all senders' bytes / time), its ratio to ``spec.rail_mbit``, and the bytes the receiver NIC
    took in (goodput + retransmissions + headers + control).
    """
    if not 1 <= fan_in < spec.nodes:
        raise ValueError(
            f"fan_in must be in 1..{spec.nodes - 1} for {spec.nodes} nodes, got {fan_in}"
        )
    senders = list(range(1, fan_in + 1))
    before = nic_counters(spec)
    results = run_workers(
        spec,
        "megatron_railwave.lab.testbed.probes:incast_probe",
        {"senders": senders, "receiver": 0, "nbytes": nbytes, "repeats": repeats},
        timeout_s,
    )
    after = nic_counters(spec)
    median_s = statistics.median(results[0]["times"])
    goodput_mbit = fan_in * nbytes * 8 / median_s / 1e6
    return {
        "fan_in": fan_in,
        "nbytes_per_sender": nbytes,
        "times_s": results[0]["times"],
        "median_s": median_s,
        "goodput_mbit": goodput_mbit,
        "goodput_over_rate": goodput_mbit / spec.rail_mbit,
        "receiver_rx_bytes": after[(0, 0)][1] - before[(0, 0)][1],
        "sent_bytes_total": fan_in * nbytes * (repeats + 1),
    }


def sleep_probe(ctx: WorkerContext, seconds: float) -> int:
    """Sleep, then return the rank (exercises the launcher's hard timeout)."""
    time.sleep(seconds)
    return ctx.rank
