"""Execute a `PathPlan` on the flow model: the `ExecutionSchedule` the exchange runs, on links.

Shape letters: N nodes (s source, d destination), G GPUs per node (g owner, l egress /
arrival, j target), W = N * G ranks, R rails, A adapters, V waves (or sending windows),
V' = V + 1 delivery rounds, Q phases, F flows.

What is simulated is `schedule.compile_schedule(plan, wire, demand=demand)`: its phases, their
``depends_on`` and ``mirror_of``, its transfer table (src rank, dst rank, rows) and the bytes per
row of its `RecordWireFormat` (dispatch rows carry payload, probs and metadata; combine rows the
payload only). Each transfer becomes a flow: node-group phases (relay, deliver) cross the NVLink
out-port of the source GPU and the in-port of the target GPU; rail phases cross NIC up / down
(and adapters, leaf uplinks: `cluster`). All phases of the layer run in one engine simulation
(`program.run_program`), so phases that overlap share ports.

Phases, as the exchange posts them (see `schedule.execution` for the exact graph): a flowless
``counts`` phase (the layer's count all-to-all, `NetModelConfig.count_exchange_s`) precedes
dispatch; dispatch = relay (with RailBalance's barrier and quota steps as a fixed cost),
deliver[0] (the local node's records, overlapping relay and rail[0]), rail[v] (each paying
`wave_latency_s` plus the sync jitter), deliver[v+1] (after rail[v] and deliver[v]); a flowless
``experts`` phase (expert compute is not modelled) separates dispatch from combine, whose
phases are dispatch's transfers backwards.

Variants (`NetModelConfig`):
  * ``delivery='streamed'`` (DeepEP-like): deliver[v+1] forwards chunks over NVLink as they
    arrive, so it starts with rail[v] and completes at max(its own flows, rail[v]); combine
    mirrors it (crail[v] sends partial sums while cdeliver[v+1] returns them). The exchange
    (`exchange.moves`) executes the schedule's depends_on: store and forward ('after_rail').
  * ``phase_sync='rank'``: phases start per rank (`program.rank_synced`): a rank posts its next
    phase once its own parts of the phases it depends on are done, in the schedule's order, and
    a transfer moves once both ends have posted it, as ``exchange.moves`` runs; expert compute is
    per rank, the count exchange stays global. 'global' (default): when the phases it depends on
    are complete on every rank. Bounds in rank mode: `program.rank_bandwidth_bound`.
  Combine's local round cdeliver[0] overlaps its rail waves as dispatch's deliver[0] does:
  the compiled schedule says so (cdeliver[1] does not wait for it) and the exchange runs it so.

Receiver ports (NIC downlinks) lose goodput with concurrent senders (`incast.IncastModel`).
Every result carries the bandwidth lower bound (`program.bandwidth_bound`); the time is never
below it (tests/unit/netmodel/test_bound.py).

Without target-mask histograms (``demand=None``, e.g. a request given only its record counts)
stage 3 is synthetic: `NetModelConfig.delivery_fanout` copies per record, even over the
destination node's GPUs.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from megatron_railwave import presets
from megatron_railwave.lab.netmodel.cluster import Fabric, build_fabric
from megatron_railwave.lab.netmodel.incast import IncastModel
from megatron_railwave.lab.netmodel.program import (
    LinkProgram,
    ProgramBuilder,
    phase_times,
    rank_synced,
    run_program,
)
from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan
from megatron_railwave.schedule import (
    Direction,
    ExecutionSchedule,
    MaskSource,
    PhaseKind,
    RecordWireFormat,
    compile_schedule,
)
from megatron_railwave.topology import RailTopology, read_yaml

__all__ = [
    "MaskSource",
    "NetModelConfig",
    "PlanTiming",
    "execute_plan",
    "execute_schedule",
    "load_netmodel_config",
    "model_wire",
    "schedule_program",
    "simulate_plan",
    "synced_program",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class NetModelConfig:
    """Parameters of the network model. Defaults: docs/netmodel.md (H800 4x8 calibration)."""

    alpha: float = 0.0
    """Incast: fractional goodput loss of a receiver port per concurrent sender beyond ``k_free``.
    0 (the default and the packaged netmodel ``h800_4x8``, ``h20_4x8``): max-min fair sharing, no
    goodput lost, like the published all-pairs numbers on lossless fabrics. The packaged
    ``*_paper_incast`` (4.3165, fitted on the paper's UltraEP case alone,
    `sensitivity.fit_alpha_ultraep`) is the incast what-if (docs/netmodel.md, "Fabric presets")."""
    k_free: int = 1
    """Incast: concurrent senders a receiver port absorbs without loss."""
    k_sat: int | None = 2
    """Incast: the loss stops growing after ``k_sat`` senders beyond ``k_free`` (saturating law,
    `incast.IncastModel`); 2 = flat beyond the 3 senders of the paper's experiment. None =
    linear."""
    wave_latency_s: float = 30e-6
    """Fixed cost of one rail phase (one wave or window, dispatch or combine): kernel launch,
    notify and host wait of one exchange call. Stated: DeepEP's normal-mode notify plus the CPU
    wait on the receive counter; its low-latency kernels take ~77 us for a whole 128-token
    dispatch on EP8 (DeepEP README, H800), an upper bound for a call's fixed part."""
    wave_jitter_s: float = 0.0
    """Sync jitter: each rank's readiness for a rail phase is late by an exponential delay of this
    mean; the phase starts when the slowest of its W ranks is ready, i.e. ``wave_jitter_s * H_W``
    later on average (H_W = 1 + 1/2 + ... + 1/W), paid by every rail phase. 0 = off."""
    count_exchange_s: float = 25e-6
    """The layer's count exchange (one all-to-all of per-node record counts before dispatch):
    latency-bound, a few KiB; stated as one small all-to-all over the EP group."""
    railbalance_barrier_s: float = 5e-6
    """RailBalance (RAIL, JOINT): the node-local barrier after the count step (NVLink)."""
    railbalance_quota_s: float = 5e-6
    """RailBalance (RAIL, JOINT): computing the quota plan and moving notify counts (one kernel)."""
    num_experts: int = 128
    """E, only for the wire format when ``execute_plan`` gets ``record_bytes`` and no ``wire``:
    probs and routing bits of E / N experts travel with each dispatch row (GLM-4.5-Air: 128)."""
    nodes_per_leaf: int = 32
    """Nodes under one rail leaf switch; more nodes go through spines. 0 = one leaf per rail."""
    spine_oversubscription: float = 1.0
    """Leaf downlink / uplink capacity (1 = non-blocking)."""
    nvlink: Literal["maxmin", "ports"] = "maxmin"
    """NVLink flows: 'maxmin' simulates each GPU -> GPU transfer; 'ports' merges a phase's NVLink
    flows into one flow per GPU port (out and in apart): cheaper at large N, ports still shared
    between overlapping phases."""
    delivery_fanout: float = 3.3
    """Without mask histograms (``demand=None``): target GPUs per record, spread evenly over the
    destination node's GPUs."""
    delivery: Literal["after_rail", "streamed"] = "after_rail"
    """Stage 3 of wave v: 'after_rail' starts it when rail[v] is complete (store and forward, as
    the exchange runs the schedule); 'streamed' forwards chunks as they arrive (DeepEP's
    forwarder warps): it runs during rail[v] and completes no earlier than rail[v]."""
    phase_sync: Literal["global", "rank"] = "global"
    """When a phase may start. 'global': once the phases it depends on are complete on every
    rank (phase k + 1 of the whole cluster after all of phase k). 'rank': as the exchange runs
    (`exchange.moves`): each rank posts its next phase once its OWN sends and receives of the
    phases it depends on are done, in its program order, and a transfer moves once both its
    ends have posted it; expert compute is per rank too, the count all-to-all stays global
    (`program.rank_synced`). Costs about (3 W + transfers) engine phases per phase and more
    events; refused above ``rank_sync_max_ranks``."""
    rank_sync_max_ranks: int = 128
    """Largest W for ``phase_sync='rank'`` (docs/netmodel.md, "Per-rank phases": its cost)."""
    rel_tol: float = 1e-3
    """Event batching tolerance of the engine (`maxmin.simulate`)."""
    large_rel_tol: float = 1e-2
    """Tolerance used instead when a layer has more than ``large_flows`` flows (all-at-once
    NATIVE/RAIL on hundreds of nodes): measured error <= 0.9% per flow and 0.04% on the makespan
    (netmodel/maxmin.py), at about a sixth of the cost."""
    large_flows: int = 100_000
    """Flow count above which ``large_rel_tol`` applies."""

    def __post_init__(self) -> None:
        self.incast()  # validates alpha, k_free, k_sat
        for name in (
            "wave_latency_s",
            "wave_jitter_s",
            "count_exchange_s",
            "railbalance_barrier_s",
            "railbalance_quota_s",
            "delivery_fanout",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (np.isfinite(value) and value >= 0)
            ):
                raise ValueError(
                    f"NetModelConfig.{name} must be a finite number >= 0, got {value!r}"
                )
        if (
            isinstance(self.num_experts, bool)
            or not isinstance(self.num_experts, int)
            or self.num_experts < 1
        ):
            raise ValueError(
                f"NetModelConfig.num_experts must be an int >= 1, got {self.num_experts!r}"
            )
        if self.delivery not in ("after_rail", "streamed"):
            raise ValueError(
                f"NetModelConfig.delivery must be 'after_rail' or 'streamed', got {self.delivery!r}"
            )
        if self.nvlink not in ("maxmin", "ports"):
            raise ValueError(
                f"NetModelConfig.nvlink must be 'maxmin' or 'ports', got {self.nvlink!r}"
            )
        if self.phase_sync not in ("global", "rank"):
            raise ValueError(
                f"NetModelConfig.phase_sync must be 'global' or 'rank', got {self.phase_sync!r}"
            )
        if (
            isinstance(self.rank_sync_max_ranks, bool)
            or not isinstance(self.rank_sync_max_ranks, int)
            or self.rank_sync_max_ranks < 1
        ):
            raise ValueError(
                f"NetModelConfig.rank_sync_max_ranks must be an int >= 1, got "
                f"{self.rank_sync_max_ranks!r}"
            )
        for name in ("rel_tol", "large_rel_tol"):
            if not 0.0 <= getattr(self, name) <= 0.1:
                raise ValueError(
                    f"NetModelConfig.{name} must be in [0, 0.1], got {getattr(self, name)!r}"
                )
        build_fabric(
            RailTopology(num_nodes=1, gpus_per_node=1),
            nodes_per_leaf=self.nodes_per_leaf,
            spine_oversubscription=self.spine_oversubscription,
        )  # validates the fabric knobs

    def incast(self) -> IncastModel:
        """The receiver-port model (fixed costs are phase latencies, not here)."""
        return IncastModel(alpha=self.alpha, k_free=self.k_free, k_sat=self.k_sat)

    def wave_cost_s(self, num_ranks: int) -> float:
        """Fixed cost of one rail phase over ``num_ranks`` ranks, jitter included."""
        harmonic = float(np.sum(1.0 / np.arange(1, max(num_ranks, 1) + 1)))
        return self.wave_latency_s + self.wave_jitter_s * harmonic

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "netmodel config") -> NetModelConfig:
        known = {f.name for f in fields(cls)}
        if "combine_overlap" in data:
            raise ValueError(
                f"{source}: 'combine_overlap' was removed: the schedule the exchange runs overlaps "
                "combine's local round with its rail waves (combine.deliver[1] does not wait for "
                "combine.deliver[0]) and the model simulates that schedule; delete the key"
            )
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {unknown}; allowed keys are {sorted(known)}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def load_netmodel_config(path: str | Path) -> NetModelConfig:
    """A `NetModelConfig` from YAML (its ``model:`` mapping): a file, or the name of a packaged
    one (``h800_4x8``, ``h800_4x8_paper_incast``, ...: megatron_railwave/configs/netmodel)."""
    path = presets.resolve(path, "netmodel", "netmodel config")
    data = read_yaml(path, "netmodel config")  # invalid YAML: a ValueError naming the file
    if isinstance(data, dict) and "model" in data:
        data = data["model"]
    if not isinstance(data, dict):
        raise ValueError(
            f"netmodel config {str(path)!r}: expected a mapping under 'model', got "
            f"{type(data).__name__}"
        )
    return NetModelConfig.from_dict(data, source=f"netmodel config {str(path)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanTiming:
    """Modelled times of one dispatch + combine (seconds), its bandwidth bound and where bytes
    go."""

    dispatch_s: float
    """From the start (count exchange included) to the end of dispatch's last phase."""
    combine_s: float
    """From the end of dispatch to the end of combine's last phase."""
    relay_s: float
    """Dispatch's relay phase (owner -> proxy), start to end (0 without relays)."""
    rail_s_V: tuple[float, ...]
    """Per wave: duration of dispatch's rail phase, fixed wave cost included."""
    delivery_s_V: tuple[float, ...]
    """Per round: duration of dispatch's delivery phase (round 0: the local node's records)."""
    bound_dispatch_s: float
    """Bandwidth lower bound of dispatch: max over links (NVLink ports, NICs, adapters, leaf
    uplinks) of the bytes dispatch puts on the link / its capacity."""
    bound_combine_s: float
    """Bandwidth lower bound of combine (``phase_sync='rank'``: the least any rank's own
    combine flows need, `program.rank_bandwidth_bound`)."""
    bound_s: float
    """Bandwidth lower bound of dispatch + combine: the sum of the two ('global': combine
    starts after dispatch); 'rank': `program.rank_bandwidth_bound`."""
    bound_link: str
    """The link that sets the larger of the two bounds, e.g. 'nvlink-in (0, 3)', 'nic-down (2,
    5)'."""
    nic_egress_bytes_NR: np.ndarray
    """[N, R] float64, dispatch's rail bytes each NIC port sends (combine sends the mirror)."""
    nic_ingress_bytes_NR: np.ndarray
    """[N, R] float64, dispatch's rail bytes each NIC port receives."""
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
        return {
            "dispatch_s": self.dispatch_s,
            "combine_s": self.combine_s,
            "total_s": self.total_s,
            "bound_s": self.bound_s,
            "bound_dispatch_s": self.bound_dispatch_s,
            "bound_combine_s": self.bound_combine_s,
            "bound_link": self.bound_link,
            "relay_s": self.relay_s,
            "rail_s_V": list(self.rail_s_V),
            "delivery_s_V": list(self.delivery_s_V),
            "nic_shares": self.nic_shares().tolist(),
            "num_flows": self.num_flows,
            "num_events": self.num_events,
            "wall_s": self.wall_s,
        }


@functools.lru_cache(maxsize=16)
def fabric_for(topo: RailTopology, nodes_per_leaf: int, oversub: float) -> Fabric:
    """The (cached) links of ``topo``."""
    return build_fabric(topo, nodes_per_leaf=nodes_per_leaf, spine_oversubscription=oversub)


def link_name(fabric: Fabric, link: int) -> str:
    """A readable name of link ``link`` (for the bound's busiest link)."""
    topo = fabric.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    if link < 0:
        return "-"
    if link < 2 * n * g:
        side, rank = ("out", link) if link < n * g else ("in", link - n * g)
        return f"nvlink-{side} ({rank // g}, {rank % g})"
    for label, table in (
        ("nic-up", fabric.nic_up_NR),
        ("nic-down", fabric.nic_down_NR),
        ("adapter-up", fabric.adapter_up_NA),
        ("adapter-down", fabric.adapter_down_NA),
        ("leaf-up", fabric.leaf_up_RQ),
        ("leaf-down", fabric.leaf_down_RQ),
    ):
        if table is not None and (hit := np.argwhere(table == link)).size:
            return f"{label} {tuple(int(x) for x in hit[0])}"
    return f"link {link}"


def model_wire(topo: RailTopology, record_bytes: int, model: NetModelConfig) -> RecordWireFormat:
    """The wire format when only the payload bytes are known: ``record_bytes`` payload bytes,
    fp32 probs and the routing bits of E / N experts (E = ``model.num_experts``)."""
    if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or record_bytes < 0:
        raise ValueError(f"record_bytes must be an int >= 0, got {record_bytes!r}")
    # Unaligned rows: the presets were fitted on them (the exchange's 16-byte padding adds at most
    # 12 B to a row, 4 B of 8336 at GLM size).
    return RecordWireFormat(
        hidden=record_bytes,
        payload_dtype=torch.uint8,
        probs_dtype=torch.float32,
        experts_per_node=max(1, model.num_experts // topo.num_nodes),
        align_rows=False,
    )


def _synthetic_delivery_RNGG(plan: PathPlan, fanout: float) -> np.ndarray:
    """[V', N, G, G] float64 copies arrival GPU (d, l) -> target GPU (d, j) per round, when no
    mask histograms are known: ``fanout`` copies per record, even over the node's GPUs."""
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    round_NN = (plan.pair_wave_NN + 1).numpy()
    np.fill_diagonal(round_NN, 0)
    arrivals = plan.quota_NNG.to(torch.float64).numpy().copy()  # [s, d, l]
    idx = np.arange(n)
    arrivals[idx, idx] = plan.records_NNG[idx, idx].to(torch.float64).numpy()  # local: at the owner
    out = np.zeros((plan.num_waves + 1, n, g, g))
    per_target = arrivals * (fanout / g)
    for s in range(n):
        np.add.at(out, (round_NN[s], idx), np.broadcast_to(per_target[s][:, :, None], (n, g, g)))
    return out


def synced_program(
    program: LinkProgram, model: NetModelConfig, num_ranks: int, post_order: tuple[int, ...] = ()
) -> LinkProgram:
    """``program`` as ``model.phase_sync`` says: unchanged ('global') or split per rank ('rank';
    the 'counts' phase, a collective, stays global; ``post_order``: the ranks' program order).

    Raises:
        ValueError: 'rank' with more than ``model.rank_sync_max_ranks`` ranks.
    """
    if model.phase_sync == "global":
        return program
    if num_ranks > model.rank_sync_max_ranks:
        raise ValueError(
            f"NetModelConfig.phase_sync='rank' splits every phase per rank and per transfer; "
            f"{num_ranks} ranks is "
            f"above rank_sync_max_ranks={model.rank_sync_max_ranks} (docs/netmodel.md, 'Per-rank "
            f"phases', for "
            "its cost); use phase_sync='global' at this size or raise rank_sync_max_ranks"
        )
    counts = tuple(q for q, name in enumerate(program.names) if name == "counts")
    return rank_synced(program, num_ranks=num_ranks, post_order=post_order, global_phases=counts)


def schedule_program(
    schedule: ExecutionSchedule, model: NetModelConfig, fabric: Fabric | None = None
) -> tuple[LinkProgram, dict[str, int]]:
    """The `LinkProgram` of ``schedule`` under ``model`` (see the module docstring).

    Returns:
        (program, ids): ``ids`` maps the schedule's phase names (and 'counts', 'experts') to
        phase ids of the global program (``program`` itself, or ``program.source`` when
        ``model.phase_sync='rank'``); streamed deliveries add 'join' phases named
        '<consumer>.done'.
    """
    plan = schedule.plan
    topo = plan.topology
    fabric = fabric or fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    b = ProgramBuilder(fabric=fabric)
    counts = b.phase("counts", "sync", -1, (), model.count_exchange_s)
    ids = {"counts": counts}
    route = Route(plan.path)
    balanced = route.balanced or route.min_max  # a relay phase with a planned split
    wave_cost = model.wave_cost_s(topo.world_size)
    offset = counts + 1
    for p in schedule.phases:
        latency = 0.0
        if p.kind == PhaseKind.RAIL:
            latency = wave_cost
        elif (
            p.kind == PhaseKind.RELAY
            and p.direction == Direction.DISPATCH
            and balanced
            and p.step == 0  # a streamed relay's later parts need no second quota decision
        ):
            latency = model.railbalance_barrier_s + model.railbalance_quota_s
        direction = 0 if p.direction == Direction.DISPATCH else 1
        deps = [d + offset for d in p.depends_on]
        ids[p.name] = b.phase(p.name, p.kind.value, direction, tuple(deps), latency)
    experts = b.phase("experts", "sync", -1, tuple(ids[p.name] for p in schedule.dispatch_phases()))
    ids["experts"] = experts
    for p in schedule.phases:  # roots: dispatch after the counts, combine after expert compute
        q = ids[p.name]
        if not b.deps[q]:
            b.deps[q] = (counts,) if p.direction == Direction.DISPATCH else (experts,)
    if model.delivery == "streamed":
        V = schedule.num_waves
        pairs = [(f"dispatch.rail[{v}]", f"dispatch.deliver[{v + 1}]") for v in range(V)]
        pairs += [(f"combine.deliver[{v + 1}]", f"combine.rail[{v}]") for v in range(V)]
        for producer, consumer in pairs:
            prod, cons = ids[producer], ids[consumer]
            b.deps[cons] = tuple(
                dict.fromkeys([d for d in b.deps[cons] if d != prod] + list(b.deps[prod]))
            )
            join = b.phase(f"{consumer}.done", "sync", b.directions[cons], (cons, prod))
            for q in range(len(b.deps)):
                if q not in (join, cons) and cons in b.deps[q]:
                    b.deps[q] = tuple(join if d == cons else d for d in b.deps[q])
            ids[f"{consumer}.done"] = join
    # Flows: every transfer of every phase, with the bytes of its rows.
    for p in schedule.phases:
        src, dst, rows = (t.numpy() for t in schedule.transfers(p))
        size = rows.astype(np.float64) * schedule.row_bytes(p)
        if p.group == "node":
            b.nvlink(ids[p.name], src, dst, size)
        elif src.size:
            b.rail(ids[p.name], src, dst, size)
    if not schedule.delivery_nodes:
        if plan.chunks != 1:
            raise ValueError(
                f"a plan with {plan.chunks} rail chunks per wave needs the demand's target masks "
                "(pass demand=...): the synthetic delivery fan-out has no chunk rounds"
            )
        g = topo.gpus_per_node
        copies = _synthetic_delivery_RNGG(plan, model.delivery_fanout)
        for r in range(schedule.num_rounds):
            rr, d, l, j = np.nonzero(copies[r : r + 1])
            src, dst, cnt = d * g + l, d * g + j, copies[r, d, l, j]
            b.nvlink(ids[f"dispatch.deliver[{r}]"], src, dst, cnt * schedule.wire.dispatch_bytes)
            b.nvlink(ids[f"combine.deliver[{r}]"], dst, src, cnt * schedule.wire.combine_bytes)
    # The exchange posts the schedule's phases in order (`exchange.moves`); a streamed delivery is
    # a forwarder running beside the rail phase, outside that order.
    order = tuple(ids[p.name] for p in schedule.phases) if model.delivery == "after_rail" else ()
    return synced_program(b.build(), model, topo.world_size, order), ids


def execute_schedule(
    schedule: ExecutionSchedule, *, model: NetModelConfig | None = None
) -> PlanTiming:
    """Model one dispatch + combine of a compiled schedule (deterministic). Host sync: no."""
    t0 = time.perf_counter()
    model = model or NetModelConfig()
    plan = schedule.plan
    topo = plan.topology
    n = topo.num_nodes
    fabric = fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    program, ids = schedule_program(schedule, model, fabric)
    rel_tol = model.large_rel_tol if program.flows.num_flows > model.large_flows else model.rel_tol
    run = run_program(fabric, program, incast=model.incast(), rel_tol=rel_tol, nvlink=model.nvlink)
    start, finish = phase_times(program, run.result)
    lat = (program.source or program).latency_s_Q

    def span(name: str) -> float:
        q = ids[name]
        return float(finish[q] - start[q] + lat[q])

    relays = [ids[p.name] for p in schedule.dispatch_phases() if p.kind == PhaseKind.RELAY]
    relay_s = float(max(finish[q] for q in relays) - min(start[q] for q in relays))
    rail_s = tuple(span(f"dispatch.rail[{v}]") for v in range(schedule.num_waves))
    delivery_s = tuple(
        float(finish[ids[f"dispatch.deliver[{r}]"]] - start[ids[f"dispatch.deliver[{r}]"]])
        for r in range(schedule.num_rounds)
    )

    # NIC bytes of dispatch's rail phases.
    g = topo.gpus_per_node
    rails = np.asarray(topo.rail_of_gpu, dtype=np.int64)
    egress = np.zeros((n, topo.num_rails))
    ingress = np.zeros((n, topo.num_rails))
    for p in schedule.dispatch_phases():
        if p.kind != PhaseKind.RAIL:
            continue
        src, dst, rows = (t.numpy() for t in schedule.transfers(p))
        size = rows * float(schedule.row_bytes(p))
        np.add.at(egress, (src // g, rails[src % g]), size)
        np.add.at(ingress, (dst // g, rails[dst % g]), size)
    adapters = np.asarray(topo.adapter_of_rail)
    adapter = np.zeros((n, int(adapters.max()) + 1))
    np.add.at(adapter, (slice(None), adapters), egress)
    return PlanTiming(
        dispatch_s=run.dispatch_s,
        combine_s=run.combine_s,
        relay_s=relay_s,
        rail_s_V=rail_s,
        delivery_s_V=delivery_s,
        bound_dispatch_s=run.bound_dispatch_s,
        bound_combine_s=run.bound_combine_s,
        bound_s=run.bound_s,
        bound_link=link_name(fabric, run.bound_link),
        nic_egress_bytes_NR=egress,
        nic_ingress_bytes_NR=ingress,
        adapter_egress_bytes_NA=adapter,
        num_flows=run.num_flows,
        num_events=int(run.result.num_events),
        wall_s=time.perf_counter() - t0,
    )


def execute_plan(
    plan: PathPlan,
    *,
    record_bytes: int | None = None,
    model: NetModelConfig | None = None,
    demand: MaskSource | None = None,
    wire: RecordWireFormat | None = None,
) -> PlanTiming:
    """Model one dispatch + combine of ``plan``: its compiled `ExecutionSchedule` on the links.

    Args:
        plan: the path plan (stages, waves or windows).
        record_bytes: payload bytes of one record (hidden size x element size); used only
            without ``wire`` (`model_wire`: plus fp32 probs and routing bits of E / N experts).
        model: parameters; default `NetModelConfig()`.
        demand: mask histograms of the records (`DemandCounts` of the plan's demand) for the
            exact stage-3 copies; None = `NetModelConfig.delivery_fanout` copies per record.
        wire: the exchange's record wire format (bytes per row of every message).

    Returns:
        `PlanTiming`. Host sync: no (CPU only).
    """
    model = model or NetModelConfig()
    if wire is None:
        if record_bytes is None:
            raise ValueError(
                "execute_plan needs record_bytes (payload bytes per record) or wire (a "
                "RecordWireFormat)"
            )
        wire = model_wire(plan.topology, record_bytes, model)
    # Any MaskSource (DemandCounts, a sparse demand, a test double) answers masks_into for every
    # node; a node view (view_node set) knows one node only and compiles that one.
    nodes = None
    if demand is not None and getattr(demand, "view_node", None) is None:
        nodes = tuple(range(plan.topology.num_nodes))
    schedule = compile_schedule(plan, wire, demand=demand, delivery_nodes=nodes)
    return execute_schedule(schedule, model=model)


def simulate_plan(
    plan: PathPlan,
    *,
    record_bytes: int | None = None,
    model: NetModelConfig | None = None,
    demand: MaskSource | None = None,
    wire: RecordWireFormat | None = None,
) -> float:
    """Seconds of one dispatch + combine of ``plan`` on the flow model (deterministic).

    What `railwave online-sim` times each plan with; see `execute_plan` for the arguments.
    """
    return execute_plan(
        plan, record_bytes=record_bytes, model=model, demand=demand, wire=wire
    ).total_s
