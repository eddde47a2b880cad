"""Per-layer communication logs: JSONL files (one record per MoE layer per logged step).

Two layouts (``RailWaveConfig.log_mode``):
  * ``rank``: every rank writes ``<log_dir>/railwave_<run>_rank<R>.jsonl`` (its own
    dispatch/combine times; the descriptors and the path are global, so they repeat on every rank);
  * ``job``: only global rank 0 writes ``<log_dir>/railwave_<run>.jsonl`` (one file per job).

Every run has its own files and every record carries its ``run`` id: a job-wide id agreed
through the job's store the first time a record is written (``job_run_id``; ``RAILWAVE_RUN_ID``
overrides), so a second run into the same directory never appends to the first one's files, and
``read_logs`` / ``railwave report`` keep runs apart (``split_runs``).

Records carry ``rank`` and ``run`` besides the ``LayerCommStats`` fields. On GPU the
dispatch/combine times are CUDA events: a record waits in a small queue until its events have
completed (checked without blocking on the next record), so logging never synchronises the
device on the critical path; ``flush``/``close`` (also run at interpreter exit) write what is
left; a record that arrives after ``close`` reopens the file in append mode.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from megatron_railwave.process import global_rank
from megatron_railwave.telemetry.stats import LayerCommStats

__all__ = [
    "JsonlStatsSink",
    "FanoutSink",
    "read_logs",
    "split_runs",
    "job_run_id",
    "LOG_GLOB",
    "RUN_ENV",
]

LogMode = Literal["rank", "job"]
LOG_GLOB = "railwave*.jsonl"
"""Files ``read_logs`` picks up in a log directory."""


RUN_ENV = "RAILWAVE_RUN_ID"
"""Environment variable that names the run (default: agreed through the job's store)."""
_RUN_ID: list[str] = []


def job_run_id() -> str:
    """This job's run id: the same on every rank, new for every job.

    ``RAILWAVE_RUN_ID`` when set; else every rank proposes ``<UTC time>-<pid>`` and the job's
    store (``torch.distributed``'s default store) keeps the first proposal (``compare_set``);
    without torch.distributed, the proposal itself. Resolved once per process.
    """
    if _RUN_ID:
        return _RUN_ID[0]
    run = os.environ.get(RUN_ENV, "")
    if not run:
        run = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}"
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                store = dist.distributed_c10d._get_default_store()
                run = store.compare_set("railwave/run_id", "", run).decode()
        except Exception:  # noqa: BLE001 - no reachable store: this process's own id
            pass
    if not re.fullmatch(r"[A-Za-z0-9._-]+", run):
        raise ValueError(
            f"{RUN_ENV}={run!r} must use only letters, digits, '.', '_' and '-' (it names files)"
        )
    _RUN_ID.append(run)
    return run


def _close_at_exit(ref: weakref.ref) -> None:
    sink = ref()
    if sink is not None:
        sink.close()


