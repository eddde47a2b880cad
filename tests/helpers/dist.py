"""Run a function on several CPU processes joined by a gloo process group (test-only).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` spawned processes on
127.0.0.1, runs ``fn(rank, world_size, *args)`` in each and returns the per-rank results.
A rank that raises makes the parent raise with that rank's traceback text; a hard timeout
kills every process, so a hung collective never hangs the test run.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRankError", "run_distributed"]

_LOOPBACK = "127.0.0.1"


class DistributedRankError(RuntimeError):
    """A rank of :func:`run_distributed` raised or died; the message holds its traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    timeout_s: float,
    results: Any,
) -> None:
    # Keep every rank on one core: several ranks share the two CPUs of the test machine.
    os.environ.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
         "MASTER_ADDR": _LOOPBACK, "MASTER_PORT": str(port)}
    )
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            _LOOPBACK, port, world_size, is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - any failure must reach the parent as text
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        fn: a top-level function importable by module path, or a ``functools.partial`` of one
            (spawned processes unpickle it).
        world_size: number of processes (ranks), >= 1.
        *args: picklable arguments passed after ``rank, world_size``.
        timeout_s: wall-clock limit for the whole run; on expiry every process is killed.
        env: extra environment variables set in each rank before ``fn`` runs.

    Returns:
        ``fn``'s picklable return value of each rank, indexed by rank.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout_s`` <= 0.
        DistributedRankError: a rank raised (message carries its traceback) or died silently.
        TimeoutError: the run did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    # The parent owns the rendezvous store on an OS-chosen port, so there is no free-port race.
    store = dist.TCPStore(_LOOPBACK, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, fn, args, dict(env or {}), timeout_s, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    fn_name = getattr(fn, "__qualname__", repr(fn))  # functools.partial has no __qualname__
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
                    f"run_distributed({fn_name}, world_size={world_size}) exceeded "
                    f"timeout_s={timeout_s}; ranks without a result: {missing}"
                )
            try:
                status, rank, payload = results.get(timeout=min(0.2, remaining))
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in values and proc.exitcode not in (None, 0):
                        raise DistributedRankError(
                            f"rank {rank} of {world_size} died with exit code {proc.exitcode} "
                            "before reporting a result"
                        ) from None
                continue
            if status == "error":
                raise DistributedRankError(
                    f"rank {rank} of {world_size} raised in {fn_name}:\n{payload}"
                )
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
    return [values[rank] for rank in range(world_size)]
