"""A link program: phases with start conditions and the bytes each phase moves over which links.

Shape letters: N nodes (s source, d destination), G GPUs per node, L links, F flows, H hops,
Q phases.

Every modelled exchange (a compiled `schedule.ExecutionSchedule`, or a peer in `peers`) becomes
one `LinkProgram` and is simulated in ONE run of the max-min engine (`maxmin.simulate`): phases
that overlap in time share every port they both cross (NVLink ports of a GPU, NIC ports,
adapters, leaf uplinks). Nothing is simulated apart and added up, so no phase can go faster
than its ports allow while another phase uses them.

`bandwidth_bound_s` is the program's bandwidth lower bound: per direction (dispatch, combine),
the busiest link's bytes over its capacity (NVLink ports and rails alike), summed over the two
directions (combine starts after dispatch). No fixed cost, no incast: the modelled time can never
be below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cluster import Fabric
from .incast import IncastModel
from .maxmin import simulate
from .problem import FlowSet, PhaseGraph, SimResult

__all__ = ["LinkProgram", "ProgramBuilder", "ProgramRun", "bandwidth_bound", "run_program"]

DIRECTIONS = ("dispatch", "combine")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProgram:
    """Phases and flows of one dispatch + combine (global, identical for every caller).

    Attributes:
        names: [Q] phase names ('dispatch.rail[0]', 'counts', ...).
        kinds: [Q] 'relay', 'rail', 'deliver', 'alltoall', 'sync' (flowless: a fixed cost or a join).
        direction_Q: [Q] int64, 0 dispatch, 1 combine, -1 neither (start, expert compute).
        depends_on: per phase, the phases that must be complete before it starts.
        latency_s_Q: [Q] float64, fixed cost paid between its dependencies and its flows.
        flows: the flows (bytes over links, phase, sender for the incast count).
        nvlink_F: [F] bool, flows that cross only NVLink ports.
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    direction_Q: np.ndarray
    depends_on: tuple[tuple[int, ...], ...]
    latency_s_Q: np.ndarray
    flows: FlowSet
    nvlink_F: np.ndarray

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
    _parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]] = field(default_factory=list)

    def phase(self, name: str, kind: str, direction: int, depends_on: tuple[int, ...] = (),
              latency_s: float = 0.0) -> int:
        self.names.append(name)
        self.kinds.append(kind)
        self.directions.append(direction)
        self.deps.append(tuple(depends_on))
        self.latency.append(float(latency_s))
        return len(self.names) - 1

    def _add(self, phase: int, links_FH: np.ndarray, size_F: np.ndarray, sender_F: np.ndarray, nvlink: bool) -> None:
        keep = size_F > 0
        if keep.any():
            self._parts.append((np.full(int(keep.sum()), phase, dtype=np.int64), links_FH[keep],
                                size_F[keep].astype(np.float64), sender_F[keep].astype(np.int64), nvlink))

    def nvlink(self, phase: int, src_rank_F: np.ndarray, dst_rank_F: np.ndarray, bytes_F: np.ndarray) -> None:
        """GPU -> GPU transfers inside a node (same node required; src == dst moves nothing)."""
        g = self.fabric.topology.gpus_per_node
        src, dst = np.asarray(src_rank_F, dtype=np.int64), np.asarray(dst_rank_F, dtype=np.int64)
        assert np.all(src // g == dst // g), "NVLink transfers stay inside a node"
        off = src != dst
        src, dst, size = src[off], dst[off], np.asarray(bytes_F, dtype=np.float64)[off]
        links = self.fabric.nvlink_links_FH(src // g, src % g, dst % g)
        self._add(phase, links, size, src, True)

    def rail(self, phase: int, src_rank_F: np.ndarray, dst_rank_F: np.ndarray, bytes_F: np.ndarray,
             *, via_gpu_F: np.ndarray | None = None) -> None:
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
        self._add(phase, links, size, s * g + via, False)

    def build(self) -> LinkProgram:
        if self._parts:
            width = max(p[1].shape[1] for p in self._parts)
            pad = [np.pad(p[1], ((0, 0), (0, width - p[1].shape[1])), constant_values=-1) for p in self._parts]
            flows = FlowSet(size_bytes_F=np.concatenate([p[2] for p in self._parts]), links_FH=np.concatenate(pad),
                            phase_F=np.concatenate([p[0] for p in self._parts]),
                            sender_F=np.concatenate([p[3] for p in self._parts]))
            nvlink_F = np.concatenate([np.full(p[0].size, p[4]) for p in self._parts])
        else:
            flows = FlowSet(size_bytes_F=np.zeros(0), links_FH=np.zeros((0, 1), dtype=np.int64),
                            phase_F=np.zeros(0, dtype=np.int64), sender_F=np.zeros(0, dtype=np.int64))
            nvlink_F = np.zeros(0, dtype=bool)
        return LinkProgram(names=tuple(self.names), kinds=tuple(self.kinds),
                           direction_Q=np.asarray(self.directions, dtype=np.int64), depends_on=tuple(self.deps),
                           latency_s_Q=np.asarray(self.latency, dtype=np.float64), flows=flows, nvlink_F=nvlink_F)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgramRun:
    """Result of `run_program`."""

    result: SimResult
    dispatch_s: float
    """End of the last dispatch phase (from t = 0, the layer's first call)."""
    combine_s: float
    """End of the last combine phase minus the end of dispatch."""
    bound_dispatch_s: float
    bound_combine_s: float
    bound_link: int
    """The link that sets the larger of the two bounds."""
    num_flows: int

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.combine_s

    @property
    def bound_s(self) -> float:
        return self.bound_dispatch_s + self.bound_combine_s


def bandwidth_bound(fabric: Fabric, program: LinkProgram) -> tuple[float, float, int]:
    """(dispatch bound s, combine bound s, busiest link): max over links of bytes / capacity."""
    per_link = program.link_bytes_DL(fabric.num_links) / fabric.network.capacity_Bps_L
    busiest = int(np.unravel_index(np.argmax(per_link), per_link.shape)[1]) if per_link.size else -1
    return float(per_link[0].max(initial=0.0)), float(per_link[1].max(initial=0.0)), busiest


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
    return FlowSet(size_bytes_F=np.concatenate([flows.size_bytes_F[~nvl], agg]),
                   links_FH=np.concatenate([flows.links_FH[~nvl], port_links]),
                   phase_F=np.concatenate([flows.phase_F[~nvl], key // radix]),
                   sender_F=np.concatenate([flows.sender_F[~nvl], np.zeros(key.size, dtype=np.int64)]))


def run_program(fabric: Fabric, program: LinkProgram, *, incast: IncastModel, rel_tol: float,
                nvlink: str = "maxmin") -> ProgramRun:
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
    return ProgramRun(result=res, dispatch_s=dispatch_end, combine_s=end - dispatch_end, bound_dispatch_s=bd,
                      bound_combine_s=bc, bound_link=link, num_flows=program.flows.num_flows)
