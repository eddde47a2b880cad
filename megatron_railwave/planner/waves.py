"""Wave schedules: which remote node pairs send at the same time.

Letters: N nodes, V waves.

The cyclic permutation schedule has N - 1 waves; in wave k (k = 1..N-1) node s sends to node
(s + k) mod N, so every receiver has exactly one remote sender per wave and every ordered remote
pair appears exactly once. The bounded fan-in schedule groups f consecutive shifts into one wave:
at most f senders per receiver (and f receivers per sender) per wave, ceil((N - 1) / f) waves,
so that large N does not mean N - 1 serialized waves. Both depend only on N (and f), so they are
built once and cached.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "WaveSchedule",
    "cyclic_schedule",
    "bounded_fanin_schedule",
    "all_at_once",
    "schedule_from_windows",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveSchedule:
    """An ordered list of waves (or sending windows); each wave is a set of (src, dst) node pairs.

    Every ordered remote pair must appear in exactly one wave. Local pairs (s, s) never appear.
    """

    num_nodes: int
    waves: tuple[tuple[tuple[int, int], ...], ...]
    kind: str = "custom"

    def __post_init__(self) -> None:
        n = self.num_nodes
        seen: set[tuple[int, int]] = set()
        for w, wave in enumerate(self.waves):
            for s, d in wave:
                if not (0 <= s < n and 0 <= d < n) or s == d:
                    raise ValueError(f"wave {w}: pair ({s}, {d}) is not a remote pair of {n} nodes")
                if (s, d) in seen:
                    raise ValueError(f"pair ({s}, {d}) appears in more than one wave")
                seen.add((s, d))
        missing = n * (n - 1) - len(seen)
        if missing:
            raise ValueError(
                f"schedule covers {len(seen)} of the {n * (n - 1)} remote node pairs; every "
                f"ordered "
                "pair must be sent in exactly one wave"
            )

    @property
    def num_waves(self) -> int:
        return len(self.waves)

    def pair_wave_NN(self) -> torch.Tensor:
        """[N, N] int64: wave of each ordered pair, -1 on the diagonal (local pairs)."""
        # The cached tensor is shared: hand out a copy so no caller can corrupt the cache.
        return _pair_wave(self).clone()

    def max_fanin(self) -> int:
        """Largest number of senders into one receiver node within one wave."""
        best = 0
        for wave in self.waves:
            counts: dict[int, int] = {}
            for _, d in wave:
                counts[d] = counts.get(d, 0) + 1
            best = max(best, max(counts.values(), default=0))
        return best

    def to_list(self) -> list[list[list[int]]]:
        return [[[s, d] for s, d in wave] for wave in self.waves]


@functools.lru_cache(maxsize=64)
def _pair_wave(schedule: WaveSchedule) -> torch.Tensor:
    out = torch.full((schedule.num_nodes, schedule.num_nodes), -1, dtype=torch.int64)
    for w, wave in enumerate(schedule.waves):
        for s, d in wave:
            out[s, d] = w
    return out


@functools.lru_cache(maxsize=64)
def bounded_fanin_schedule(num_nodes: int, fanin: int) -> WaveSchedule:
    """Shifts 1..N-1 grouped f at a time: wave j holds shifts j*f+1 .. min((j+1)*f, N-1)."""
    if fanin < 1:
        raise ValueError(f"fan-in must be >= 1, got {fanin}")
    n = num_nodes
    shifts = list(range(1, n))
    waves = []
    for start in range(0, len(shifts), fanin):
        group = shifts[start : start + fanin]
        waves.append(tuple((s, (s + k) % n) for k in group for s in range(n)))
    kind = "cyclic" if fanin == 1 else f"fanin{fanin}"
    return WaveSchedule(num_nodes=n, waves=tuple(waves), kind=kind)


def cyclic_schedule(num_nodes: int) -> WaveSchedule:
    """The paper's N - 1 one-to-one waves (wave k: s -> (s + k) mod N)."""
    return bounded_fanin_schedule(num_nodes, 1)


@functools.lru_cache(maxsize=64)
def all_at_once(num_nodes: int) -> WaveSchedule:
    """One window with every remote pair (NATIVE / RAIL without a replay arrangement)."""
    n = num_nodes
    pairs = tuple((s, d) for s in range(n) for d in range(n) if s != d)
    return WaveSchedule(num_nodes=n, waves=(pairs,) if pairs else (), kind="all")


def schedule_from_windows(
    num_nodes: int, windows: list[list[tuple[int, int]]] | list[list[list[int]]]
) -> WaveSchedule:
    """A schedule from explicit sending windows (replay arrangements)."""
    waves = tuple(tuple((int(s), int(d)) for s, d in win) for win in windows if len(win))
    return WaveSchedule(num_nodes=num_nodes, waves=waves, kind="windows")
