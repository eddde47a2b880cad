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
  2. Rates (per event): parallel progressive filling (`fill`). Each round computes every
     link's fair share s_l = remaining_capacity_l / unfrozen_weight_l; a link is a *local
     minimum* when no unfrozen flow through it sees a smaller share on another of its
     links, and every unfrozen flow crossing a local minimum is frozen at its smallest
     share. Shares of the other links never decrease (frozen rates are at most their
     shares), so this is exactly progressive filling, freezing all independent bottlenecks
     of a level at once; the global minimum is always a local minimum, so every round makes
     progress. Rounds per event = depth of the bottleneck chain: 1 when all links have equal
     shares (uniform all-to-all), ~40 (64 x 8) to ~200 (256 x 8) for a rail all-to-all
     with random sizes. Small active sets test every link each round (O(A H) numpy work per
     round); large ones (>= 65,536 entries) test only the links with the smallest shares
     through a link-sorted index, O(flows of those links) per round. No Python loop over
     flows anywhere.
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
Cost: O(F H log F) grouping + sum over events of (O(A H) + rounds * round cost). Memory O(C H).

Accuracy. With rel_tol = 0 the result is the exact max-min fluid schedule (up to float
rounding and the 1e-9 relative tie tolerance of the local-minimum test); it agrees with
SimGrid's CM02 model with zero latency to ~1e-15 (tests/unit/netmodel/test_maxmin_simgrid.py).
Measured batching error on a 32x8 rail all-to-all with random sizes (7,936 concurrent
flows), against rel_tol = 0: rel_tol = 1e-3 -> max flow error 1.2e-3, makespan 1.1e-4;
rel_tol = 1e-2 -> 8.6e-3 and 3.6e-4. Flows that share no link (one-to-one waves) are
exact at any rel_tol. Dense traffic with many distinct sizes is the slow case (many
events, deep bottleneck chains); see bench_engine.py for timings.
"""

from __future__ import annotations

import numpy as np

from megatron_railwave.lab.netmodel.fill import LinkIndex, max_min_rates, max_min_rates_indexed
from megatron_railwave.lab.netmodel.incast import IncastModel
from megatron_railwave.lab.netmodel.problem import (
    FlowSet,
    Network,
    PhaseGraph,
    SimResult,
    TraceSegment,
)

__all__ = ["simulate"]

# Below this many active (class, hop) entries the plain water-filling is faster: its rounds
# make fewer numpy calls, and per-call overhead dominates small arrays.
_INDEXED_MIN_ENTRIES = 1 << 16


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


class _ReceiverPorts:
    """Counts the distinct senders with an active flow into each receiver port."""

    def __init__(
        self, network: Network, links_CH: np.ndarray, sender_F: np.ndarray | None, rep_C: np.ndarray
    ):
        self.num_links1 = network.num_links + 1
        self.rx_L1 = np.append(network.receiver_port_L, False)
        self.pair_CH = self.pair_link_P = None
        if sender_F is not None:
            # One id per distinct (receiver port, sender); k of a port = its active pairs.
            sender_C = sender_F[rep_C]
            radix = int(sender_C.max()) + 1
            is_rx = self.rx_L1[links_CH]
            pair_key = links_CH * radix + sender_C[:, None]
            uniq, inv = np.unique(pair_key[is_rx], return_inverse=True)
            self.pair_CH = np.full(links_CH.shape, -1, dtype=np.intp)
            self.pair_CH[is_rx] = inv
            self.pair_link_P = uniq // radix

    def num_senders(
        self, act_cls: np.ndarray, act_links_HA: np.ndarray, act_w: np.ndarray
    ) -> np.ndarray:
        """[number of receiver ports] float64, k of each port given the active classes."""
        if self.pair_CH is None:  # every flow is its own sender: k = active flows (weights)
            k_L1 = np.zeros(self.num_links1)
            for col in act_links_HA:
                ent = self.rx_L1[col]
                k_L1 += np.bincount(
                    np.compress(ent, col),
                    weights=np.compress(ent, act_w),
                    minlength=self.num_links1,
                )
        else:
            act_pair = self.pair_CH[act_cls].ravel()
            live_P = (
                np.bincount(np.compress(act_pair >= 0, act_pair), minlength=self.pair_link_P.size)
                > 0
            )
            k_L1 = np.bincount(self.pair_link_P[live_P], minlength=self.num_links1).astype(
                np.float64
            )
        return k_L1[self.rx_L1]


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
            f"FlowSet.links_FH has link id {flows.links_FH.max()} but the network has {num_links} "
            f"links"
        )
    phase_F = np.zeros(num_flows, dtype=np.int64) if flows.phase_F is None else flows.phase_F
    if num_flows and phase_F.max() >= num_phases:
        raise ValueError(
            f"FlowSet.phase_F has phase {phase_F.max()} but the phase graph has {num_phases} phases"
        )
    rx_L = network.receiver_port_L
    use_incast = incast.penalizes and rx_L is not None and bool(rx_L.any()) and num_flows > 0

    # ---- grouping: classes sorted by phase --------------------------------------------
    class_of_F, rep_C, weight_C = _group_flows(
        flows, phase_F, flows.sender_F if use_incast else None
    )
    num_classes = rep_C.size
    size_C = flows.size_bytes_F[rep_C]
    phase_C = phase_F[rep_C]
    links_CH = flows.links_FH[rep_C].astype(np.intp)
    links_CH[links_CH < 0] = num_links  # sentinel link with infinite capacity
    links_HC = np.ascontiguousarray(links_CH.T)
    phase_ptr_Q1 = np.searchsorted(phase_C, np.arange(num_phases + 1))

    capacity_L1 = np.append(network.capacity_Bps_L, np.inf)
    ports = _ReceiverPorts(network, links_CH, flows.sender_F, rep_C) if use_incast else None

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
    act_links_HA = np.empty((links_HC.shape[0], 0), dtype=np.intp)
    index: LinkIndex | None = None  # active entries sorted by link, built when first needed
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
            if ports is not None:
                cap = capacity_L1.copy()
                cap[ports.rx_L1] *= incast.capacity_factor(
                    ports.num_senders(act_cls, act_links_HA, act_w)
                )
            if act_links_HA.size < _INDEXED_MIN_ENTRIES:
                rate = max_min_rates(act_links_HA, act_w, cap)
            else:
                if index is None:
                    index = LinkIndex(act_links_HA, num_links + 1)
                rate = max_min_rates_indexed(act_links_HA, act_w, cap, index)
            t_fin = t + act_rem / rate
            t_flow = float(t_fin.min())
            num_events += 1
        else:
            t_flow = np.inf
        t_new = min(t_flow, t_phase)
        done = None
        if num_active and t_flow <= t_phase:
            done = np.flatnonzero(t_fin <= min(t_flow * (1.0 + rel_tol), t_phase))
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
                trace.append(
                    TraceSegment(
                        start_s=t, end_s=t_new, rate_Bps_F=rate_F, capacity_Bps_L=cap[:-1].copy()
                    )
                )
            act_rem = act_rem - rate * (t_new - t)
            if done is not None:
                finish_classes(act_cls[done], t_fin[done])
                keep = np.ones(num_active, dtype=bool)
                keep[done] = False
                kept = np.flatnonzero(keep)
                act_cls, act_w, act_rem = act_cls[kept], act_w[kept], act_rem[kept]
                act_links_HA = act_links_HA.take(kept, axis=1)
                if index is not None:
                    index.compact(kept, num_active)
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
                act_links_HA = np.concatenate([act_links_HA, links_HC.take(cls, axis=1)], axis=1)
                index = None
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
