"""Inputs and outputs of the flow-level engine (`maxmin.simulate`).

Shape letters: L links, F flows, H hops (max links per flow, padded with -1), Q phases.

All are frozen dataclasses that validate and normalise their arrays in ``__post_init__``
(dtype float64 / int64 / bool, contiguous); a user error raises ``ValueError`` naming the
field, the offending entries and their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["FlowSet", "Network", "PhaseGraph", "SimResult", "TraceSegment", "links_from_csr"]


def _frozen_set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Network:
    """Links of the modelled fabric."""

    capacity_Bps_L: np.ndarray
    """[L] float64, capacity of each link in bytes/s, finite and > 0."""

    receiver_port_L: np.ndarray | None = None
    """[L] bool, links whose capacity the incast model reduces (typically the NIC
    downlinks, i.e. the ports that face a receiver). None = no receiver ports."""

    def __post_init__(self) -> None:
        cap = np.ascontiguousarray(self.capacity_Bps_L, dtype=np.float64)
        if cap.ndim != 1 or cap.size == 0:
            raise ValueError(
                f"Network.capacity_Bps_L must be 1-D and non-empty, got shape {cap.shape}"
            )
        if not np.all(np.isfinite(cap) & (cap > 0)):
            bad = np.flatnonzero(~(np.isfinite(cap) & (cap > 0)))[:5]
            raise ValueError(
                f"Network.capacity_Bps_L must be finite and > 0; links {bad.tolist()} have "
                f"{cap[bad].tolist()}"
            )
        _frozen_set(self, "capacity_Bps_L", cap)
        if self.receiver_port_L is not None:
            rx = np.asarray(self.receiver_port_L, dtype=bool)
            if rx.shape != cap.shape:
                raise ValueError(
                    f"Network.receiver_port_L must have shape {cap.shape} (one per link), "
                    f"got {rx.shape}"
                )
            _frozen_set(self, "receiver_port_L", rx)

    @property
    def num_links(self) -> int:
        return int(self.capacity_Bps_L.size)


@dataclass(frozen=True, kw_only=True, slots=True)
class FlowSet:
    """Flows to simulate; each crosses a fixed set of links."""

    size_bytes_F: np.ndarray
    """[F] float64, bytes of each flow, finite and >= 0 (0 completes at its phase start)."""

    links_FH: np.ndarray
    """[F, H] int, link ids each flow crosses; -1 pads short rows. Each flow crosses at
    least one link and no link twice. Use `links_from_csr` for CSR input."""

    phase_F: np.ndarray | None = None
    """[F] int, phase of each flow in [0, Q). None = every flow in phase 0."""

    sender_F: np.ndarray | None = None
    """[F] int, sender id of each flow, used only to count distinct senders into a receiver
    port for incast. None = every flow is its own sender."""

    def __post_init__(self) -> None:
        size = np.ascontiguousarray(self.size_bytes_F, dtype=np.float64)
        if size.ndim != 1:
            raise ValueError(f"FlowSet.size_bytes_F must be 1-D, got shape {size.shape}")
        if not np.all(np.isfinite(size) & (size >= 0)):
            bad = np.flatnonzero(~(np.isfinite(size) & (size >= 0)))[:5]
            raise ValueError(
                f"FlowSet.size_bytes_F must be finite and >= 0; flows {bad.tolist()} have "
                f"{size[bad].tolist()}"
            )
        links = np.asarray(self.links_FH)
        if links.ndim != 2 or links.shape[0] != size.size or links.shape[1] == 0:
            raise ValueError(
                f"FlowSet.links_FH must have shape [F={size.size}, H>=1], got {links.shape}"
            )
        if not np.issubdtype(links.dtype, np.integer):
            raise TypeError(f"FlowSet.links_FH must be an integer array, got dtype {links.dtype}")
        links = np.ascontiguousarray(links, dtype=np.int64)
        if np.any(links < -1):
            raise ValueError(
                f"FlowSet.links_FH entries must be >= -1 (-1 = padding), min is {links.min()}"
            )
        empty = np.flatnonzero(np.all(links < 0, axis=1))
        if empty.size:
            raise ValueError(
                f"every flow must cross at least one link; flows {empty[:5].tolist()} have none"
            )
        srt = np.sort(links, axis=1)
        dup = np.flatnonzero(np.any((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0), axis=1))
        if dup.size:
            raise ValueError(
                f"a flow may cross a link at most once; flows {dup[:5].tolist()} repeat a link"
            )
        _frozen_set(self, "size_bytes_F", size)
        _frozen_set(self, "links_FH", links)
        for name in ("phase_F", "sender_F"):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.asarray(value)
            if arr.shape != size.shape or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(
                    f"FlowSet.{name} must be an integer array of shape {size.shape}, "
                    f"got {arr.dtype} {arr.shape}"
                )
            if arr.size and arr.min() < 0:
                raise ValueError(f"FlowSet.{name} must be >= 0, min is {arr.min()}")
            _frozen_set(self, name, np.ascontiguousarray(arr, dtype=np.int64))

    @property
    def num_flows(self) -> int:
        return int(self.size_bytes_F.size)


def links_from_csr(link_ptr_F1: np.ndarray, link_idx: np.ndarray) -> np.ndarray:
    """Padded [F, H] link table (-1 padding) from CSR (``link_idx[ptr[f]:ptr[f+1]]``).

    Args:
        link_ptr_F1: [F + 1] int, non-decreasing offsets, ``ptr[0] == 0``.
        link_idx: [ptr[F]] int, link ids.

    Returns:
        [F, H] int64 with H = the longest row (at least 1).
    """
    ptr = np.asarray(link_ptr_F1, dtype=np.int64)
    idx = np.asarray(link_idx, dtype=np.int64)
    if (
        ptr.ndim != 1
        or ptr.size == 0
        or ptr[0] != 0
        or np.any(np.diff(ptr) < 0)
        or ptr[-1] != idx.size
    ):
        raise ValueError(
            "link_ptr_F1 must be non-decreasing, start at 0 and end at len(link_idx)="
            f"{idx.size}; got ptr[0]={ptr[:1].tolist()}, ptr[-1]={ptr[-1:].tolist()}"
        )
    count_F = np.diff(ptr)
    num_hops = max(int(count_F.max(initial=0)), 1)
    out = np.full((count_F.size, num_hops), -1, dtype=np.int64)
    row = np.repeat(np.arange(count_F.size), count_F)
    col = np.arange(idx.size) - np.repeat(ptr[:-1], count_F)
    out[row, col] = idx
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseGraph:
    """Start conditions of the phases (a DAG)."""

    depends_on: tuple[tuple[int, ...], ...]
    """Per phase q, the phases that must be complete before q starts."""

    latency_s_Q: np.ndarray | None = None
    """[Q] float64 >= 0, extra latency of each phase, added to
    `IncastModel.per_phase_latency_s` (e.g. packing time). None = zeros."""

    def __post_init__(self) -> None:
        deps = tuple(tuple(int(p) for p in d) for d in self.depends_on)
        num_phases = len(deps)
        for q, d in enumerate(deps):
            bad = [p for p in d if not 0 <= p < num_phases or p == q]
            if bad:
                raise ValueError(
                    f"PhaseGraph.depends_on[{q}] has invalid phases {bad}; allowed: "
                    f"0..{num_phases - 1}, not {q}"
                )
        _frozen_set(self, "depends_on", deps)
        if self.latency_s_Q is not None:
            lat = np.asarray(self.latency_s_Q, dtype=np.float64)
            if lat.shape != (num_phases,) or not np.all(np.isfinite(lat) & (lat >= 0)):
                raise ValueError(
                    f"PhaseGraph.latency_s_Q must be [{num_phases}] finite values >= 0, got {lat!r}"
                )
            _frozen_set(self, "latency_s_Q", lat)
        # Kahn's algorithm: every phase must be reachable in topological order.
        indeg = [len(set(d)) for d in deps]
        children: list[list[int]] = [[] for _ in range(num_phases)]
        for q, d in enumerate(deps):
            for p in set(d):
                children[p].append(q)
        ready = [q for q in range(num_phases) if indeg[q] == 0]
        seen = 0
        while ready:
            p = ready.pop()
            seen += 1
            for q in children[p]:
                indeg[q] -= 1
                if indeg[q] == 0:
                    ready.append(q)
        if seen != num_phases:
            cyclic = [q for q in range(num_phases) if indeg[q] > 0]
            raise ValueError(f"PhaseGraph.depends_on has a cycle through phases {cyclic[:10]}")

    @property
    def num_phases(self) -> int:
        return len(self.depends_on)

    @classmethod
    def independent(cls, num_phases: int) -> PhaseGraph:
        """``num_phases`` phases that all start at once (after the per-phase latency)."""
        return cls(depends_on=((),) * num_phases)

    @classmethod
    def chain(cls, num_phases: int) -> PhaseGraph:
        """Phases run in order: phase q starts after phase q - 1 is complete."""
        return cls(depends_on=((),) + tuple((q - 1,) for q in range(1, num_phases)))


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceSegment:
    """Rates in force during one interval between events (``record_trace=True``)."""

    start_s: float
    end_s: float
    rate_Bps_F: np.ndarray
    """[F] float64, rate of each flow (0 when not active)."""
    capacity_Bps_L: np.ndarray
    """[L] float64, link capacities after the incast reduction."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Output of `simulate`. Times are seconds from t = 0."""

    finish_s_F: np.ndarray
    """[F] float64, completion time of each flow."""
    phase_start_s_Q: np.ndarray
    """[Q] float64, when each phase's flows start."""
    phase_finish_s_Q: np.ndarray
    """[Q] float64, when each phase is complete."""
    num_events: int
    """Rate recomputations performed."""
    num_classes: int
    """Flow classes after grouping identical flows."""
    trace: tuple[TraceSegment, ...] | None = field(default=None)
    """Per-interval rates when ``record_trace=True``, else None."""

    @property
    def makespan_s(self) -> float:
        return float(self.phase_finish_s_Q.max(initial=0.0))
