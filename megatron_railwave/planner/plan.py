"""Count-level execution plans of the routes (the paper's four paths, FLOW and FLOW_WAVES).

Letters: N nodes (s source, d destination), G GPUs per node (g owner, l egress), R rails,
V waves.

A ``PathPlan`` is computed from the global demand counts, so every rank builds the same plan. It
fixes, for every node pair, how many records each owner GPU hands to each egress GPU (stage 1,
intra-node relay), in which wave the pair sends (stage 2, rail transfers GPU (s, l) -> GPU (d, l)),
and, through ``planner.routes``, the delivery counts of stage 3 (GPU (d, l) -> GPU (d, j)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_railwave.names import Route, parse_route
from megatron_railwave.planner.chunks import chunk_sizes
from megatron_railwave.planner.eligible import EligiblePolicy
from megatron_railwave.planner.flow import flow_objective_cost, flow_relay_NNGG
from megatron_railwave.planner.railbalance import eligible_NNG, quota_and_relay
from megatron_railwave.planner.waves import WaveSchedule, all_at_once, bounded_fanin_schedule
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import (
    DemandCounts,
    SelectorScales,
    TrafficStats,
    mask_bits,
    rail_load_NRN,
    traffic_stats,
)

__all__ = [
    "PathPlan",
    "PlanOptions",
    "build_plan",
    "chunk_sizes",
    "delivery_copies_NNGG",
    "relay_chunk_rows_NNGGC",
]


MAX_CHUNKS = 64
"""Most rail chunks per wave (``PlanOptions.chunks``): beyond a few parts each adds only its
per-phase cost, and the layout's counts grow with the parts (N x G x M per source and part)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """Knobs of the planner that are not part of the demand."""

    policy: EligiblePolicy = EligiblePolicy.ALL
    """Eligible-rail policy of RailBalance."""
    rail_mask_NG: torch.Tensor | None = None
    """[N, G] bool allowed GPUs for policy MASK."""
    fanin: int = 1
    """Senders per receiver per wave for PERM / JOINT / FLOW_WAVES: 1 is the paper's cyclic
    schedule."""
    windows: WaveSchedule | None = None
    """Sending windows kept by NATIVE / RAIL / FLOW (a replay arrangement); None = all pairs at
    once."""
    chunks: int = 1
    """Rail chunks per wave for PERM / JOINT / FLOW / FLOW_WAVES: each pair's records on a rail
    leave in ``chunks`` near-equal parts, one rail phase each, and each part is delivered while
    the next is on the rail (more, smaller waves; 1 = whole waves, the paper's schedule). NATIVE
    sends whole windows; RAIL is chunked only when ``streamed``."""
    streamed: bool = False
    """Relay streamed into the rail phases: one relay phase per rail phase, carrying exactly the
    relayed records that rail phase sends, so a rail phase waits for its own part of the relay
    only, not for the whole relay (no store-and-forward between stage 1 and stage 2). Results are
    bitwise the same (the egress and arrival orders do not change). With one rail phase (all
    pairs at once, ``chunks`` = 1) there is nothing to stream: set ``chunks`` > 1."""

    def __post_init__(self) -> None:
        if self.fanin < 1:
            raise ValueError(f"fanin must be >= 1, got {self.fanin}")
        if not isinstance(self.streamed, bool):
            raise ValueError(f"streamed must be a bool, got {self.streamed!r}")
        if (
            isinstance(self.chunks, bool)
            or not isinstance(self.chunks, int)
            or not 1 <= self.chunks <= MAX_CHUNKS
        ):
            raise ValueError(
                f"chunks must be an integer in 1..{MAX_CHUNKS} (rail chunks per wave; every part "
                f"adds a "
                f"rail phase and a delivery round per wave), got {self.chunks!r}"
            )
        object.__setattr__(self, "policy", EligiblePolicy(self.policy))


