"""A link program: phases with start conditions and the bytes each phase moves over which links.

Shape letters: N nodes (s source, d destination), G GPUs per node, L links, F flows, H hops,
Q phases.

Every modelled exchange (a compiled `schedule.ExecutionSchedule`, or a peer in `peers`) becomes
one `LinkProgram` and is simulated in ONE run of the max-min engine (`maxmin.simulate`): phases
that overlap in time share every port they both cross (NVLink ports of a GPU, NIC ports,
adapters, leaf uplinks). Nothing is simulated apart and added up, so no phase can go faster
than its ports allow while another phase uses them.

Phase synchronisation. A program as built is *global*: phase k + 1 starts when phase k is
complete everywhere. `rank_synced` splits it per rank, as the exchange runs (each rank posts its
next phase once ITS OWN sends and receives of the phases it depends on are done, and a transfer
moves once both its ends have posted it): every phase becomes, per rank r, a flowless 'post'
part (r's own parts of the dependencies done; r posts its phases in program order), a 'start'
part (the phase's fixed cost, paid by every rank), one part per (src, dst) pair holding that
pair's flows (it starts when both ends have started) and a 'done' join of r's pairs. Phases
named global (a collective) stay one phase that waits for every rank.

`bandwidth_bound` is the program's bandwidth lower bound: per direction (dispatch, combine),
the busiest link's bytes over its capacity (NVLink ports and rails alike), summed over the two
directions (combine starts after dispatch). No fixed cost, no incast: the modelled time can never
be below it. In a rank-synced program one rank's combine may overlap another's dispatch, so the
sum no longer holds; `rank_bandwidth_bound` gives what does (`run_program` picks the right one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_railwave.lab.netmodel.cluster import Fabric
from megatron_railwave.lab.netmodel.incast import IncastModel
from megatron_railwave.lab.netmodel.maxmin import simulate
from megatron_railwave.lab.netmodel.problem import FlowSet, PhaseGraph, SimResult

__all__ = [
    "LinkProgram",
    "ProgramBuilder",
    "ProgramRun",
    "bandwidth_bound",
    "phase_times",
    "rank_bandwidth_bound",
    "rank_synced",
    "run_program",
]

DIRECTIONS = ("dispatch", "combine")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProgram:
    """Phases and flows of one dispatch + combine (identical for every caller).

    Attributes:
        names: [Q] phase names ('dispatch.rail[0]', 'counts', ...).
        kinds: [Q] 'relay', 'rail', 'deliver', 'alltoall', 'sync' (flowless: a fixed cost or a
        join).
        direction_Q: [Q] int64, 0 dispatch, 1 combine, -1 neither (start, expert compute).
        depends_on: per phase, the phases that must be complete before it starts.
        latency_s_Q: [Q] float64, fixed cost paid between its dependencies and its flows.
        flows: the flows (bytes over links, phase, sender for the incast count).
        nvlink_F: [F] bool, flows that cross only NVLink ports.
        ends_F2: [F, 2] int64, the ranks that post each flow (source, destination); on a PXN
            hop the source rank, not the GPU whose rail it leaves on.
        source: for a rank-synced program (`rank_synced`), the global program it was split
            from; None for a global program.
        origin_Q: [Q] int64, rank-synced: the phase of ``source`` each phase is a part of.
        num_ranks: rank-synced: W, the ranks the phases were split over; 0 for a global program.
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    direction_Q: np.ndarray
    depends_on: tuple[tuple[int, ...], ...]
    latency_s_Q: np.ndarray
    flows: FlowSet
    nvlink_F: np.ndarray
    ends_F2: np.ndarray
    source: LinkProgram | None = None
    origin_Q: np.ndarray | None = None
    num_ranks: int = 0

    @property
    def num_phases(self) -> int:
        return len(self.names)

    def phases(self) -> PhaseGraph:
        return PhaseGraph(depends_on=self.depends_on, latency_s_Q=self.latency_s_Q)

    def link_bytes_DL(self, num_links: int) -> np.ndarray:
        """[2, L] float64: bytes each link carries in dispatch and in combine."""
        out = np.zeros((2, num_links))
        direction_F = self.direction_Q[self.flows.phase_F]
        for d in range(2):
            sel = direction_F == d
            links = self.flows.links_FH[sel]
            size = np.repeat(self.flows.size_bytes_F[sel], links.shape[1]).reshape(links.shape)
            ok = links >= 0
            out[d] = np.bincount(links[ok], weights=size[ok], minlength=num_links)
        return out


