"""Which process this is: the global rank, for the one-per-job notices and the per-rank logs."""

from __future__ import annotations

import os

__all__ = ["global_rank"]


def global_rank() -> int:
    """``torch.distributed``'s global rank once it is initialised; before that (or without it) the
    launcher's ``RANK`` variable (torchrun, SLURM wrappers), else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
