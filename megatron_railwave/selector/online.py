"""Online path selection: each layer learns the fastest path from the job's own measured times.

Letters: W ranks (N nodes x G GPUs), R rails.

Why: the paths give bitwise-identical results, so running a path in a real step costs only
time, never numerics; the measured time of a layer call on this fabric is the ground truth any
offline estimate (a flow model, replays) only approximates.

Protocol (``OnlineSelector``, one per MoE layer; pure and deterministic given the shared data):
  * every layer call ``decide``\\ s from the layer's global descriptors (B, rho_g, kappa of the
    gathered counts, ``fast_descriptors``) and the pass kind; training forwards and forward-only
    passes keep separate tables, a recompute replays its forward's path (``replay``) and is neither
    a decision nor timed (torch's default checkpoint stops it before the combine);
  * the next call of the same layer brings every rank's measured exchange time of this call on
    the count exchange (one int64 word per rank, ``encode_timing``, in the status word every row
    already has: no extra bytes); ``observe`` takes the slowest
    rank's and files it under the previous call's (pass kind, neighbourhood, path). Every rank
    sees the same words, so every rank keeps the same state and takes the same decisions, whatever
    its own clock said;
  * per (pass kind, neighbourhood): a neighbourhood is a centre in the selector coordinates
    (log2 B / ref, (rho_g - 1) / rho_scale, (kappa - 1) / kappa_scale) and the descriptors within
    ``payload_ratio`` and ``shape_distance`` of it. Inside one, each
    candidate path is probed ``probes`` times, round by round (a candidate whose first times are
    the drop bar slower than the best median so far stops early), then the path with the lowest
    median runs ("exploit"); an exploit call becomes a re-probe of the stalest other candidate
    whose wait has paid for it: at least ``reprobe_every`` exploit calls since its last probe, and
    that many times ``reprobe_budget`` at least its known excess over the best (median ratio - 1),
    so re-probing costs about ``reprobe_budget`` of the layer's time per candidate. When the
    descriptors leave the neighbourhood, the nearest known neighbourhood that holds them is
    reused, else a new one starts, its probe order seeded by the nearest measured neighbourhood of
    the same layer and pass kind, else (``share``) of any layer of this process (one fabric), else
    in the candidates' order (JOINT first); paths the seed puts the drop bar behind the best
    wait for re-probes. The drop bar is ``drop_ratio`` until the job's own call-to-call spread is
    known (``NoiseEstimate``: every path timed again in the same neighbourhood), then
    ``drop_sigmas`` standard deviations of the ratio of two calls, between 1.1 and ``drop_ratio``
    (``_drop_bar``). With ``share``, a layer about to probe a path no time of
    it has reached yet first looks at the other layers: a nearby neighbourhood that timed it
    the drop bar behind another path defers it; another layer's probe of it in flight makes
    this layer wait (run its best path, at most ``_MAX_WAITS`` calls) for that time. JOINT and
    the seed's best are never waited for: every layer times JOINT (the fallback, and the ratios'
    reference), and the seed's best is the path this layer would run while waiting anyway;
  * fixed-capacity mode has no count exchange: the layer decides once per epoch of calls and the
    word travels on a small all-reduce of [word, -word] (``selector.capacity_epochs``); its pair
    is read by ``slowest_reduced_timing`` and filed by ``observe_reduced`` under the epoch's
    decision;
  * bad timings (a rank's NaN, negative, zero / stalled clock, or missing time, or ranks that
    disagree on whether there is one) are dropped; ``max_bad`` of them in a row switch the layer
    to JOINT for the rest of the run, with one logged reason. All of this follows from the
    shared words, so it happens on every rank at the same call.

What it learned (per layer, pass kind and neighbourhood: the best path and the median time of
each timed path) is a small YAML report (``selector.learned``, the config's ``online_out``); no
run reads it back: every run learns from its own measurements.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from operator import mul, truediv
from typing import Any

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.config import OnlineSettings
from megatron_railwave.names import Candidate, Route
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import SelectorScales, TrafficStats

_LOG = logging.getLogger(__name__)

__all__ = [
    "OnlineSettings",
    "OnlineDecision",
    "OnlineSelector",
    "SharedNeighbourhoods",
    "PROCESS_SHARED",
    "fast_descriptors",
    "encode_timing",
    "slowest_timing",
    "slowest_reduced_timing",
    "live_selectors",
    "TIMING_NONE",
    "TIMING_MISSING",
    "TIMING_NAN",
    "TIMING_NEGATIVE",
    "TIMING_STALLED",
    "TIMING_MAX_NS",
]

_ROUTE_ORDER = (Route.JOINT, Route.RAIL, Route.PERM, Route.NATIVE, Route.FLOW, Route.FLOW_WAVES)
ALL_PATHS: tuple[Candidate, ...] = tuple(Candidate(r) for r in _ROUTE_ORDER) + tuple(
    Candidate(r, streamed=True) for r in _ROUTE_ORDER
)
"""Candidates in tie-break order (JOINT first: the fallback wins ties; the min-max routes after
the paper's paths, so those keep their order; the streamed variants last)."""
_JOINT = Candidate(Route.JOINT)
"""The fallback (and the reference every other layer's ratios are taken against)."""

TIMING_NONE = 0
"""No measurement to report (the layer's first call): the same on every rank."""
TIMING_MISSING = -1
"""This rank had a call to report but no readable time (an event not complete)."""
TIMING_NAN = -2
TIMING_NEGATIVE = -3
TIMING_STALLED = -4
"""Zero elapsed time: the clock did not advance."""
_PROBLEMS = {
    TIMING_MISSING: "missing",
    TIMING_NAN: "NaN or infinite",
    TIMING_NEGATIVE: "negative",
    TIMING_STALLED: "zero (stalled clock)",
}
TIMING_MAX_NS = (1 << 54) - 1
"""Longest time a word carries (208 days; longer is clipped): the count exchange packs the word
into each row's status word, below the input-status code (``exchange.layer.pack_status``)."""
_MAX_WAITS = 2
"""Calls a neighbourhood waits for another layer's in-flight probe of a path before probing it
itself: the other layer's time arrives at its next call, one step later."""
_DROP_BAR_FLOOR = 1.1
"""The noise-aware bar (``OnlineSelector._drop_bar``) never drops or defers a candidate within 10%
of the best: on a quiet fabric (or noise-free times) the spread alone would drop a path 1% behind
on one time, and a seed from the next neighbourhood is no measurement of this one."""
_NOISE_WINDOW = 512
"""Repeated-time pairs the noise estimate keeps (``NoiseEstimate``)."""
_NOISE_MIN = 16
"""Pairs before the noise estimate is used (before: ``drop_ratio`` alone)."""


# ---------------------------------------------------------------------- descriptors
@dataclass(frozen=True, slots=True)
class _Geometry:
    """Constants of ``fast_descriptors`` for one topology (``_geometry``)."""

    world: int
    sums: np.ndarray | None
    """One rail per GPU: [W + 2 G N + 1, 2 W N + 1] float64 such that sums @ [x, x * x, 1] (x: the
    flat [W, N] records) is [per-GPU remote records (W), per (rail, destination node) remote
    records summed over source nodes (G N), the same of their squares plus ``_TINY`` (G N), all
    records (1)]. None: GPUs share rails (the einsum path below)."""
    healthy: tuple[int, ...] | None
    """Flat indices of the healthy (node, rail) ports; None: every port is healthy."""
    remote_WN: np.ndarray
    """[W, N] int64: 1 where node n is remote to rank w."""
    rail_GR: np.ndarray | None
    """[G, R] float64 rail map (None: one rail per GPU)."""
    healthy_idx: np.ndarray
    """The healthy ports as an index array (the einsum path)."""
    packed: np.ndarray
    """[3 + G + N R] int64: N, G, R, the rail of each GPU, the healthy port flags (the compiled
    ``ops.layer_descriptors``' geometry)."""


_TINY = 1e-300
"""Added to each sum of squares q: q + _TINY == q for an integer q >= 1, and a q = 0 (where the sum
t is 0 too) gives t * t / q = 0 instead of a division by zero. Every t * t / q with q >= 1 is >= 1,
so kappa, their max, is the reference's (which fills 1.0 where q = 0)."""

_GEOMETRY_BY_ID: dict[int, tuple[RailTopology, _Geometry]] = {}
"""``_geometry`` by the topology object's id (the object kept, so the id stays its own): a
lookup without hashing the topology's fields, on every layer call."""


def _geometry(topo: RailTopology) -> _Geometry:
    hit = _GEOMETRY_BY_ID.get(id(topo))
    if hit is not None and hit[0] is topo:
        return hit[1]
    geo = _geometry_of(topo)
    if len(_GEOMETRY_BY_ID) >= 64:
        _GEOMETRY_BY_ID.clear()
    _GEOMETRY_BY_ID[id(topo)] = (topo, geo)
    return geo


@lru_cache(maxsize=8)
def _geometry_of(topo: RailTopology) -> _Geometry:
    n, g, r = topo.num_nodes, topo.gpus_per_node, topo.num_rails
    w = n * g
    remote_WN = (np.arange(w)[:, None] // g != np.arange(n)[None, :]).astype(np.int64)
    rails = tuple(topo.rail_of_gpu)
    rail_GR = None
    if rails != tuple(range(g)) or r != g:
        rail_GR = np.zeros((g, r), dtype=np.float64)
        rail_GR[np.arange(g), np.asarray(rails)] = 1.0
    healthy_NR = np.zeros((n, r), dtype=bool)
    healthy_NR[:, sorted(set(rails))] = True
    for node, rail in topo.failed_rails:
        healthy_NR[node, rail] = False
    healthy_idx = np.flatnonzero(healthy_NR.reshape(-1))
    sums = None
    if rail_GR is None:
        wn, gn = w * n, g * n
        sums = np.zeros((w + 2 * gn + 1, 2 * wn + 1), dtype=np.float64)
        src, dst = np.divmod(np.arange(wn), n)  # flat record index = src * N + dst
        remote = remote_WN.reshape(-1).astype(bool)
        sums[src[remote], np.arange(wn)[remote]] = 1.0
        sums[w + (src % g * n + dst)[remote], np.arange(wn)[remote]] = 1.0
        sums[w + gn + (src % g * n + dst)[remote], wn + np.arange(wn)[remote]] = 1.0
        sums[-1, :wn] = 1.0
        sums[w + gn : w + 2 * gn, -1] = _TINY
    healthy = None if healthy_idx.size == n * r else tuple(healthy_idx.tolist())
    return _Geometry(
        world=w,
        sums=sums,
        healthy=healthy,
        remote_WN=remote_WN,
        rail_GR=rail_GR,
        healthy_idx=healthy_idx,
        packed=np.array(
            [n, g, r, *rails, *healthy_NR.reshape(-1).astype(np.int64)], dtype=np.int64
        ),
    )


def fast_descriptors(
    records_WN: torch.Tensor | np.ndarray,
    topo: RailTopology,
    *,
    record_bytes: int,
    scales: tuple[float, float, float] | None = None,
    compiled: bool = True,
) -> TrafficStats:
    """B, rho_g, kappa and the coordinates of a layer sent all node pairs at once, from the
    gathered [W, N] records: ``stats.demand_stats``'s values, cheap enough for every layer call
    (the online selector reads them there; ``demand_stats`` costs ~0.3 ms at 4 x 8).

    The sums come from one compiled call (``ops.layer_descriptors``) where the compiled ops load,
    else from numpy, the reference: with one rail per GPU (the common case) one matrix-vector
    product of the records and their squares with a per-topology constant (``_Geometry.sums``);
    GPUs sharing rails: einsums. Every sum is of integers below 2**53, so exact in any order, and
    the float operations after them are the same in both: the values are bitwise the same.

    Args:
        records_WN: [W, N] int64 (CPU tensor or array), records from rank w (railwave order:
            node-major) to node n.
        scales: (payload_ref_bytes, rho_scale, kappa_scale); default ``SelectorScales`` for
        ``topo``.
        compiled: False forces the numpy reference (the tests compare the two).
    """
    geo = _geometry(topo)
    n, w = topo.num_nodes, geo.world
    if isinstance(records_WN, torch.Tensor):
        records_WN = records_WN.numpy()  # a view, any strides (the count message's first N columns)
    sums_op = (
        ops.layer_descriptors(records_WN, geo.packed)
        if compiled and records_WN.dtype == np.int64
        else None
    )
    if sums_op is not None:
        remote_total, busiest, egress_max, healthy_mean, kappa, records_total = sums_op
        records_total = int(records_total)
    elif geo.sums is not None:
        wn = records_WN.size
        y = np.empty(2 * wn + 1, dtype=np.float64)
        y[:wn] = records_WN.reshape(-1)
        np.multiply(y[:wn], y[:wn], out=y[wn : 2 * wn])
        y[-1] = 1.0
        sums = (geo.sums @ y).tolist()
        per_gpu = sums[:w]
        remote_total = sum(per_gpu)
        busiest = max(per_gpu)
        egress_max = busiest
        healthy_mean = (
            remote_total / w
            if geo.healthy is None
            else sum([per_gpu[i] for i in geo.healthy]) / len(geo.healthy)
            if geo.healthy
            else 0.0
        )
        gn = (len(sums) - 1 - w) // 2
        total = sums[w : w + gn]
        kappa = (
            max(map(truediv, map(mul, total, total), sums[w + gn : w + 2 * gn]))  # see _TINY
            if n > 1 and remote_total > 0
            else 1.0
        )
        records_total = int(sums[-1])
    else:
        remote = (records_WN * geo.remote_WN).astype(np.float64)  # [W, N], the local node zeroed
        per_gpu_W = remote.sum(axis=1)
        remote_total = float(per_gpu_W.sum())
        busiest = float(per_gpu_W.max())
        load_NGN = np.einsum(
            "sgd,gr->srd", remote.reshape(n, w // n, n), geo.rail_GR
        )  # GPUs sharing a rail add up
        egress = load_NGN.sum(axis=2).reshape(-1)
        egress_max = float(egress.max())
        healthy_mean = float(egress[geo.healthy_idx].mean()) if geo.healthy_idx.size else 0.0
        total = load_NGN.sum(axis=0)
        squares = np.einsum("srd,srd->rd", load_NGN, load_NGN)
        kappa = (
            float(
                np.max(
                    np.divide(total * total, squares, out=np.ones_like(total), where=squares > 0)
                )
            )
            if n > 1 and remote_total > 0
            else 1.0
        )
        records_total = int(records_WN.sum())
    b_mean = remote_total / w * record_bytes
    rho = egress_max / healthy_mean if healthy_mean > 0 else 1.0
    ref, rho_scale, kappa_scale = scales if scales is not None else SelectorScales().resolve(topo)
    coords = (
        math.log2(b_mean / ref) if b_mean > 0 else -math.inf,
        (rho - 1.0) / rho_scale,
        (kappa - 1.0) / kappa_scale,
    )
    return TrafficStats(
        B_mean_bytes=b_mean,
        B_max_bytes=busiest * record_bytes,
        rho_g=rho,
        kappa=kappa,
        coords=coords,
        records_total=records_total,
        remote_records=int(remote_total),
    )


# ---------------------------------------------------------------------- timing words
def encode_timing(seconds: float | None, *, expected: bool) -> int:
    """One rank's word for the count exchange: nanoseconds (> 0), or a code.

    Args:
        seconds: this rank's measured exchange time of the layer's previous call; None: unreadable.
        expected: whether the layer had a previous call to report (the same on every rank).
    """
    if not expected:
        return TIMING_NONE
    if seconds is None:
        return TIMING_MISSING
    if not math.isfinite(seconds):
        return TIMING_NAN
    if seconds < 0:
        return TIMING_NEGATIVE
    ns = int(round(seconds * 1e9))
    if ns == 0:
        return TIMING_STALLED
    return min(ns, TIMING_MAX_NS)


def slowest_timing(words_W: Iterable[int]) -> tuple[float | None, str | None]:
    """(slowest rank's seconds, None) from every rank's word; (None, None) when no rank had a
    measurement; (None, problem) when a word is bad or the ranks disagree on whether there is one.
    The same on every rank (the words are).

    Args:
        words_W: W ints; a sequence with ``lowest`` and ``highest`` attributes (the count
            exchange's ``TimingWords``) gives the common case without a pass in Python.
    """
    lowest = getattr(words_W, "lowest", None)
    if lowest is not None:
        if lowest > 0:  # the common case, first: every rank measured
            return words_W.highest * 1e-9, None  # type: ignore[attr-defined]
        words = list(words_W)
    else:
        words = words_W if isinstance(words_W, list) else list(words_W)
        if words and min(words) > 0:
            return int(max(words)) * 1e-9, None
    words = [int(v) for v in words]
    bad = {i: v for i, v in enumerate(words) if v < 0}
    if bad:
        kinds = sorted({_PROBLEMS.get(v, f"code {v}") for v in bad.values()})
        return None, f"EP rank(s) {sorted(bad)} reported {'/'.join(kinds)} timings"
    none = [i for i, v in enumerate(words) if v == TIMING_NONE]
    if len(none) == len(words):
        return None, None
    if none:
        return None, f"EP rank(s) {none} reported no timing where the others did"
    return max(words) * 1e-9, None


def slowest_reduced_timing(max_word: int, min_word: int) -> tuple[float | None, str | None]:
    """``slowest_timing`` from the all-reduced pair instead of every rank's word: the largest
    and the smallest word over the EP group (fixed-capacity mode, ``exchange.timing_reduce``).

    The same answers: (slowest rank's seconds, None) when every rank measured; (None, None) when
    no rank had a measurement; (None, problem) when a word is bad (the smallest is a code < 0)
    or the ranks disagree on whether there is one (smallest 0, largest > 0). The pair does not
    say which ranks, so the problem names the kind only. The same on every rank (the pair is).
    """
    max_word, min_word = int(max_word), int(min_word)
    if min_word > 0:
        return max_word * 1e-9, None
    if min_word < 0:
        return (
            None,
            f"at least one EP rank reported {_PROBLEMS.get(min_word, f'code {min_word}')} timings",
        )
    if max_word == TIMING_NONE:
        return None, None
    assert max_word > 0, f"reduced timing words out of order: max {max_word} < min {min_word}"
    return None, "at least one EP rank reported no timing where the others did"


# ---------------------------------------------------------------------- state
def _median(values: Iterable[float]) -> float:
    """The median of a non-empty sequence (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    k = len(ordered)
    return ordered[k // 2] if k % 2 else 0.5 * (ordered[k // 2 - 1] + ordered[k // 2])


@dataclass(kw_only=True, slots=True)
class _Times:
    """Recent times of one path in one neighbourhood (seconds)."""

    recent: deque[float]
    count: int = 0
    last_call: int = -1
    _median: float | None = None

    def add(self, seconds: float, call: int) -> None:
        self.recent.append(seconds)
        self.count += 1
        self.last_call = call
        self._median = None

    def median(self) -> float:
        if self._median is None:
            self._median = _median(self.recent)
        return self._median


class NoiseEstimate:
    """The fabric's call-to-call timing spread, from the job's own repeated times.

    Every time a path is timed again in the same neighbourhood, |log(t / t_before)| is kept
    (the last ``_NOISE_WINDOW``); for log-normal noise of sigma per call that difference has
    sigma * sqrt(2), whose median absolute value is 0.6745 * sqrt(2) * sigma. A median, so the
    odd jump (the routing moved inside a neighbourhood) does not inflate it. Every rank files the
    same times in the same order, so every rank holds the same estimate."""

    def __init__(self) -> None:
        self._diffs: deque[float] = deque(maxlen=_NOISE_WINDOW)
        self._sigma: float | None = None
        self._dirty = False

    def add(self, seconds: float, before: float) -> None:
        if seconds > 0 and before > 0:
            self._diffs.append(abs(math.log(seconds / before)))
            self._dirty = True

    def sigma(self) -> float | None:
        """Per-call log sigma, or None before ``_NOISE_MIN`` pairs."""
        if self._dirty:
            self._dirty = False
            if len(self._diffs) >= _NOISE_MIN:
                self._sigma = _median(self._diffs) / (0.6745 * math.sqrt(2.0))
        return self._sigma


@dataclass(kw_only=True, slots=True)
class _Neighbourhood:
    """One region of the descriptor space of one layer and pass kind."""

    index: int
    centre: tuple[float, float, float]
    stats: TrafficStats
    order: tuple[Candidate, ...]
    """Probe order (the nearest measured neighbourhood's best first)."""
    times: dict[Candidate, _Times]
    deferred: set[Candidate] = field(default_factory=set)
    """Candidates not probed now (dropped early, or put behind by the seed): re-probes only."""
    seed_excess: dict[Candidate, float] = field(default_factory=dict)
    """Deferred candidates' excess over the best (ratio - 1) as the seed measured it, until this
    neighbourhood times them itself (their re-probe wait)."""
    exploits: int = 0
    reprobes: int = 0
    waits: int = 0
    """Calls this neighbourhood waited for other layers' probes (at most ``_MAX_WAITS``)."""
    probing_done: bool = False
    """Every candidate has its probes or waits for re-probes (counts only grow: stays done)."""
    probed_at: dict[Candidate, int] = field(default_factory=dict)
    """Exploit count when each candidate was last chosen to probe (its re-probe wait starts
    there)."""
    last_used: int = 0
    seeded_by: str = "none"
    seed_best: Candidate | None = None
    """The seed's fastest candidate (None: not seeded)."""
    shared_seq: int = 0
    """Order of creation among the neighbourhoods of ``SharedNeighbourhoods`` (its ties)."""

    def best(self) -> Candidate | None:
        best, best_t = None, math.inf
        for p in self.order:
            t = self.times[p]
            if t.recent:
                m = t.median()
                if m < best_t:
                    best, best_t = p, m
        return best


@dataclass(kw_only=True, slots=True)
class OnlineDecision:
    """One call's path and why (logged per layer call). Not frozen: a frozen dataclass's
    constructor costs about a microsecond more, on every layer call; nothing changes one."""

    path: Route
    mode: str
    """'probe', 'exploit', 'reprobe', 'wait' (the best timed path, or the seed's best, while
    another layer's probe of a path is in flight), 'fallback' (bad timings), 'replay'
    (recompute), 'idle' (no remote payload: every path is the same)."""
    kind: str
    neighbourhood: int = -1
    call: int = 0
    streamed: bool = False
    """The relay streamed into the rail phases (a '+streamed' candidate; ``PlanOptions``)."""

    @property
    def candidate(self) -> Candidate:
        """What ran: the route and whether its relay streamed (the key its time is filed under)."""
        return Candidate(self.path, self.streamed)


_LIVE: weakref.WeakSet[OnlineSelector] = weakref.WeakSet()


class SharedNeighbourhoods:
    """What every layer of one process measured, by pass kind (``OnlineSettings.share``): the
    seed of a layer's new neighbourhood where that layer measured nothing yet. Every rank runs
    the same layers in the same order, so every rank's copy holds the same data at each call."""

    def __init__(self) -> None:
        self.tables: dict[str, list[_Neighbourhood]] = {}
        self.pending: dict[tuple[str, Candidate], int] = {}
        """Probes decided whose times have not come back yet, per (pass kind, path)."""
        self.timed: dict[
            tuple[str, Candidate], list[tuple[float, float, float, int, _Neighbourhood]]
        ] = {}
        """The neighbourhoods in ``tables`` that timed each (pass kind, path), as (centre,
        creation order, neighbourhood): what ``ratio`` scans, instead of every neighbourhood of
        every layer."""
        self._created = 0
        self.noise = NoiseEstimate()
        """The process's timing spread (one fabric: every layer's repeated times)."""

    def ratio(
        self,
        kind: str,
        centre: tuple[float, float, float],
        path: Candidate,
        exclude: _Neighbourhood,
    ) -> float | None:
        """``path``'s median over the best other path's in the nearest other neighbourhood that
        timed both (None: none did)."""
        x, y, z = centre
        best: tuple[float, int] | None = (
            None  # (distance^2, creation order): the nearest, the oldest of ties
        )
        ratio = 0.0
        for cx, cy, cz, seq, nb in self.timed.get(
            (kind, path), ()
        ):  # the distance first, the medians only if nearer
            key = ((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2, seq)
            if best is not None and key >= best or nb is exclude:
                continue
            others = [q.median() for c, q in nb.times.items() if c != path and q.recent]
            if others:
                best, ratio = key, nb.times[path].median() / min(others)
        return None if best is None else ratio

    def add(self, kind: str, nb: _Neighbourhood) -> None:
        self._created += 1
        nb.shared_seq = self._created
        self.tables.setdefault(kind, []).append(nb)

    def remove(self, kind: str, nb: _Neighbourhood) -> None:
        """Forget ``nb`` (its layer evicted it), if it is here."""
        table = self.tables.get(kind, [])
        if any(other is nb for other in table):
            self.tables[kind] = [other for other in table if other is not nb]
            for p, t in nb.times.items():
                if t.recent:
                    self.timed[(kind, p)] = [e for e in self.timed[(kind, p)] if e[4] is not nb]

    def first_time(self, kind: str, nb: _Neighbourhood, path: Candidate) -> None:
        """``nb`` (added here, not removed) has just timed ``path`` for the first time."""
        self.timed.setdefault((kind, path), []).append((*nb.centre, nb.shared_seq, nb))

    def nearest(self, kind: str, x: float, y: float, z: float) -> _Neighbourhood | None:
        known = [nb for nb in self.tables.get(kind, []) if nb.best() is not None]
        if not known:
            return None
        return min(
            known,
            key=lambda nb: (
                (x - nb.centre[0]) ** 2 + (y - nb.centre[1]) ** 2 + (z - nb.centre[2]) ** 2
            ),
        )


PROCESS_SHARED = SharedNeighbourhoods()
"""The registry the dispatcher's selectors share (``selector_from_config``)."""


def live_selectors() -> list[OnlineSelector]:
    """Every ``OnlineSelector`` of this process, by layer (what ``selector.learned`` reports)."""
    return sorted(_LIVE, key=lambda s: (s.layer if s.layer is not None else -1, id(s)))


class OnlineSelector:
    """The online selector of one MoE layer (module docstring).

    Args:
        settings: the knobs (same on every rank).
        scales: (payload_ref_bytes, rho_scale, kappa_scale) of the coordinates.
        layer: the layer number (logs and the learned-paths report).
        shared: the process's ``SharedNeighbourhoods`` (used with ``settings.share``), or None.
    """

    def __init__(
        self,
        settings: OnlineSettings | None = None,
        *,
        scales: tuple[float, float, float],
        layer: int | None = None,
        shared: SharedNeighbourhoods | None = None,
    ) -> None:
        self.settings = settings or OnlineSettings()
        self.scales = scales
        self.layer = layer
        self.shared = shared if self.settings.share else None
        self.noise = self.shared.noise if self.shared is not None else NoiseEstimate()
        self.candidates: tuple[Candidate, ...] = tuple(
            p for p in ALL_PATHS if str(p) in self.settings.candidates
        )
        self._log_ratio = math.log2(self.settings.payload_ratio) + 1e-12
        self._tables: dict[str, list[_Neighbourhood]] = {}
        self._current: dict[str, _Neighbourhood] = {}
        self._last: OnlineDecision | None = None
        """The previous call's decision: the next call's timing words measure it."""
        self._last_nb: _Neighbourhood | None = None
        """The neighbourhood of ``_last`` (where its time is filed)."""
        self.calls = 0
        self.bad_in_row = 0
        self.bad_total = 0
        self.fallback_reason: str | None = None
        self.last_problem: str | None = None
        self.last_seconds: float | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ timings
    def expects_timing(self) -> bool:
        """Whether the next call's words carry a time (this layer had a call that is not yet
        reported): the same on every rank."""
        return self._last is not None

    def observe(
        self, words_W: Iterable[int], *, decision: OnlineDecision | None = None
    ) -> str | None:
        """File the slowest rank's time of a call run with ``decision`` (None: the previous
        call's, ``self._last``), from every rank's word. Returns a message when this switched
        the layer to JOINT (the caller logs it once), else None."""
        return self._file(*slowest_timing(words_W), decision)

    def observe_reduced(
        self, max_word: int, min_word: int, *, decision: OnlineDecision
    ) -> str | None:
        """``observe`` from the all-reduced pair (``slowest_reduced_timing``) of a call run with
        ``decision`` (fixed-capacity mode: the decision of the previous epoch; the previous
        call may be of another epoch or pass kind). ``self._last`` is left as it is."""
        return self._file(*slowest_reduced_timing(max_word, min_word), decision)

    def _file(
        self, seconds: float | None, problem: str | None, decision: OnlineDecision | None
    ) -> str | None:
        if decision is None:
            last, self._last = self._last, None
            nb = (
                self._last_nb if last is not None and last.neighbourhood >= 0 else None
            )  # where ``last`` was decided
        else:
            last = decision if decision.mode != "idle" else None
            nb = None
        self.last_seconds, self.last_problem = seconds, problem
        if last is not None and last.mode in ("probe", "reprobe") and self.shared is not None:
            key = (last.kind, last.candidate)
            self.shared.pending[key] = max(self.shared.pending.get(key, 0) - 1, 0)
        if last is None or self.fallback_reason is not None:
            return None
        if problem is None and seconds is None:
            problem = "no rank reported a timing for a call that was run"
        if problem is not None:
            self.bad_in_row += 1
            self.bad_total += 1
            if self.bad_in_row >= self.settings.max_bad:
                self.fallback_reason = (
                    f"railwave online selector, layer {self.layer}: {self.bad_in_row} bad timings "
                    f"in "
                    f"a row (last: {problem}); this layer runs JOINT for the rest of the run"
                )
                return self.fallback_reason
            return None
        self.bad_in_row = 0
        if (
            nb is None or nb.index != last.neighbourhood
        ):  # an explicit decision: look its neighbourhood up
            nb = next(
                (x for x in self._tables.get(last.kind, ()) if x.index == last.neighbourhood), None
            )
            if nb is None:  # forgotten since (``max_neighbourhoods``)
                return None
        times = nb.times[last.candidate]
        if times.recent:
            self.noise.add(seconds, times.recent[-1])
        times.add(seconds, last.call)
        if times.count == 1 and self.shared is not None:
            self.shared.first_time(last.kind, nb, last.candidate)
        return None

    # ------------------------------------------------------------------ decisions
    def replay(self, path: Route) -> OnlineDecision:
        """A recompute: the forward's path; neither a decision nor a call to time.

        ``self._last`` (the call the next words report) is left as it is: torch's default
        checkpoint (non-reentrant) stops a recompute once the tensors its backward needs are back,
        before the combine, so a recompute has no time to report, and the same holds on every
        rank. The caller reads the words its count exchange carries first (``observe``: the call
        before it)."""
        self.calls += 1
        return OnlineDecision(path=path, mode="replay", kind="recompute", call=self.calls)

    def decide(self, kind: str, stats: TrafficStats) -> OnlineDecision:
        """This call's path from the global descriptors (``fast_descriptors``) and the pass kind
        ('train' or 'forward_only')."""
        self.calls += 1
        call = self.calls
        if self.fallback_reason is not None:
            decision = OnlineDecision(path=Route.JOINT, mode="fallback", kind=kind, call=call)
        elif not math.isfinite(stats.coords[0]):  # no remote payload: every path moves the same
            decision = OnlineDecision(path=Route.JOINT, mode="idle", kind=kind, call=call)
        else:
            nb = self._neighbourhood(kind, stats, call)
            self._last_nb = nb
            chosen, mode = self._choose(nb, kind)
            if mode in ("probe", "reprobe") and self.shared is not None:
                key = (kind, chosen)
                self.shared.pending[key] = self.shared.pending.get(key, 0) + 1
            decision = OnlineDecision(
                path=chosen.route,
                streamed=chosen.streamed,
                mode=mode,
                kind=kind,
                neighbourhood=nb.index,
                call=call,
            )
        self._last = decision if decision.mode != "idle" else None
        return decision

    def _within(self, centre: tuple[float, float, float], x: float, y: float, z: float) -> bool:
        sd = self.settings.shape_distance + 1e-12
        return (
            abs(x - centre[0]) <= self._log_ratio
            and abs(y - centre[1]) <= sd
            and abs(z - centre[2]) <= sd
        )

    def _neighbourhood(self, kind: str, stats: TrafficStats, call: int) -> _Neighbourhood:
        x, y, z = stats.coords
        current = self._current.get(kind)
        if current is not None and self._within(current.centre, x, y, z):
            current.last_used = call
            return current
        table = self._tables.setdefault(kind, [])
        best, best_d2 = None, math.inf
        for nb in table:
            if self._within(nb.centre, x, y, z):
                d2 = (x - nb.centre[0]) ** 2 + (y - nb.centre[1]) ** 2 + (z - nb.centre[2]) ** 2
                if d2 < best_d2:
                    best, best_d2 = nb, d2
        if best is None:
            best = self._new_neighbourhood(kind, table, stats)
        best.last_used = call
        self._current[kind] = best
        return best

    def _new_neighbourhood(
        self, kind: str, table: list[_Neighbourhood], stats: TrafficStats
    ) -> _Neighbourhood:
        x, y, z = stats.coords
        index = max((nb.index for nb in table), default=-1) + 1
        order, deferred, seeded = self.candidates, set(), "none"
        known = [nb for nb in table if nb.best() is not None]
        near = None
        if known:  # this layer's own measurements first, then any layer's
            near = min(
                known,
                key=lambda nb: (
                    (x - nb.centre[0]) ** 2 + (y - nb.centre[1]) ** 2 + (z - nb.centre[2]) ** 2,
                    nb.index,
                ),
            )
            seeded = f"neighbourhood {near.index}"
        elif self.shared is not None:
            near = self.shared.nearest(kind, x, y, z)
            seeded = "another layer"
        excess: dict[Candidate, float] = {}
        if near is not None:
            medians = {p: t.median() for p, t in near.times.items() if t.recent}
            order, deferred, excess = self._seeded_order(medians)
        nb = _Neighbourhood(
            index=index,
            centre=(x, y, z),
            stats=stats,
            order=order,
            times={p: _Times(recent=deque(maxlen=self.settings.window)) for p in self.candidates},
            deferred=deferred,
            seed_excess=excess,
            seeded_by=seeded,
            seed_best=order[0] if near is not None else None,
        )
        if len(table) >= self.settings.max_neighbourhoods:
            old = min(table, key=lambda nb: (nb.last_used, nb.index))
            table.remove(old)
            if self.shared is not None:
                self.shared.remove(kind, old)
        table.append(nb)
        if self.shared is not None:
            self.shared.add(kind, nb)
        return nb

    def _seeded_order(
        self, medians: dict[Candidate, float]
    ) -> tuple[tuple[Candidate, ...], set[Candidate], dict[Candidate, float]]:
        """Probe order by known medians (fastest first, unknown last), the candidates put behind
        by the drop bar (probed only at re-probes) and their excess over the best."""
        ranked = sorted(
            self.candidates, key=lambda p: (medians.get(p, math.inf), self.candidates.index(p))
        )
        best = medians.get(ranked[0], math.inf)
        bar = self._drop_bar()
        deferred = {p for p in ranked[1:] if p in medians and medians[p] > bar * best}
        return tuple(ranked), deferred, {p: medians[p] / best - 1.0 for p in deferred}

    def _choose(self, nb: _Neighbourhood, kind: str) -> tuple[Candidate, str]:
        s = self.settings
        waiting = False
        ratios: dict[
            Candidate, float | None
        ] = {}  # the other layers' ratio of each path, once per call
        for round_ in range(0 if nb.probing_done else s.probes):
            for p in nb.order:
                if p in nb.deferred:
                    continue
                t = nb.times[p]
                if t.count > round_:
                    continue
                if t.count == 0 and self.shared is not None:
                    # Another layer timed it nearby against a faster path: no probe here. Another
                    # layer probes it in this step: wait for its time (one probe per path and
                    # step across the layers, not one per layer). JOINT never waits: every layer
                    # times it (the fallback, and the reference the ratios are taken against);
                    # nor does the seed's best: waiting would run it anyway, untimed as a probe
                    # (at an epoch change every layer's new neighbourhood probes it at once).
                    if p not in ratios:
                        ratios[p] = self.shared.ratio(kind, nb.centre, p, nb)
                    ratio = ratios[p]
                    if ratio is not None and ratio > self._drop_bar():
                        nb.deferred.add(p)
                        nb.seed_excess[p] = ratio - 1.0
                        continue
                    if (
                        p != _JOINT
                        and p != nb.seed_best
                        and self.shared.pending.get((kind, p), 0) > 0
                        and nb.waits < _MAX_WAITS
                    ):
                        waiting = True
                        continue
                if t.recent:
                    others = [q.median() for c, q in nb.times.items() if c != p and q.recent]
                    if others and min(t.recent) > self._drop_bar() * min(others):
                        nb.deferred.add(p)
                        continue
                nb.probed_at[p] = nb.exploits
                return p, "probe"
        if (
            waiting
        ):  # the best timed path so far (the seed's best, else JOINT, before any), until the other
            # layers' times arrive
            nb.waits += 1
            return nb.best() or nb.seed_best or _JOINT, "wait"
        nb.probing_done = True
        best = nb.best()
        if best is None:  # every candidate deferred without times (cannot happen with JOINT kept)
            return _JOINT, "probe"
        nb.exploits += 1
        challenger = self._challenger(nb, best)
        if challenger is not None:
            nb.reprobes += 1
            nb.probed_at[challenger] = nb.exploits
            return challenger, "reprobe"
        return best, "exploit"

    def _drop_bar(self) -> float:
        """How much slower than the best a candidate must be to stop probing (its own first times)
        or to be deferred (a seed's or another layer's medians): ``drop_ratio``, or, once the
        job's own timing spread is known, ``drop_sigmas`` standard deviations of the ratio of two
        calls (sqrt(2) sigma in log), kept between ``_DROP_BAR_FLOOR`` and ``drop_ratio``. A
        wrong drop costs little: a deferred candidate is re-probed once its wait has paid for it.
        Read only where a probe is judged: the spread re-sorts its window after each new time,
        which an exploit call need not pay.
        """
        s = self.settings
        sigma = self.noise.sigma() if s.drop_sigmas > 0 else None
        if sigma is None:
            return s.drop_ratio
        bar = math.exp(s.drop_sigmas * math.sqrt(2.0) * sigma)
        return min(s.drop_ratio, max(_DROP_BAR_FLOOR, bar))

    def _challenger(self, nb: _Neighbourhood, best: Candidate) -> Candidate | None:
        """The stalest candidate whose wait has paid for a re-probe (module docstring), or None."""
        s = self.settings
        best_t = nb.times[best].median()
        pick, pick_age = None, -1
        for p in nb.order:
            if p == best:
                continue
            age = nb.exploits - nb.probed_at.get(p, 0)
            if age < s.reprobe_every:
                continue
            t = nb.times[p]
            excess = (
                (t.median() / best_t - 1.0)
                if t.recent and best_t > 0
                else nb.seed_excess.get(p, s.drop_ratio - 1.0)
            )
            if age * s.reprobe_budget >= excess and age > pick_age:
                pick, pick_age = p, age
        return pick

    # ------------------------------------------------------------------ state for logs and files
    def snapshot(self, decision: OnlineDecision) -> dict[str, Any]:
        """The state behind ``decision`` for the per-layer logs: mode, neighbourhood, the median
        measured ms per path there (None: not measured), the previous call's slowest-rank ms."""
        medians: dict[str, float | None] = {}
        table = self._tables.get(decision.kind, [])
        nb = next((n for n in table if n.index == decision.neighbourhood), None)
        for p in ALL_PATHS:  # every route (the logs' columns), and this layer's streamed candidates
            if p.streamed and p not in self.candidates:
                continue
            t = nb.times.get(p) if nb is not None else None
            medians[str(p)] = t.median() * 1e3 if t is not None and t.recent else None
        return {
            "mode": decision.mode,
            "neighbourhood": decision.neighbourhood,
            "measured_ms": medians,
            "last_ms": self.last_seconds * 1e3 if self.last_seconds is not None else None,
            "bad_timings": self.bad_total,
        }

    def learned(self) -> list[tuple[str, _Neighbourhood, Candidate, dict[Candidate, float]]]:
        """What this layer measured: (pass kind, neighbourhood, best path, median seconds per
        timed path) for every neighbourhood that timed a path, by pass kind, then index."""
        out = []
        for kind in sorted(self._tables):
            for nb in sorted(self._tables[kind], key=lambda n: n.index):
                best = nb.best()
                if best is not None:
                    medians = {p: t.median() for p, t in nb.times.items() if t.recent}
                    out.append((kind, nb, best, medians))
        return out