class JsonlStatsSink:
    """Appends ``LayerCommStats`` records to JSONL files (see the module docstring).

    Args:
        log_dir: directory (created on the first record).
        interval: keep records of every ``interval``-th step of each layer.
        rank: this process's global rank; default torch.distributed's, else ``RANK``, else 0.
        mode: 'rank' (one file per rank) or 'job' (rank 0 writes one file, others write nothing).
        run_id: the run's id; default ``job_run_id()`` (resolved at the first record).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        interval: int = 1,
        rank: int | None = None,
        mode: LogMode = "rank",
        run_id: str | None = None,
    ) -> None:
        if mode not in ("rank", "job"):
            raise ValueError(f"log mode must be 'rank' or 'job', got {mode!r}")
        if interval < 1:
            raise ValueError(f"log interval must be >= 1, got {interval}")
        self.log_dir = Path(log_dir)
        self.interval = interval
        self.mode = mode
        self._rank = rank
        self._run_id = run_id
        self._file = None
        self._pending: deque[LayerCommStats] = deque()
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = global_rank()
        return self._rank

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            self._run_id = job_run_id()
        return self._run_id

    @property
    def path(self) -> Path:
        name = (
            f"railwave_{self.run_id}.jsonl"
            if self.mode == "job"
            else f"railwave_{self.run_id}_rank{self.rank}.jsonl"
        )
        return self.log_dir / name

    def wants(self, step: int) -> bool:
        """Whether a record of ``step`` is logged (the same on every rank, writer or not)."""
        return step % self.interval == 0

    @property
    def writes(self) -> bool:
        """False on ranks other than 0 in 'job' mode."""
        return self.mode == "rank" or self.rank == 0

    def _open(self):
        if self._file is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        return self._file

    def _write(self, stats: LayerCommStats) -> None:
        record = {"run": self.run_id, "rank": self.rank, **stats.to_dict()}
        self._open().write(json.dumps(record) + "\n")

    def __call__(self, stats: LayerCommStats) -> None:
        if stats.step % self.interval or not self.writes:
            return
        self._closed = False  # a record after close reopens the file (append)
        self._pending.append(stats)
        # Write in order every record whose CUDA events are done; never wait here.
        while self._pending and self._pending[0].times_ready():
            self._write(self._pending.popleft())

    def flush(self) -> None:
        """Write every queued record (waits for their CUDA events)."""
        while self._pending:
            self._write(self._pending.popleft())
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file; idempotent (also registered with ``atexit``)."""
        if self._closed:
            return
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True


class FanoutSink:
    """Hands every record to several sinks, in order; ``flush``/``close`` reach those that have
    them."""

    def __init__(self, *sinks: Callable[[LayerCommStats], None]) -> None:
        self.sinks = tuple(s for s in sinks if s is not None)

    def __call__(self, stats: LayerCommStats) -> None:
        for sink in self.sinks:
            sink(stats)

    def wants(self, step: int) -> bool:
        """True when any sink takes ``step`` (a sink without ``wants`` takes every step)."""
        return any(getattr(sink, "wants", None) is None or sink.wants(step) for sink in self.sinks)

    def _each(self, method: str) -> None:
        for sink in self.sinks:
            fn = getattr(sink, method, None)
            if fn is not None:
                fn()

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")


_FILE_RUN = re.compile(r"railwave_(?P<run>.+?)(?:_rank\d+)?\.jsonl")
NO_RUN_ID = "-"
"""Run id of records from files written before runs had ids (``railwave_rank<R>.jsonl``)."""


def _run_of_file(path: Path) -> str:
    if re.fullmatch(r"railwave(_rank\d+)?\.jsonl", path.name):
        return NO_RUN_ID
    match = _FILE_RUN.fullmatch(path.name)
    return match.group("run") if match else NO_RUN_ID


def read_logs(log_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of the JSONL files in ``log_dir`` (sorted file names, file order kept).

    Each record has a ``run`` (written by the sink; for older files, from the file name).

    Raises:
        ValueError: no such directory, no log file, or a line that is not a JSON object (file and
            line named).
    """
    log_dir = Path(log_dir)
    if not log_dir.exists():
        raise ValueError(
            f"log directory {str(log_dir)!r} does not exist; give the directory set as "
            "--railwave-log-dir (RailWaveConfig.log_dir)"
        )
    if not log_dir.is_dir():
        raise ValueError(
            f"{str(log_dir)!r} is a file, not a log directory; give the directory that holds "
            f"the {LOG_GLOB} files"
        )
    files = sorted(log_dir.glob(LOG_GLOB))
    if not files:
        raise ValueError(
            f"no {LOG_GLOB} files in {str(log_dir)!r}; write logs with "
            "--railwave-log-dir (RailWaveConfig.log_dir)"
        )
    out = []
    for path in files:
        file_run = _run_of_file(path)
        with open(path) as fh:
            for num, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{num}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{num}: expected a JSON object per line")
                record.setdefault("run", file_run)
                out.append(record)
    return out


def split_runs(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by ``run``, runs in sorted id order (ids start with their UTC start time)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        runs.setdefault(str(record.get("run", NO_RUN_ID)), []).append(record)
    return {run: runs[run] for run in sorted(runs)}
