"""Event-driven max-min fair (progressive filling) flow-level network model.

Shape letters: L links, F flows, H hops (max links per flow, padded with -1), Q phases,
C flow classes (groups of identical flows), A active classes, P (link, sender) pairs.

Model. Every link l has a capacity C_l (bytes/s). A flow crosses a fixed set of links and
carries ``size`` bytes. At every instant the active flows get the max-min fair rates: no
rate can grow without lowering a rate that is already smaller or equal (progressive
filling: raise all rates together, freeze the flows of each link as it saturates). Rates
change only at events: a flow completes, or a phase starts. Flows belong to phases; phase q
starts ``latency(q)`` seconds after all the phases it depends on are complete (a phase
without dependencies starts at ``latency(q)``), where ``latency(q) =
incast.per_phase_latency_s + phases.latency_s_Q[q]``; a phase is complete when all its flows
are (an empty phase completes when it starts). Receiver ports (``Network.receiver_port_L``)
lose capacity as more senders hit them at once (`incast.IncastModel`), re-evaluated at
every event.

Algorithm.
  1. Grouping: flows with the same link set, size, phase and sender are merged into one
     class of weight w (its flow count); they always have equal rates and finish together.
     Sorting the F keys costs O(F H log F) once.
  2. Rates (per event): parallel water-filling on the A active classes. Each round computes
     every link's fair share s_l = remaining_capacity_l / unfrozen_weight_l; a link is a
     *local minimum* when no unfrozen flow through it sees a smaller share on another of its
     links; every unfrozen flow crossing a local-minimum link is frozen at
     min(s over its links). Shares of the other links never decrease (frozen rates are at
     most their shares), so this is exactly progressive filling, but it freezes all
     independent bottlenecks of a level at once; the global minimum is always a local
     minimum, so each round freezes at least one link. A round is a few gathers and
     ``bincount``s over the A x H entries still unfrozen: O(A H) numpy work, no Python loop
     over flows. Rounds per event = depth of the bottleneck chain (1 when all links have
     equal shares, e.g. a uniform all-to-all).
  3. Events: with rates r, class c would finish at t + rem_c / r_c. Let t1 be the earliest
     such time. If a phase starts first, the event is that start. Otherwise every class
     whose projected finish is <= min(t1 * (1 + rel_tol), next phase start) completes in
     this event, each at its own projected time (exact for the rates in force). Their
     capacity is released at the batch's rate-weighted mean finish time, so that what the
     other flows gain from the early finishers and lose to the late ones cancels to first
     order; when the batch completes a phase, release happens at t1 instead (dependent
     phases must not start in the past). Either way the release moves by at most
     rel_tol * t1. The number of events is then at most about log(T_end / T_first) /
     rel_tol plus the number of phase starts, whatever F is.
Cost: O(F H log F) grouping + sum over events of rounds * O(A H). Memory O(C H).

Accuracy. With rel_tol = 0 the result is the exact max-min fluid schedule (up to float
rounding and the 1e-9 relative tie tolerance of the local-minimum test); it agrees with
SimGrid's CM02 model with zero latency to ~1e-15 (tests/unit/netmodel/test_maxmin_simgrid.py).
Measured batching error on a 32x8 rail all-to-all with random sizes (7,936 concurrent
flows), against rel_tol = 0: rel_tol = 1e-3 -> max flow error 1.2e-3, makespan 1.1e-4;
rel_tol = 1e-2 -> 8.6e-3 and 3.6e-4. Flows that share no link (one-to-one waves) are
exact at any rel_tol. Per-event cost grows with the depth of the bottleneck chain (about
30-60 rounds for dense all-to-all with random sizes), so dense traffic with many distinct
sizes is the slow case; see bench_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_railwave.netmodel.incast import IncastModel

__all__ = [
    "FlowSet",
    "Network",
    "PhaseGraph",
    "SimResult",
    "TraceSegment",
    "links_from_csr",
    "simulate",
]

# Shares within this relative distance count as equal in the local-minimum test.
_SHARE_TOL = 1e-9


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
            raise ValueError(f"Network.capacity_Bps_L must be 1-D and non-empty, got shape {cap.shape}")
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
            raise ValueError(f"FlowSet.links_FH entries must be >= -1 (-1 = padding), min is {links.min()}")
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
    if ptr.ndim != 1 or ptr.size == 0 or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != idx.size:
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
                    f"PhaseGraph.depends_on[{q}] has invalid phases {bad}; allowed: 0..{num_phases - 1}, not {q}"
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


def _group_flows(flows: FlowSet, phase_F: np.ndarray, sender_F: np.ndarray | None):
    """Merge identical flows. Returns (class_of_F, rep_C, weight_C), classes sorted by phase."""
    num_flows = flows.num_flows
    links_sorted = np.sort(flows.links_FH, axis=1)  # -1 padding first; order is irrelevant
    cols = [phase_F, flows.size_bytes_F.view(np.int64)]
    if sender_F is not None:
        cols.append(sender_F)
    key = np.column_stack(cols + [links_sorted])
    # Sort by every column (phase first), then mark where the key changes.
    order = np.lexsort(key.T[::-1])
    key_sorted = key[order]
    new = np.ones(num_flows, dtype=bool)
    if num_flows > 1:
        new[1:] = np.any(key_sorted[1:] != key_sorted[:-1], axis=1)
    class_sorted = np.cumsum(new) - 1
    class_of_F = np.empty(num_flows, dtype=np.int64)
    class_of_F[order] = class_sorted
    rep_C = order[new]
    weight_C = np.bincount(class_sorted).astype(np.float64)
    return class_of_F, rep_C, weight_C


def _max_min_rates(link_cols: list[np.ndarray], weight_A: np.ndarray, capacity_L1: np.ndarray) -> np.ndarray:
    """Max-min fair per-flow rates of weighted classes (parallel progressive filling).

    Args:
        link_cols: H arrays [A] intp, the h-th link of each class; padding points at the
            sentinel link L (capacity inf). Columns, not an [A, H] table: numpy reduces
            along a short axis slowly.
        weight_A: [A] float64, integer-valued > 0, flows per class (so link loads are exact).
        capacity_L1: [L + 1] float64, capacities; the last entry is inf.

    Returns:
        [A] float64 > 0, rate of each flow of each class.
    """
    num_links1 = capacity_L1.size
    cols = list(link_cols)
    weight = weight_A
    load_L1 = np.zeros(num_links1)
    for col in cols:
        load_L1 += np.bincount(col, weights=weight, minlength=num_links1)
    remaining_L1 = capacity_L1.copy()
    rate_A = np.empty(weight_A.size)
    idx = np.arange(weight_A.size)
    while True:
        with np.errstate(divide="ignore", invalid="ignore"):
            share_L1 = remaining_L1 / load_L1
        share_L1[-1] = np.inf
        share_cols = [share_L1[col] for col in cols]
        fmin_A = share_cols[0].copy()
        for share in share_cols[1:]:
            np.minimum(fmin_A, share, out=fmin_A)
        # A link is blocked when one of its flows sees a clearly smaller share elsewhere;
        # unblocked links are local minima and freeze all their flows.
        threshold_A = fmin_A * (1.0 + _SHARE_TOL)
        blocked_L1 = np.zeros(num_links1, dtype=bool)
        for col, share in zip(cols, share_cols):
            blocked_L1[col[share > threshold_A]] = True
        blocked_L1[-1] = True
        freeze = ~blocked_L1[cols[0]]
        for col in cols[1:]:
            freeze |= ~blocked_L1[col]
        frozen = np.flatnonzero(freeze)
        assert frozen.size, "water-filling made no progress"
        if frozen.size == idx.size:
            rate_A[idx] = fmin_A
            break
        rate = fmin_A[frozen]
        rate_A[idx[frozen]] = rate
        weight_frozen = weight[frozen]
        used_weight = weight_frozen * rate
        for col in cols:
            col_frozen = col[frozen]
            remaining_L1 -= np.bincount(col_frozen, weights=used_weight, minlength=num_links1)
            load_L1 -= np.bincount(col_frozen, weights=weight_frozen, minlength=num_links1)
        np.maximum(remaining_L1, 0.0, out=remaining_L1)
        kept = np.flatnonzero(~freeze)
        cols = [col[kept] for col in cols]
        weight, idx = weight[kept], idx[kept]
    assert np.all(rate_A > 0), "water-filling produced a zero rate"
    return rate_A


def simulate(
    network: Network,
    flows: FlowSet,
    phases: PhaseGraph | None = None,
    *,
    incast: IncastModel | None = None,
    rel_tol: float = 1e-3,
    record_trace: bool = False,
) -> SimResult:
    """Completion times of ``flows`` on ``network`` under max-min fair sharing.

    Args:
        network: link capacities [L] and receiver ports [L].
        flows: F flows; link ids must be < L and phases < Q.
        phases: start conditions of the Q phases; default one phase with no dependency.
        incast: receiver-port penalty and per-phase latency; default `IncastModel.off()`.
        rel_tol: flows whose projected finish lies within ``rel_tol * t`` after the next
            completion t complete in the same event (see the module docstring); 0 = exact.
            1e-3 keeps flow times within ~0.1%; 1e-2 (~1%) is the fast setting for dense
            traffic with many distinct sizes.
        record_trace: keep the per-flow rates of every interval (memory O(events * F);
            for tests and small cases). With rel_tol > 0 a batched flow keeps its rate
            until the release time, so its traced bytes can differ from its size by up to
            rel_tol * t * rate.

    Returns:
        `SimResult` with [F] flow and [Q] phase times.

    Raises:
        ValueError: a link id >= L, a phase id >= Q, or rel_tol outside [0, 0.1].
    """
    incast = IncastModel.off() if incast is None else incast
    phases = PhaseGraph.independent(1) if phases is None else phases
    if not 0.0 <= rel_tol <= 0.1:
        raise ValueError(f"rel_tol must be in [0, 0.1], got {rel_tol!r}")
    num_links = network.num_links
    num_phases = phases.num_phases
    num_flows = flows.num_flows
    if flows.links_FH.size and flows.links_FH.max() >= num_links:
        raise ValueError(
            f"FlowSet.links_FH has link id {flows.links_FH.max()} but the network has {num_links} links"
        )
    phase_F = np.zeros(num_flows, dtype=np.int64) if flows.phase_F is None else flows.phase_F
    if num_flows and phase_F.max() >= num_phases:
        raise ValueError(
            f"FlowSet.phase_F has phase {phase_F.max()} but the phase graph has {num_phases} phases"
        )
    rx_L = network.receiver_port_L
    use_incast = incast.penalizes and rx_L is not None and bool(rx_L.any())

    # ---- grouping: classes sorted by phase --------------------------------------------
    class_of_F, rep_C, weight_C = _group_flows(flows, phase_F, flows.sender_F if use_incast else None)
    num_classes = rep_C.size
    size_C = flows.size_bytes_F[rep_C]
    phase_C = phase_F[rep_C]
    links_CH = flows.links_FH[rep_C].astype(np.intp)
    links_CH[links_CH < 0] = num_links  # sentinel link with infinite capacity
    links_HC = [np.ascontiguousarray(links_CH[:, h]) for h in range(links_CH.shape[1])]
    phase_ptr_Q1 = np.searchsorted(phase_C, np.arange(num_phases + 1))

    capacity_L1 = np.append(network.capacity_Bps_L, np.inf)
    rx_L1 = np.append(rx_L, False) if use_incast else None
    pair_CH = pair_link_P = None
    if use_incast and flows.sender_F is not None:
        # One id per distinct (receiver port, sender); k of a port = its active pairs.
        sender_C = flows.sender_F[rep_C]
        is_rx = rx_L1[links_CH]
        pair_key = np.where(is_rx, links_CH * (int(sender_C.max()) + 1) + sender_C[:, None], -1)
        uniq, inv = np.unique(pair_key[is_rx], return_inverse=True)
        pair_CH = np.full(links_CH.shape, -1, dtype=np.intp)
        pair_CH[is_rx] = inv
        pair_link_P = uniq // (int(sender_C.max()) + 1)

    latency_Q = np.full(num_phases, incast.per_phase_latency_s)
    if phases.latency_s_Q is not None:
        latency_Q = latency_Q + phases.latency_s_Q
    children: list[list[int]] = [[] for _ in range(num_phases)]
    deps_left_Q = np.zeros(num_phases, dtype=np.int64)
    for q, deps in enumerate(phases.depends_on):
        for p in set(deps):
            children[p].append(q)
            deps_left_Q[q] += 1
    phase_start_Q = np.full(num_phases, np.inf)
    phase_finish_Q = np.full(num_phases, -np.inf)
    outstanding_Q = np.diff(phase_ptr_Q1)  # classes not yet complete
    started_Q = np.zeros(num_phases, dtype=bool)
    complete_Q = np.zeros(num_phases, dtype=bool)
    pending: list[int] = []  # ready phases (start time known) not yet started
    for q in range(num_phases):
        if deps_left_Q[q] == 0:
            phase_start_Q[q] = latency_Q[q]
            pending.append(q)

    finish_C = np.full(num_classes, np.nan)
    act_cls = np.empty(0, dtype=np.intp)
    act_cols = [np.empty(0, dtype=np.intp) for _ in links_HC]  # [H] x [A] link ids
    act_w = np.empty(0)
    act_rem = np.empty(0)
    trace: list[TraceSegment] = []
    t = 0.0
    num_events = 0

    def complete_phases(done_q: np.ndarray) -> None:
        # Work-list over phases whose last class finished (or that are empty and started).
        work = [int(q) for q in done_q]
        while work:
            p = work.pop()
            if complete_Q[p] or not started_Q[p] or outstanding_Q[p] > 0:
                continue
            complete_Q[p] = True
            phase_finish_Q[p] = max(phase_finish_Q[p], phase_start_Q[p])
            for q in children[p]:
                deps_left_Q[q] -= 1
                if deps_left_Q[q] == 0:
                    ready_s = max(phase_finish_Q[d] for d in set(phases.depends_on[q]))
                    phase_start_Q[q] = ready_s + latency_Q[q]
                    pending.append(q)

    def finish_classes(cls: np.ndarray, finish_s: np.ndarray) -> None:
        finish_C[cls] = finish_s
        q_done = phase_C[cls]
        outstanding_Q[:] -= np.bincount(q_done, minlength=num_phases)
        np.maximum.at(phase_finish_Q, q_done, finish_s)
        complete_phases(np.unique(q_done))

    while True:
        num_active = act_cls.size
        if num_active == 0 and not pending:
            break
        t_phase = min((phase_start_Q[q] for q in pending), default=np.inf)
        if num_active:
            cap = capacity_L1
            if use_incast:
                cap = capacity_L1.copy()
                if pair_CH is None:
                    k_L1 = np.zeros(num_links + 1)
                    for col in act_cols:
                        ent = rx_L1[col]
                        k_L1 += np.bincount(col[ent], weights=act_w[ent], minlength=num_links + 1)
                else:
                    act_pair = pair_CH[act_cls].ravel()
                    live_P = np.bincount(act_pair[act_pair >= 0], minlength=pair_link_P.size) > 0
                    k_L1 = np.bincount(pair_link_P[live_P], minlength=num_links + 1).astype(np.float64)
                cap[rx_L1] *= incast.capacity_factor(k_L1[rx_L1])
            rate = _max_min_rates(act_cols, act_w, cap)
            t_fin = t + act_rem / rate
            t_flow = float(t_fin.min())
            num_events += 1
        else:
            t_flow = np.inf
        t_new = min(t_flow, t_phase)
        done = None
        if num_active and t_flow <= t_phase:
            done = t_fin <= min(t_flow * (1.0 + rel_tol), t_phase)
            if rel_tol > 0.0:
                # Release the batch's capacity at its rate-weighted mean finish time, so
                # that what the others gain early and lose late cancels to first order.
                # Not when the batch completes a phase: dependents must not start in the past.
                count_Q = np.bincount(phase_C[act_cls[done]], minlength=num_phases)
                if not np.any((count_Q > 0) & (count_Q == outstanding_Q)):
                    flow_rate = rate[done] * act_w[done]
                    t_mid = float(np.dot(t_fin[done], flow_rate) / flow_rate.sum())
                    t_new = min(max(t_mid, t_flow), t_phase)
        if num_active:
            if record_trace:
                rate_F = np.zeros(num_flows)
                rate_C = np.zeros(num_classes)
                rate_C[act_cls] = rate
                rate_F[:] = rate_C[class_of_F]
                trace.append(TraceSegment(start_s=t, end_s=t_new, rate_Bps_F=rate_F, capacity_Bps_L=cap[:-1].copy()))
            act_rem = act_rem - rate * (t_new - t)
            if done is not None:
                finish_classes(act_cls[done], t_fin[done])
                keep = ~done
                kept = np.flatnonzero(keep)
                act_cls, act_w, act_rem = act_cls[kept], act_w[kept], act_rem[kept]
                act_cols = [col[kept] for col in act_cols]
        t = t_new
        # Start every pending phase due now; starting one may complete it (empty phase),
        # which can make more phases due at the same time.
        while pending:
            due = [q for q in pending if phase_start_Q[q] <= t]
            if not due:
                break
            pending[:] = [q for q in pending if phase_start_Q[q] > t]
            new_cls = []
            for q in due:
                started_Q[q] = True
                lo, hi = phase_ptr_Q1[q], phase_ptr_Q1[q + 1]
                cls = np.arange(lo, hi)
                zero = size_C[cls] == 0
                if zero.any():
                    finish_classes(cls[zero], np.full(int(zero.sum()), phase_start_Q[q]))
                new_cls.append(cls[~zero])
                complete_phases(np.array([q]))
            cls = np.concatenate(new_cls)
            if cls.size:
                act_cls = np.concatenate([act_cls, cls])
                act_cols = [np.concatenate([col, links[cls]]) for col, links in zip(act_cols, links_HC)]
                act_w = np.concatenate([act_w, weight_C[cls]])
                act_rem = np.concatenate([act_rem, size_C[cls]])

    assert not np.isnan(finish_C).any(), "some flow class never completed"
    return SimResult(
        finish_s_F=finish_C[class_of_F],
        phase_start_s_Q=phase_start_Q,
        phase_finish_s_Q=phase_finish_Q,
        num_events=num_events,
        num_classes=num_classes,
        trace=tuple(trace) if record_trace else None,
    )