@dataclass(frozen=True, kw_only=True, slots=True)
class PathPlan:
    """The global, count-level plan of one phase (identical on every rank).

    Attributes:
        path: the execution path.
        topology: the cluster.
        schedule: sending windows (NATIVE, RAIL, FLOW) or waves (PERM, JOINT, FLOW_WAVES) of the
            remote pairs.
        phase: remainder-rotation counter used.
        records_NNG: [N_src, N_dst, G_owner] int64, records owned per GPU (the demand).
        quota_NNG: [N_src, N_dst, G_egress] int64, records leaving each GPU per pair.
        relay_NNGG: [N_src, N_dst, G_owner, G_egress] int64, owner -> egress record counts
            (diagonal = kept, off-diagonal = relayed over NVLink). Local pairs are diagonal.
        pair_wave_NN: [N, N] int64, wave of each remote pair, -1 on the diagonal.
        chunks: rail chunks per wave (``PlanOptions.chunks``; 1 for NATIVE, and for RAIL unless
            streamed): wave v's chunk k is rail phase v * chunks + k.
        streamed: the relay runs as one phase per rail phase (``PlanOptions.streamed``; False
            where the plan relays nothing or has one rail phase).
    """

    path: Route
    topology: RailTopology
    schedule: WaveSchedule
    phase: int
    records_NNG: torch.Tensor
    quota_NNG: torch.Tensor
    relay_NNGG: torch.Tensor
    pair_wave_NN: torch.Tensor
    chunks: int = 1
    streamed: bool = False

    @property
    def num_waves(self) -> int:
        """Waves (or sending windows) of node pairs."""
        return self.schedule.num_waves

    @property
    def num_rail_phases(self) -> int:
        """Rail phases of a layer: every wave's chunks, V x chunks."""
        return self.schedule.num_waves * self.chunks

    @property
    def num_relay_phases(self) -> int:
        """Relay phases of a layer: one per rail phase when streamed, else one."""
        return self.num_rail_phases if self.streamed else 1

    def rail_load_NRN(self) -> torch.Tensor:
        """[N_src, R, N_dst] int64: records sent on rail r of node s to node d (local: owner
        rail)."""
        return rail_load_NRN(self.quota_NNG.permute(0, 2, 1), self.topology)

    def relayed_records(self) -> int:
        """Records that move to a proxy GPU before leaving the node (remote pairs only)."""
        return _relayed_records(self.relay_NNGG)

    def records_total(self) -> int:
        return int(self.records_NNG.sum().item())

    def stats(self, *, record_bytes: int, scales: SelectorScales | None = None) -> TrafficStats:
        """Descriptors of this execution (rho_g and kappa after the plan's rails and waves)."""
        return traffic_stats(
            self.records_NNG.permute(0, 2, 1),
            self.rail_load_NRN(),
            self.pair_wave_NN,
            self.topology,
            record_bytes=record_bytes,
            scales=scales,
        )

    def to_json(self, *, record_bytes: int) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "topology": self.topology.to_dict(),
            "phase": self.phase,
            "schedule_kind": self.schedule.kind,
            "waves": self.schedule.to_list(),
            "rail_load": self.rail_load_NRN().tolist(),
            "records_total": self.records_total(),
            "relayed_records": self.relayed_records(),
            "stats": self.stats(record_bytes=record_bytes).to_dict(),
        }


def _relayed_records(relay_NNGG: torch.Tensor) -> int:
    """Off-diagonal records of a relay matrix: those an owner hands to another GPU."""
    return int((relay_NNGG.sum() - torch.diagonal(relay_NNGG, dim1=-2, dim2=-1).sum()).item())


def relay_chunk_rows_NNGGC(plan: PathPlan, node: int | None = None) -> np.ndarray:
    """[N_src, N_dst, G_owner, G_egress, chunks] int64: owner (s, o)'s records for node d that
    leave GPU (s, l) in rail chunk k (remote pairs; local pairs: 0); with ``node``, source node
    ``node``'s [N_dst, G_owner, G_egress, chunks] alone.

    The egress rows of a pair on GPU l are its owners' records in owner order (owner l's kept
    ones among them) and rail chunk k is their k-th contiguous part (``chunk_sizes`` of the
    quota), so owner o's share of chunk k is the overlap of its interval with the chunk's.
    A streamed relay (``PathPlan.streamed``) moves these in the rail phase of the chunk."""
    remote = (plan.pair_wave_NN >= 0).numpy()
    relay = plan.relay_NNGG.numpy()
    if node is not None:
        remote, relay = remote[node], relay[node]
    relay = relay * remote[..., None, None]
    hi_o = np.cumsum(relay, axis=-2)  # [..., d, o, l]: end of owner o's interval on GPU l
    lo_o = hi_o - relay
    sizes = chunk_sizes(hi_o[..., -1, :], plan.chunks)  # [..., d, l, k]
    hi_k = np.cumsum(sizes, axis=-1)
    lo_k = hi_k - sizes
    overlap = np.minimum(hi_o[..., None], hi_k[..., None, :, :]) - np.maximum(
        lo_o[..., None], lo_k[..., None, :, :]
    )
    return np.clip(overlap, 0, None)


