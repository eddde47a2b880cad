"""``chunk_sizes``: a count split into near-equal contiguous parts (rail chunks, the flow plan's
units). Its own module so that every planner module can use it without importing ``plan``."""

from __future__ import annotations

import numpy as np

__all__ = ["chunk_sizes"]


def chunk_sizes(rows: np.ndarray | int, chunks: int) -> np.ndarray:
    """[..., chunks] int64: ``rows`` split into ``chunks`` contiguous parts, sizes within one,
    the larger ones first (rows // chunks, plus one for the first rows % chunks parts)."""
    rows = np.asarray(rows, dtype=np.int64)
    k = np.arange(chunks, dtype=np.int64)
    return rows[..., None] // chunks + (k < rows[..., None] % chunks)