@dataclass(kw_only=True, slots=True)
class ProgramBuilder:
    """Collects phases and flows; `build` freezes them into a `LinkProgram`."""

    fabric: Fabric
    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    directions: list[int] = field(default_factory=list)
    deps: list[tuple[int, ...]] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    _parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool, np.ndarray]] = field(
        default_factory=list
    )

    def phase(
        self,
        name: str,
        kind: str,
        direction: int,
        depends_on: tuple[int, ...] = (),
        latency_s: float = 0.0,
    ) -> int:
        self.names.append(name)
        self.kinds.append(kind)
        self.directions.append(direction)
        self.deps.append(tuple(depends_on))
        self.latency.append(float(latency_s))
        return len(self.names) - 1

    def _add(
        self,
        phase: int,
        links_FH: np.ndarray,
        size_F: np.ndarray,
        sender_F: np.ndarray,
        nvlink: bool,
        ends_F2: np.ndarray,
    ) -> None:
        keep = size_F > 0
        if keep.any():
            self._parts.append(
                (
                    np.full(int(keep.sum()), phase, dtype=np.int64),
                    links_FH[keep],
                    size_F[keep].astype(np.float64),
                    sender_F[keep].astype(np.int64),
                    nvlink,
                    ends_F2[keep].astype(np.int64),
                )
            )

    def nvlink(
        self, phase: int, src_rank_F: np.ndarray, dst_rank_F: np.ndarray, bytes_F: np.ndarray
    ) -> None:
        """GPU -> GPU transfers inside a node (same node required; src == dst moves nothing)."""
        g = self.fabric.topology.gpus_per_node
        src, dst = np.asarray(src_rank_F, dtype=np.int64), np.asarray(dst_rank_F, dtype=np.int64)
        assert np.all(src // g == dst // g), "NVLink transfers stay inside a node"
        off = src != dst
        src, dst, size = src[off], dst[off], np.asarray(bytes_F, dtype=np.float64)[off]
        links = self.fabric.nvlink_links_FH(src // g, src % g, dst % g)
        self._add(phase, links, size, src, True, np.stack([src, dst], axis=1))

    def rail(
        self,
        phase: int,
        src_rank_F: np.ndarray,
        dst_rank_F: np.ndarray,
        bytes_F: np.ndarray,
        *,
        via_gpu_F: np.ndarray | None = None,
    ) -> None:
        """Transfers between nodes on the rail of GPU ``via`` (default the source GPU, which must
        then share the destination GPU's rail). With ``via`` != the source GPU the flow first
        crosses NVLink to GPU (s, via) (PXN) and the rail of ``via``, streamed (one flow)."""
        g = self.fabric.topology.gpus_per_node
        src, dst = np.asarray(src_rank_F, dtype=np.int64), np.asarray(dst_rank_F, dtype=np.int64)
        size = np.asarray(bytes_F, dtype=np.float64)
        via = src % g if via_gpu_F is None else np.asarray(via_gpu_F, dtype=np.int64)
        s, d = src // g, dst // g
        assert np.all(s != d), "rail transfers cross nodes"
        links = self.fabric.rail_links_FH(s, d, via)
        hop = via != src % g
        if hop.any():
            nvl = np.full((links.shape[0], 2), -1, dtype=np.int64)
            nvl[hop] = self.fabric.nvlink_links_FH(s[hop], (src % g)[hop], via[hop])
            links = np.concatenate([links, nvl], axis=1)
        self._add(phase, links, size, s * g + via, False, np.stack([src, dst], axis=1))

    def build(self) -> LinkProgram:
        if self._parts:
            width = max(p[1].shape[1] for p in self._parts)
            pad = [
                np.pad(p[1], ((0, 0), (0, width - p[1].shape[1])), constant_values=-1)
                for p in self._parts
            ]
            flows = FlowSet(
                size_bytes_F=np.concatenate([p[2] for p in self._parts]),
                links_FH=np.concatenate(pad),
                phase_F=np.concatenate([p[0] for p in self._parts]),
                sender_F=np.concatenate([p[3] for p in self._parts]),
            )
            nvlink_F = np.concatenate([np.full(p[0].size, p[4]) for p in self._parts])
            ends = np.concatenate([p[5] for p in self._parts])
        else:
            flows = FlowSet(
                size_bytes_F=np.zeros(0),
                links_FH=np.zeros((0, 1), dtype=np.int64),
                phase_F=np.zeros(0, dtype=np.int64),
                sender_F=np.zeros(0, dtype=np.int64),
            )
            nvlink_F = np.zeros(0, dtype=bool)
            ends = np.zeros((0, 2), dtype=np.int64)
        return LinkProgram(
            names=tuple(self.names),
            kinds=tuple(self.kinds),
            direction_Q=np.asarray(self.directions, dtype=np.int64),
            depends_on=tuple(self.deps),
            latency_s_Q=np.asarray(self.latency, dtype=np.float64),
            flows=flows,
            nvlink_F=nvlink_F,
            ends_F2=ends,
        )


def rank_synced(
    program: LinkProgram,
    *,
    num_ranks: int,
    post_order: Sequence[int] = (),
    global_phases: Sequence[int] = (),
) -> LinkProgram:
    """``program`` with per-rank phase dependencies (module docstring, "Phase synchronisation").

    Each phase q of ``program`` (not in ``global_phases``) becomes, for every rank r of W:
      * post[q, r] (flowless): after done[p, r] for every p in q's ``depends_on``, and after
        post[q', r] where q' precedes q in ``post_order`` (a rank program posts its phases in
        order, waiting for the dependencies of each before posting it);
      * start[q, r] (flowless, q's latency; the same part as post[q, r] when q has none);
      * pair[q, s, d] for every (src s, dst d) with flows in q: those flows, after start[q, s]
        and start[q, d] (the receiver gates a transfer as much as the sender: both post it);
      * done[q, r]: the join of r's pairs in q (start[q, r] itself when r has none).
    A phase in ``global_phases`` (a collective) stays one flowless phase after done[p, r] of
    every rank. With every rank's parts ready at the same time this is the global program
    again; the cost is about (3 W + pairs) phases per phase and an engine event per distinct
    start time.

    Args:
        num_ranks: W; ``program.ends_F2`` must be in [0, W).
        post_order: phases in the order every rank posts them (empty: no program order).
        global_phases: flowless phases that wait for every rank (e.g. a count all-to-all).

    Returns:
        A `LinkProgram` with ``source = program`` and ``origin_Q`` set.
    """
    q0_count, w = program.num_phases, int(num_ranks)
    ends = program.ends_F2
    if w < 1 or (ends.size and (ends.min() < 0 or ends.max() >= w)):
        raise ValueError(
            f"rank_synced: num_ranks={num_ranks} does not cover the flows' ranks "
            f"{int(ends.min(initial=0))}..{int(ends.max(initial=-1))}"
        )
    phase_F = program.flows.phase_F
    glob = set(int(q) for q in global_phases)
    carrying = sorted(glob & set(np.unique(phase_F).tolist()))
    if carrying:
        raise ValueError(
            f"rank_synced: global phases {[program.names[q] for q in carrying]} carry flows; "
            "only flowless phases (a collective's fixed cost) can stay global"
        )
    prev_of = {int(b): int(a) for a, b in zip(post_order[:-1], post_order[1:])}
    names: list[str] = []
    kinds: list[str] = []
    dirs: list[int] = []
    origin: list[int] = []

    def new(q: int, name: str, kind: str) -> int:
        names.append(name)
        kinds.append(kind)
        dirs.append(int(program.direction_Q[q]))
        origin.append(q)
        return len(names) - 1

    # Pass 1: every part gets its id (dependencies may point at any phase, earlier or later).
    post_QW = np.full((q0_count, w), -1, dtype=np.int64)
    start_QW = np.full((q0_count, w), -1, dtype=np.int64)
    done_QW = np.full((q0_count, w), -1, dtype=np.int64)
    pairs: list[tuple[int, int, int, int]] = []  # (id, q, src, dst)
    touching: dict[tuple[int, int], list[int]] = {}  # (q, rank) -> its pair parts
    order_F = np.argsort(phase_F, kind="stable")
    ptr = np.searchsorted(phase_F[order_F], np.arange(q0_count + 1))
    key_F = ends[:, 0] * w + ends[:, 1]
    new_phase_F = np.empty_like(phase_F)
    for q in range(q0_count):
        name = program.names[q]
        if q in glob:
            post_QW[q] = start_QW[q] = done_QW[q] = new(q, name, program.kinds[q])
            continue
        for r in range(w):
            post_QW[q, r] = new(q, f"{name}.post@{r}", "sync")
            start_QW[q, r] = (
                new(q, f"{name}@{r}", "sync") if program.latency_s_Q[q] > 0 else post_QW[q, r]
            )
        flows = order_F[ptr[q] : ptr[q + 1]]
        keys, inv = np.unique(key_F[flows], return_inverse=True)
        ids = np.empty(keys.size, dtype=np.int64)
        for k, key in enumerate(keys.tolist()):
            src, dst = divmod(key, w)
            ids[k] = new(q, f"{name}[{src}->{dst}]", program.kinds[q])
            pairs.append((int(ids[k]), q, src, dst))
            touching.setdefault((q, src), []).append(int(ids[k]))
            touching.setdefault((q, dst), []).append(int(ids[k]))
        new_phase_F[flows] = ids[inv]
        for r in range(w):
            done_QW[q, r] = (
                new(q, f"{name}.done@{r}", "sync") if (q, r) in touching else start_QW[q, r]
            )
    # Pass 2: dependencies and latencies.
    deps: list[tuple[int, ...]] = [()] * len(names)
    lat = np.zeros(len(names))
    for q in range(q0_count):
        src_deps = program.depends_on[q]
        if q in glob:
            deps[post_QW[q, 0]] = tuple(
                dict.fromkeys(int(done_QW[p, r]) for p in src_deps for r in range(w))
            )
            lat[post_QW[q, 0]] = program.latency_s_Q[q]
            continue
        for r in range(w):
            chain = (int(post_QW[prev_of[q], r]),) if q in prev_of else ()
            deps[post_QW[q, r]] = tuple(
                dict.fromkeys([int(done_QW[p, r]) for p in src_deps] + list(chain))
            )
            if start_QW[q, r] != post_QW[q, r]:
                deps[start_QW[q, r]] = (int(post_QW[q, r]),)
            lat[start_QW[q, r]] = program.latency_s_Q[q]
            if (q, r) in touching:
                deps[done_QW[q, r]] = tuple(touching[(q, r)])
    for pid, q, src, dst in pairs:
        deps[pid] = tuple(dict.fromkeys((int(start_QW[q, src]), int(start_QW[q, dst]))))
    flows = program.flows
    split = FlowSet(
        size_bytes_F=flows.size_bytes_F,
        links_FH=flows.links_FH,
        phase_F=new_phase_F,
        sender_F=flows.sender_F,
    )
    return LinkProgram(
        names=tuple(names),
        kinds=tuple(kinds),
        direction_Q=np.asarray(dirs, dtype=np.int64),
        depends_on=tuple(deps),
        latency_s_Q=lat,
        flows=split,
        nvlink_F=program.nvlink_F,
        ends_F2=ends,
        source=program,
        origin_Q=np.asarray(origin, dtype=np.int64),
        num_ranks=w,
    )


def phase_times(program: LinkProgram, result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """([Q0] start s, [Q0] finish s) of the phases of the global program (``program.source`` for a
    rank-synced one, else ``program`` itself). Rank-synced: a phase starts at its earliest
    rank's readiness plus its latency and finishes with its last part."""
    start, finish = result.phase_start_s_Q, result.phase_finish_s_Q
    if program.source is None:
        return start, finish
    q0_count = program.source.num_phases
    ready_Q0 = np.full(q0_count, np.inf)
    np.minimum.at(ready_Q0, program.origin_Q, start - program.latency_s_Q)
    finish_Q0 = np.full(q0_count, -np.inf)
    np.maximum.at(finish_Q0, program.origin_Q, finish)
    return ready_Q0 + program.source.latency_s_Q, finish_Q0


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgramRun:
    """Result of `run_program`."""

    result: SimResult
    dispatch_s: float
    """End of the last dispatch phase (from t = 0, the layer's first call)."""
    combine_s: float
    """End of the last combine phase minus the end of dispatch."""
    bound_dispatch_s: float
    """``dispatch_s`` is never below it (`bandwidth_bound`)."""
    bound_combine_s: float
    """``combine_s`` is never below it (`bandwidth_bound`; rank-synced: `rank_bandwidth_bound`)."""
    bound_s: float
    """``total_s`` is never below it: the sum of the two (global), `rank_bandwidth_bound`'s
    (rank-synced)."""
    bound_link: int
    """The link that sets the larger of the two direction bounds."""
    num_flows: int

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.combine_s


def bandwidth_bound(fabric: Fabric, program: LinkProgram) -> tuple[float, float, int]:
    """(dispatch bound s, combine bound s, busiest link): max over links of bytes / capacity."""
    per_link = program.link_bytes_DL(fabric.num_links) / fabric.network.capacity_Bps_L
    busiest = int(np.unravel_index(np.argmax(per_link), per_link.shape)[1]) if per_link.size else -1
    return float(per_link[0].max(initial=0.0)), float(per_link[1].max(initial=0.0)), busiest


def rank_bandwidth_bound(fabric: Fabric, program: LinkProgram) -> tuple[float, float]:
    """(combine bound s, total bound s) of a rank-synced program, where one rank's combine may run
    while another's dispatch does, so the busiest links' sum does not bound the total.

    With D_r (C_r) = max over links of the bytes of the dispatch (combine) flows that rank r
    posts / capacity: none of r's combine flows starts before r's dispatch flows are done, so
    total >= D_r + C_r for every r; the rank whose dispatch part ends last starts its combine at
    the end of dispatch, so combine >= min_r C_r; every link carries both directions' bytes, so
    total >= max over links of (dispatch + combine bytes) / capacity; and total >= dispatch
    bound + min_r C_r.
    """
    w, num_links = program.num_ranks, fabric.num_links
    cap_L = fabric.network.capacity_Bps_L
    flows = program.flows
    direction_F = program.direction_Q[flows.phase_F]
    keep = direction_F >= 0
    per = np.zeros((2, w, num_links))
    for end in range(2):
        rank = program.ends_F2[keep, end]
        for hop in flows.links_FH[keep].T:
            ok = hop >= 0
            key = (direction_F[keep][ok] * w + rank[ok]) * num_links + hop[ok]
            per += np.bincount(
                key, weights=flows.size_bytes_F[keep][ok], minlength=2 * w * num_links
            ).reshape(per.shape)
    per_rank = (per / cap_L).max(axis=2, initial=0.0)  # [2, W]
    bound_dispatch, _, _ = bandwidth_bound(fabric, program)
    combine = float(per_rank[1].min()) if w else 0.0
    both_links = float((program.link_bytes_DL(num_links).sum(axis=0) / cap_L).max(initial=0.0))
    total = max(
        float((per_rank[0] + per_rank[1]).max(initial=0.0)), both_links, bound_dispatch + combine
    )
    return combine, total


def _aggregate_ports(program: LinkProgram) -> FlowSet:
    """NVLink flows replaced by one flow per (phase, port): the port's bytes (cheap mode)."""
    flows, nvl = program.flows, program.nvlink_F
    links = flows.links_FH[nvl]
    size = np.repeat(flows.size_bytes_F[nvl], links.shape[1])
    phase = np.repeat(flows.phase_F[nvl], links.shape[1])
    link = links.ravel()
    ok = link >= 0
    key, inv = np.unique(phase[ok] * (int(link.max(initial=0)) + 1) + link[ok], return_inverse=True)
    agg = np.bincount(inv, weights=size[ok])
    radix = int(link.max(initial=0)) + 1
    width = flows.links_FH.shape[1]
    port_links = np.full((key.size, width), -1, dtype=np.int64)
    port_links[:, 0] = key % radix
    return FlowSet(
        size_bytes_F=np.concatenate([flows.size_bytes_F[~nvl], agg]),
        links_FH=np.concatenate([flows.links_FH[~nvl], port_links]),
        phase_F=np.concatenate([flows.phase_F[~nvl], key // radix]),
        sender_F=np.concatenate([flows.sender_F[~nvl], np.zeros(key.size, dtype=np.int64)]),
    )


def run_program(
    fabric: Fabric,
    program: LinkProgram,
    *,
    incast: IncastModel,
    rel_tol: float,
    nvlink: str = "maxmin",
) -> ProgramRun:
    """Simulate ``program`` on ``fabric`` (one engine run; overlapping phases share ports).

    Args:
        nvlink: 'maxmin' simulates every NVLink flow; 'ports' merges a phase's NVLink flows into
            one flow per port (each GPU's out and in port apart; cheaper at large N, and never
            slower than 'maxmin', never faster than the bound).
    """
    flows = program.flows if nvlink == "maxmin" else _aggregate_ports(program)
    res = simulate(fabric.network, flows, program.phases(), incast=incast, rel_tol=rel_tol)
    finish = res.phase_finish_s_Q
    dispatch_end = float(finish[program.direction_Q == 0].max(initial=0.0))
    end = float(finish.max(initial=0.0))
    bd, bc, link = bandwidth_bound(fabric, program)
    bound = bd + bc
    if program.source is not None:
        bc, bound = rank_bandwidth_bound(fabric, program)
    return ProgramRun(
        result=res,
        dispatch_s=dispatch_end,
        combine_s=end - dispatch_end,
        bound_dispatch_s=bd,
        bound_combine_s=bc,
        bound_s=bound,
        bound_link=link,
        num_flows=program.flows.num_flows,
    )
