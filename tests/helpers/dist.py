"""Run a function on several CPU processes joined by a gloo process group (test-only).

A thin front over the package's own launcher (``megatron_railwave.lab.bench.launch``), so the
tests and the benchmarks start ranks the same way: ``run_distributed(fn, world_size, *args)``
runs ``fn(rank, world_size, *args)`` on spawned processes over 127.0.0.1 and returns the
per-rank results. A rank that raises makes the parent raise with that rank's traceback text;
a hard timeout kills every process, so a hung collective never hangs the test run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron_railwave.lab.bench.launch import RankFailedError, run_gloo_processes

__all__ = ["DistributedRankError", "run_distributed"]

DistributedRankError = RankFailedError
"""A rank of :func:`run_distributed` raised or died; the message holds its traceback."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        fn: a top-level function importable by module path, or a ``functools.partial`` of one.
        world_size: number of processes (ranks), >= 1.
        *args: picklable arguments passed after ``rank, world_size`` (numpy, not tensors, in
            return values: tensors cross process queues through handles that die with the rank).
        timeout_s: wall-clock limit for the whole run; on expiry every process is killed.
        env: extra environment variables set in each rank before ``fn`` runs.

    Raises:
        DistributedRankError: a rank raised (message carries its traceback) or died.
        TimeoutError: the run did not finish within ``timeout_s``.
    """
    return run_gloo_processes(fn, world_size, *args, timeout_s=timeout_s, env=dict(env or {}))
