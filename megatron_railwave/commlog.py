"""Per-layer communication logs: JSONL files (one record per MoE layer per logged step)."""

from __future__ import annotations

import json
import os
from pathlib import Path as FsPath

from .stats import LayerCommStats

__all__ = ["JsonlStatsSink"]


class JsonlStatsSink:
    """Appends ``LayerCommStats`` records to ``<log_dir>/railwave_rank<R>.jsonl``.

    Args:
        log_dir: directory (created if missing).
        interval: keep records of every ``interval``-th step of each layer.
        rank: file suffix; default the global rank from torch.distributed or RANK.
    """

    def __init__(self, log_dir: str | os.PathLike, *, interval: int = 1, rank: int | None = None) -> None:
        self.log_dir = FsPath(log_dir)
        self.interval = interval
        self._rank = rank
        self._file = None

    def _open(self):
        if self._file is None:
            rank = self._rank
            if rank is None:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.log_dir / f"railwave_rank{rank}.jsonl", "a", buffering=1)
        return self._file

    def __call__(self, stats: LayerCommStats) -> None:
        if stats.step % self.interval:
            return
        self._open().write(json.dumps(stats.to_dict()) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
