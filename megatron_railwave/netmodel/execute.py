"""Execute a `PathPlan` on the flow model: its stages and waves become flows and phases.

Shape letters: N nodes (s source, d destination), G GPUs per node (g owner, l egress /
arrival, j target), R rails, A adapters, V waves (or sending windows), V' = max(V, 1) delivery
rounds, Q phases, F flows.

One record crosses every stage as ``record_bytes + metadata_bytes`` bytes (payload row plus
`NetModelConfig.metadata_bytes`), in dispatch and in combine alike. Dispatch, exactly as
`exchange.moves` runs it:

    relay       owner GPU (s, g) -> proxy (s, l) over NVLink, every remote pair at once
    rail[v]     wave v: GPU (s, l) -> GPU (d, l) for the wave's pairs (starts after relay / rail[v-1])
    deliv[v]    GPU (d, l) -> GPU (d, j) over NVLink, copies of delivery_copies_NGG of wave v's
                sources (round 0 also carries the local records); after rail[v] and deliv[v-1],
                so it overlaps rail[v+1]

and combine is the same path backwards with the same bytes: rdeliv[v] (after rdeliv[v-1] and
rrail[v-2]), rrail[v] (after rdeliv[v] and rrail[v-1]), rrelay (after the last rrail); combine
starts when dispatch is complete (expert compute is not modelled). NATIVE / RAIL with one window
have V = 1; with a replay's windows V = number of windows, run like waves.

Every rail phase pays `NetModelConfig.wave_latency_s` before its flows start (launch, notify,
barrier of one exchange call). Receiver ports (NIC downlinks) lose goodput with concurrent
senders (`incast.IncastModel`: ``C / (1 + alpha * max(0, k - k_free))``).

NVLink phases never overlap each other (each waits for the previous one) and share no link with
rail phases, so their rates are independent of everything else: each is simulated on its own and
enters the rail simulation as a flowless phase whose latency is its duration (exact, and much
cheaper at large N). Combine's NVLink phases move the same bytes backwards over symmetric links,
so they take as long as dispatch's.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path as FsPath
from typing import Any, Literal, Protocol

import numpy as np
import torch
import yaml

from ..planner import PathPlan, delivery_copies_NGG
from ..topology import RailTopology
from .cluster import Fabric, build_fabric
from .incast import IncastModel
from .maxmin import simulate
from .problem import FlowSet, PhaseGraph

__all__ = ["MaskSource", "NetModelConfig", "PlanTiming", "execute_plan", "load_netmodel_config", "simulate_plan"]


class MaskSource(Protocol):
    """Anything with the mask histograms of the records into one node (e.g. `DemandCounts`)."""

    def masks_into(self, node: int) -> torch.Tensor:
        """[W, M] int64: records every rank sends to ``node``, by target mask."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class NetModelConfig:
    """Parameters of the network model. Defaults: the calibration of docs/netmodel.md (H800 4x8)."""

    alpha: float = 0.1273
    """Incast: fractional goodput loss of a receiver port per concurrent sender beyond ``k_free``."""
    k_free: int = 1
    """Incast: concurrent senders a receiver port absorbs without loss."""
    wave_latency_s: float = 30e-6
    """Fixed cost of one rail phase (one wave or window, dispatch or combine): kernel launch,
    count notify and barrier. Stated, not fitted (docs/netmodel.md)."""
    metadata_bytes: int = 64
    """Bytes that travel with every record besides the payload row (top-8 expert ids as int32
    and weights as fp32)."""
    nodes_per_leaf: int = 32
    """Nodes under one rail leaf switch; more nodes go through spines. 0 = one leaf per rail."""
    spine_oversubscription: float = 1.0
    """Leaf downlink / uplink capacity (1 = non-blocking)."""
    nvlink: Literal["maxmin", "bound"] = "maxmin"
    """NVLink stages: 'maxmin' simulates their flows; 'bound' takes the crossbar bound (busiest
    NVLink port's bytes / capacity), a lower bound of 'maxmin' that is much cheaper at large N."""
    delivery_fanout: float = 3.3
    """Without mask histograms (``demand=None``): target GPUs per record, spread evenly over the
    destination node's GPUs (the synthetic GLM-4.5-Air routing on 4 x 8 averages 3.3, 2.0-4.9
    over layers)."""
    delivery: Literal["after_rail", "pipelined"] = "after_rail"
    """Stage 3 of wave v: 'after_rail' starts it when rail[v] is complete (store and forward, as
    `exchange.moves` runs it; it overlaps rail[v+1]); 'pipelined' runs it during rail[v] (a GPU
    kernel that forwards records as they arrive) and starts wave v+1 when both are done."""
    rel_tol: float = 1e-3
    """Event batching tolerance of the engine (`maxmin.simulate`) for the rail phases."""
    large_rel_tol: float = 1e-2
    """Tolerance used instead when a layer has more than ``large_flows`` rail flows (all-at-once
    NATIVE/RAIL on hundreds of nodes): measured error <= 0.9% per flow and 0.04% on the makespan
    (netmodel/maxmin.py), at about a sixth of the cost."""
    large_flows: int = 100_000
    """Flow count above which ``large_rel_tol`` applies."""
    nvlink_rel_tol: float = 1e-2
    """The same for the NVLink phases (many flows of distinct sizes; 1e-2 keeps their durations
    within about 2% of the exact ones at a third of the cost)."""

    def __post_init__(self) -> None:
        IncastModel(alpha=self.alpha, k_free=self.k_free)  # validates both
        for name in ("wave_latency_s", "delivery_fanout"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"NetModelConfig.{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.metadata_bytes, bool) or not isinstance(self.metadata_bytes, int) or self.metadata_bytes < 0:
            raise ValueError(f"NetModelConfig.metadata_bytes must be an int >= 0, got {self.metadata_bytes!r}")
        if self.delivery not in ("after_rail", "pipelined"):
            raise ValueError(f"NetModelConfig.delivery must be 'after_rail' or 'pipelined', got {self.delivery!r}")
        if self.nvlink not in ("maxmin", "bound"):
            raise ValueError(f"NetModelConfig.nvlink must be 'maxmin' or 'bound', got {self.nvlink!r}")
        for name in ("rel_tol", "nvlink_rel_tol", "large_rel_tol"):
            if not 0.0 <= getattr(self, name) <= 0.1:
                raise ValueError(f"NetModelConfig.{name} must be in [0, 0.1], got {getattr(self, name)!r}")
        build_fabric(RailTopology(num_nodes=1, gpus_per_node=1), nodes_per_leaf=self.nodes_per_leaf,
                     spine_oversubscription=self.spine_oversubscription)  # validates the fabric knobs

    def incast(self) -> IncastModel:
        """The receiver-port model (per-phase latency is applied to rail phases only, not here)."""
        return IncastModel(alpha=self.alpha, k_free=self.k_free)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "netmodel config") -> NetModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; allowed keys are {sorted(known)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def load_netmodel_config(path: str | FsPath) -> NetModelConfig:
    """A `NetModelConfig` from YAML (``configs/netmodel/*.yaml``; its ``model:`` mapping)."""
    path = FsPath(path)
    if not path.is_file():
        raise ValueError(f"netmodel config {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and "model" in data:
        data = data["model"]
    if not isinstance(data, dict):
        raise ValueError(f"netmodel config {str(path)!r}: expected a mapping under 'model', got {type(data).__name__}")
    return NetModelConfig.from_dict(data, source=f"netmodel config {str(path)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanTiming:
    """Modelled times of one dispatch + combine of a plan (seconds) and where the bytes go."""

    dispatch_s: float
    """From the start to the end of dispatch's last delivery."""
    combine_s: float
    """From the end of dispatch to the end of combine's relay."""
    relay_s: float
    """Stage 1 of dispatch (owner -> proxy)."""
    rail_s_V: tuple[float, ...]
    """Per wave: duration of dispatch's rail phase, fixed wave cost included."""
    delivery_s_V: tuple[float, ...]
    """Per round: duration of dispatch's delivery phase (runs during the next rail phase)."""
    nic_egress_bytes_NR: np.ndarray
    """[N, R] float64, stage-2 bytes each NIC port sends in dispatch (combine sends the mirror)."""
    nic_ingress_bytes_NR: np.ndarray
    """[N, R] float64, stage-2 bytes each NIC port receives in dispatch."""
    adapter_egress_bytes_NA: np.ndarray
    """[N, A] float64, egress bytes per physical adapter (= per port when one port per adapter)."""
    num_flows: int
    num_events: int
    wall_s: float
    """Wall time of the model itself."""

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.combine_s

    def nic_shares(self) -> np.ndarray:
        """[A] mean over nodes of each node's adapter egress shares, sorted descending per node."""
        per_node = self.adapter_egress_bytes_NA
        total = per_node.sum(axis=1, keepdims=True)
        shares = np.divide(per_node, total, out=np.zeros_like(per_node), where=total > 0)
        sent = total[:, 0] > 0
        if not sent.any():
            return np.zeros(per_node.shape[1])
        return -np.sort(-shares[sent], axis=1).mean(axis=0)

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_s": self.dispatch_s, "combine_s": self.combine_s, "total_s": self.total_s,
                "relay_s": self.relay_s, "rail_s_V": list(self.rail_s_V), "delivery_s_V": list(self.delivery_s_V),
                "nic_shares": self.nic_shares().tolist(), "num_flows": self.num_flows,
                "num_events": self.num_events, "wall_s": self.wall_s}


@functools.lru_cache(maxsize=16)
def _fabric(topo: RailTopology, nodes_per_leaf: int, oversub: float) -> Fabric:
    return build_fabric(topo, nodes_per_leaf=nodes_per_leaf, spine_oversubscription=oversub)


def _delivery_VNGG(plan: PathPlan, demand: MaskSource | None, fanout: float) -> np.ndarray:
    """[V', N, G, G] float64 copies moved GPU (d, l) -> GPU (d, j) in each round (diagonal kept)."""
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    rounds = plan.num_waves + 1
    round_NN = plan.pair_wave_NN + 1  # wave v is delivered in round v + 1
    round_NN.fill_diagonal_(0)  # round 0: the local node's records (no rail)
    out = torch.zeros(rounds, n, g, g, dtype=torch.float64)
    if demand is None:
        # arrivals[s, d, l]: remote records arrive on GPU l (its quota); local ones at the owner.
        arrivals = plan.quota_NNG.to(torch.float64).clone()
        idx = torch.arange(n)
        arrivals[idx, idx] = plan.records_NNG[idx, idx].to(torch.float64)
        per_target = arrivals * (fanout / g)  # [s, d, l], same for every j
        for d in range(n):
            out[:, d].index_add_(0, round_NN[:, d], per_target[:, d].unsqueeze(-1).expand(n, g, g))
        return out.numpy()
    for d in range(n):
        copies = delivery_copies_NGG(plan, demand, d).to(torch.float64)  # [s, l, j]
        out[:, d].index_add_(0, round_NN[:, d], copies)
    return out.numpy()


def _nvlink_durations(fabric: Fabric, bytes_PNGG: np.ndarray, model: NetModelConfig) -> tuple[np.ndarray, int]:
    """[P] duration of each NVLink phase run alone (bytes [P, N, G_src, G_dst]; diagonal ignored)."""
    num_phases, n, g, _ = bytes_PNGG.shape
    off = bytes_PNGG * (1.0 - np.eye(g))
    if model.nvlink == "bound":
        port = np.maximum(off.sum(axis=3), off.sum(axis=2)).reshape(num_phases, -1)
        return port.max(axis=1, initial=0.0) / fabric.topology.nvlink_bytes_per_s, 0
    phase, node, src, dst = np.nonzero(off)
    if phase.size == 0:
        return np.zeros(num_phases), 0
    flows = FlowSet(size_bytes_F=off[phase, node, src, dst], links_FH=fabric.nvlink_links_FH(node, src, dst),
                    phase_F=phase)
    res = simulate(fabric.network, flows, PhaseGraph.chain(num_phases), rel_tol=model.nvlink_rel_tol)
    return res.phase_finish_s_Q - res.phase_start_s_Q, res.num_events


def execute_plan(plan: PathPlan, *, record_bytes: int, model: NetModelConfig | None = None,
                 demand: MaskSource | None = None) -> PlanTiming:
    """Model one dispatch + combine of ``plan`` (deterministic).

    Args:
        plan: the path plan (stages, waves or windows).
        record_bytes: payload bytes of one record (hidden size x element size).
        model: parameters; default `NetModelConfig()` (the H800 calibration).
        demand: mask histograms of the records (`DemandCounts` of the plan's demand) for exact
            stage-3 copies; None = `NetModelConfig.delivery_fanout` copies per record, even
            over the destination GPUs.

    Returns:
        `PlanTiming`. Host sync: no (CPU only).
    """
    t0 = time.perf_counter()
    model = model or NetModelConfig()
    if record_bytes < 0:
        raise ValueError(f"record_bytes must be >= 0, got {record_bytes}")
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    fabric = _fabric(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    row = float(record_bytes + model.metadata_bytes)
    num_waves = plan.num_waves
    rounds = num_waves + 1  # round 0: local records; round v + 1: rail wave v

    # NVLink phases: relay, then one delivery per round (combine mirrors them).
    remote = ~torch.eye(n, dtype=torch.bool)
    relay_NGG = (plan.relay_NNGG * remote.view(n, n, 1, 1)).sum(dim=1).to(torch.float64).numpy()
    nvl_bytes = np.concatenate([relay_NGG[None], _delivery_VNGG(plan, demand, model.delivery_fanout)]) * row
    nvl_s, nvl_events = _nvlink_durations(fabric, nvl_bytes, model)
    relay_s, deliv_s = float(nvl_s[0]), nvl_s[1:]

    # Phase ids.
    rail = [1 + v for v in range(num_waves)]
    deliv = [1 + num_waves + r for r in range(rounds)]
    rdeliv = [1 + num_waves + rounds + r for r in range(rounds)]
    rrail = [1 + num_waves + 2 * rounds + v for v in range(num_waves)]
    rrelay = 1 + 2 * num_waves + 2 * rounds
    deps: list[tuple[int, ...]] = [()] * (rrelay + 1)
    latency = np.zeros(rrelay + 1)
    latency[0] = relay_s
    piped = model.delivery == "pipelined" and num_waves > 0
    # As exchange.moves runs them: dispatch posts wave 0 after the relay, delivers the local
    # records (round 0) while it flies, then for each round r >= 1 waits wave r - 1, posts wave r
    # and delivers wave r - 1. Combine returns round r's copies, then waits wave r - 2's return and
    # posts wave r - 1's.
    deps[deliv[0]] = (0,)
    deps[rdeliv[0]] = (deliv[-1], rail[-1]) if num_waves else (deliv[-1],)
    for v in range(num_waves):
        if piped:  # wave v's delivery runs during its rails; wave v+1 waits for both
            deps[rail[v]] = (rail[v - 1], deliv[v]) if v else (0,)
            deps[deliv[v + 1]] = deps[rail[v]]
            deps[rrail[v]] = deps[rdeliv[v + 1]] = (rrail[v - 1], rdeliv[v]) if v else (rdeliv[0],)
        else:
            deps[rail[v]] = (rail[v - 1], deliv[v - 1]) if v else (0,)
            deps[deliv[v + 1]] = (rail[v], deliv[v])
            deps[rrail[v]] = (rdeliv[v + 1],) + ((rrail[v - 1],) if v else ())
            deps[rdeliv[v + 1]] = (rdeliv[v],) + ((rrail[v - 2],) if v >= 2 else ())
        latency[rail[v]] = latency[rrail[v]] = model.wave_latency_s
    for r in range(rounds):
        latency[deliv[r]] = latency[rdeliv[r]] = deliv_s[r]
    deps[rrelay] = (rrail[-1], rdeliv[-1]) if num_waves else (rdeliv[-1],)
    latency[rrelay] = relay_s
    phases = PhaseGraph(depends_on=tuple(deps), latency_s_Q=latency)

    # Rail flows: dispatch GPU (s, l) -> (d, l) in phase rail[wave], combine the reverse.
    quota = (plan.quota_NNG * remote.unsqueeze(-1)).numpy()
    s_F, d_F, l_F = np.nonzero(quota)
    wave_F = plan.pair_wave_NN.numpy()[s_F, d_F]
    size_F = quota[s_F, d_F, l_F].astype(np.float64) * row
    if s_F.size:
        links = np.concatenate([fabric.rail_links_FH(s_F, d_F, l_F), fabric.rail_links_FH(d_F, s_F, l_F)])
        flows = FlowSet(size_bytes_F=np.concatenate([size_F, size_F]), links_FH=links,
                        phase_F=np.concatenate([1 + wave_F, rrail[0] + wave_F]),
                        sender_F=np.concatenate([s_F * g + l_F, d_F * g + l_F]))
    else:  # nothing remote: only the NVLink phases (flowless phases with their latencies)
        flows = FlowSet(size_bytes_F=np.zeros(0), links_FH=np.zeros((0, 1), dtype=np.int64),
                        phase_F=np.zeros(0, dtype=np.int64))
    rel_tol = model.large_rel_tol if flows.num_flows > model.large_flows else model.rel_tol
    res = simulate(fabric.network, flows, phases, incast=model.incast(), rel_tol=rel_tol)
    start, finish = res.phase_start_s_Q, res.phase_finish_s_Q
    dispatch_end = float(max(finish[deliv[-1]], finish[rail[-1]] if num_waves else 0.0))
    rail_s = tuple(float(finish[p] - start[p] + latency[p]) for p in rail)

    rails = torch.tensor(topo.rail_of_gpu, dtype=torch.int64)
    send_NG = torch.from_numpy(quota.sum(axis=1)).to(torch.float64) * row  # [s, l]
    recv_NG = torch.from_numpy(quota.sum(axis=0)).to(torch.float64) * row  # [d, l]
    egress = torch.zeros(n, topo.num_rails, dtype=torch.float64).index_add_(1, rails, send_NG).numpy()
    ingress = torch.zeros(n, topo.num_rails, dtype=torch.float64).index_add_(1, rails, recv_NG).numpy()
    adapters = np.asarray(topo.adapter_of_rail)
    adapter = np.zeros((n, int(adapters.max()) + 1))
    np.add.at(adapter, (slice(None), adapters), egress)
    return PlanTiming(
        dispatch_s=dispatch_end,
        combine_s=float(finish[rrelay]) - dispatch_end,
        relay_s=relay_s,
        rail_s_V=rail_s,
        delivery_s_V=tuple(float(x) for x in deliv_s),
        nic_egress_bytes_NR=egress,
        nic_ingress_bytes_NR=ingress,
        adapter_egress_bytes_NA=adapter,
        num_flows=int(flows.num_flows) + int(np.count_nonzero(nvl_bytes * (1.0 - np.eye(g)))),
        num_events=int(res.num_events) + nvl_events,
        wall_s=time.perf_counter() - t0,
    )


def simulate_plan(plan: PathPlan, *, record_bytes: int, model: NetModelConfig | None = None,
                  demand: MaskSource | None = None) -> float:
    """Seconds of one dispatch + combine of ``plan`` on the flow model (deterministic).

    The function `calibration.NetmodelBackend` calls; see `execute_plan` for the arguments and
    for the stage times.
    """
    return execute_plan(plan, record_bytes=record_bytes, model=model, demand=demand).total_s
