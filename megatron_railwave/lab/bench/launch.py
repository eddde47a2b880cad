"""Start W CPU processes joined by one gloo process group on loopback and collect their results.

Used by the benchmarks (``railwave bench-exchange``). Each process runs
``fn(rank, world_size, *args)``; the parent returns the per-rank return values. A rank that raises
makes the parent raise ``RankFailedError`` with that rank's traceback; the whole run has a
wall-clock limit after which every process is killed, so a stuck collective never hangs the CLI.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailedError", "run_gloo_processes"]

_LOOPBACK = "127.0.0.1"


class RankFailedError(RuntimeError):
    """A rank raised or died; the message holds its traceback text."""


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
    threads: int,
    env: dict[str, str],
    results: Any,
) -> None:
    # Several ranks share few cores: one intra-op thread per rank avoids oversubscription.
    os.environ.update({"OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"})
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": _LOOPBACK,
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(_LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        results.put(("ok", rank, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent as text
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes (loopback).

    Args:
        fn: a module-level function (spawned processes import it by name).
        world_size: number of processes, >= 1.
        *args: picklable arguments passed after ``rank, world_size``.
        timeout_s: limit for the whole run (also the process group's collective timeout).
        threads_per_rank: torch intra-op threads of each rank.
        env: extra environment variables set in each rank before ``fn`` runs.

    Returns:
        ``fn``'s return value of each rank (picklable; use numpy or lists, not tensors).

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died.
        TimeoutError: the run exceeded ``timeout_s``; every process was killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    # The parent owns the rendezvous store on an OS-chosen port: no free-port race.
    store = dist.TCPStore(
        _LOOPBACK,
        0,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            daemon=True,
            args=(
                rank,
                world_size,
                store.port,
                fn,
                args,
                timeout_s,
                threads_per_rank,
                dict(env or {}),
                results,
            ),
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - values.keys())
                raise TimeoutError(
                    f"{getattr(fn, '__qualname__', repr(fn))} on {world_size} ranks exceeded "
                    f"{timeout_s} s; "
                    f"ranks without a result: {missing}"
                )
            try:
                status, rank, payload = results.get(timeout=min(0.2, remaining))
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in values and proc.exitcode not in (None, 0):
                        raise RankFailedError(
                            f"rank {rank} of {world_size} died with exit code {proc.exitcode}"
                        ) from None
                continue
            if status == "error":
                raise RankFailedError(f"rank {rank} of {world_size} raised:\n{payload}")
            values[rank] = payload
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5.0)
        results.close()
        del store
    return [values[r] for r in range(world_size)]
