"""Benchmarks of the exchange on CPU gloo (``railwave bench-exchange``).

Letters: N nodes, G GPUs per node, W = N * G ranks.

* ``launch``: W spawned processes on one gloo group over loopback, with a hard time limit.
* ``exchange_bench``: the per-rank benchmark loop (RailWave paths and Megatron's alltoall).
* ``wire_bytes``: rows and bytes each path puts on rails and on NVLink, from the plan.
* ``summary``: runs the ranks and reduces their samples into the JSON result.
"""

from megatron_railwave.lab.bench.exchange_bench import (
    ALLTOALL,
    RAILWAVE_PATHS,
    BenchSpec,
    bench_worker,
)
from megatron_railwave.lab.bench.launch import RankFailedError, run_gloo_processes
from megatron_railwave.lab.bench.summary import (
    NATIVE_GOALS,
    SCHEMA,
    alltoall_skip_reason,
    native_goal,
    run_bench_exchange,
    wire_bytes_of,
)
from megatron_railwave.lab.bench.wire_bytes import (
    alltoall_bytes,
    alltoall_entry_bytes,
    railwave_bytes,
    railwave_record_bytes,
)

__all__ = [
    "ALLTOALL",
    "RAILWAVE_PATHS",
    "BenchSpec",
    "bench_worker",
    "RankFailedError",
    "run_gloo_processes",
    "NATIVE_GOALS",
    "alltoall_skip_reason",
    "native_goal",
    "SCHEMA",
    "run_bench_exchange",
    "wire_bytes_of",
    "alltoall_bytes",
    "alltoall_entry_bytes",
    "railwave_bytes",
    "railwave_record_bytes",
]