def delivery_copies_NNGG(
    demand: DemandCounts | torch.Tensor, records_NNG: torch.Tensor, gpus_per_node: int
) -> torch.Tensor:
    """[N_src, N_dst, G_owner, G_target] int64: (record, target GPU) copies of owner (s, g)'s
    records for GPU (d, j), the min-max plan's hit model (``planner.flow``).

    From the demand's copies per destination GPU (``DemandCounts.copies_WNG``: the full form, or
    a node view gathered with delivery counts), so every rank sees every node's targets. Without
    them (plain record counts) each record is taken to have one target, the owner's records
    spread evenly over the node's GPUs (``chunk_sizes``): the same guess on every rank.
    """
    g = gpus_per_node
    n = records_NNG.shape[0]
    copies_WNG = None
    if isinstance(demand, DemandCounts):
        if demand.records_WNM is not None or demand.delivery_WNG is not None:
            copies_WNG = demand.copies_WNG().to(torch.int64).cpu()
    elif hasattr(demand, "masks_into"):  # a mask source of every node (lab: SparseDemand)
        bits = mask_bits(g).to(torch.int64)
        copies_WNG = torch.stack([demand.masks_into(d) @ bits for d in range(n)], dim=1)
    if copies_WNG is not None:
        return copies_WNG.reshape(n, g, n, g).permute(0, 2, 1, 3).contiguous()
    return torch.from_numpy(chunk_sizes(records_NNG.numpy(), g))


def build_plan(
    demand: DemandCounts | torch.Tensor,
    topo: RailTopology,
    path: Route | str,
    *,
    options: PlanOptions | None = None,
    phase: int = 0,
) -> PathPlan:
    """Plan one phase. Pure: the same inputs give the same plan on every rank.

    Args:
        demand: the gathered ``DemandCounts`` or directly ``records_NGN`` [N_src, G, N_dst]
            int64 (records owned by GPU (s, g) for node d).
        topo: the cluster (failed rails are never used).
        path: a ``Route`` (or its name).
        options: eligible policy, fan-in, replay windows.
        phase: remainder-rotation counter (e.g. a per-layer call counter; same on every rank).

    Returns:
        The ``PathPlan``. Host sync: no (CPU tensors in, CPU tensors out).
    """
    options = options or PlanOptions()
    path = parse_route(path)
    records_NGN = demand.records_NGN() if hasattr(demand, "records_NGN") else demand
    n, g = topo.num_nodes, topo.gpus_per_node
    if tuple(records_NGN.shape) != (n, g, n):
        raise ValueError(
            f"demand has shape {tuple(records_NGN.shape)}, expected [N, G, N] = [{n}, {g}, {n}] "
            f"for "
            f"topology {topo.name!r}"
        )
    records_NNG = records_NGN.permute(0, 2, 1).to(torch.int64).cpu()
    eligible = eligible_NNG(topo, records_NNG, options.policy, options.rail_mask_NG)
    if path.waved:
        schedule = bounded_fanin_schedule(n, options.fanin)
    else:
        schedule = options.windows if options.windows is not None else all_at_once(n)
        if schedule.num_nodes != n:
            raise ValueError(f"windows are for {schedule.num_nodes} nodes, topology has {n}")
    pair_wave = schedule.pair_wave_NN()
    if path.min_max:
        copies = delivery_copies_NNGG(demand, records_NNG, g)
        v = schedule.num_waves
        relay = flow_relay_NNGG(records_NNG, copies, eligible, pair_wave, topo, num_waves=v)
        # The water-filling is greedy; RailBalance's plan is often near the optimum of the same
        # objective (docs/planner.md), so FLOW keeps whichever of the two costs less (integer
        # costs: the same choice on every rank; ties keep RailBalance's).
        quota, balanced = quota_and_relay(records_NNG, eligible, balanced=True, phase=phase)
        cost = functools.partial(
            flow_objective_cost, copies_NNGG=copies, wave_NN=pair_wave, topo=topo, num_waves=v
        )
        if cost(relay) < cost(balanced):
            quota = relay.sum(dim=2)
        else:
            relay = balanced
    else:
        quota, relay = quota_and_relay(records_NNG, eligible, balanced=path.balanced, phase=phase)
    chunked = path.waved or path.min_max or (path.balanced and options.streamed)
    chunks = options.chunks if chunked and n > 1 else 1
    return PathPlan(
        path=path,
        topology=topo,
        schedule=schedule,
        phase=phase,
        records_NNG=records_NNG,
        quota_NNG=quota,
        relay_NNGG=relay,
        pair_wave_NN=pair_wave,
        chunks=chunks,
        streamed=options.streamed
        and schedule.num_waves * chunks > 1
        and _relayed_records(relay) > 0,
    )
