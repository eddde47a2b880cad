"""``ExecutionSchedule``: a ``PathPlan`` compiled into the ordered phases of one layer.

Letters: N nodes, G GPUs per node, W = N * G ranks, V rail phases (waves or sending windows,
times the plan's rail chunks), V' = V + 1 delivery rounds, M = 2**G target masks, X transfers.

With rail chunks (``PlanOptions.chunks`` = c > 1) wave w's records on every rail leave in c
contiguous parts, rail[w * c + k] carrying part k (``planner.chunk_sizes`` of the quota), and
deliver[w * c + k + 1] delivering it: the phase graph below is the same, with V = waves x c.

The schedule is the one truth that three consumers share: the exchange executes it
(``exchange``), the flow model simulates it (``netmodel``) and the byte counters count it
(``bench.wire_bytes``). Pure: tensors and dataclasses in, a schedule out; no communication.

Dispatch phases, in the order the exchange posts them:

    relay          owner GPU (s, g) -> proxy GPU (s, l), node group (stage 1)
    deliver[0]     the local node's records: owner (s, g) -> target GPUs (s, j), node group
    rail[v]        wave v: GPU (s, l) -> GPU (d, l) for the wave's node pairs, rail group
    deliver[v+1]   wave v's records: arrival GPU (d, l) -> target GPUs (d, j), node group

listed as relay, deliver[0], rail[0], then rail[v], deliver[v] for v = 1..V-1, then deliver[V]:
rail[v+1] is posted before deliver[v+1] so that stage 3 of wave v overlaps stage 2 of wave
v + 1. A phase starts once every phase in its ``depends_on`` has completed on that rank:

    relay: ()            rail[0]: (relay,)          rail[v]: (rail[v-1],)
    deliver[0]: ()       deliver[1]: (rail[0],)     deliver[r]: (rail[r-1], deliver[r-1]) for r >= 2

(the local round deliver[0] and the first wave's round write disjoint copy slots, so neither
waits for the other; on gloo the transport may then move both as one all-to-all).

Combine runs the same transfers backwards (``mirror_of``): deliver back cdeliver[r] (targets
return their copies; the arrival GPU sums them in local-GPU order), rail back crail[v], relay
back crelay, listed as cdeliver[0], cdeliver[1], crail[0], cdeliver[2], crail[1], ...,
cdeliver[V], crail[V-1], crelay with

    cdeliver[0]: ()   cdeliver[1]: ()   cdeliver[r]: (cdeliver[r-1],) for r >= 2
    crail[v]: (cdeliver[v+1], crail[v-1])   crelay: (crail[V-1],)

The local round cdeliver[0] overlaps the rail waves in combine as deliver[0] does in dispatch;
the arrival GPU sums its returned local copies at the end, so the order of the sums (and the
result, bitwise) is the same.

Streamed relay (``PathPlan.streamed``, V > 1): the relay runs as V parts, relay[u] moving exactly
the relayed records that rail[u] sends (``planner.relay_chunk_rows_NNGGC``), so no rail phase
waits for the whole relay:

    relay[0]: ()   relay[u]: (relay[u-1],)   rail[0]: (relay[0],)   rail[v]: (rail[v-1], relay[v])
    crelay[0]: (crail[0],)   crelay[u]: (crail[u], crelay[u-1])

posted as relay[0], deliver[0], rail[0], then relay[v], rail[v], deliver[v] for v = 1..V-1, then
deliver[V] (relay[v] moves while rail[v-1] is on the wire), and in combine crelay[v-1] after
crail[v] (it moves while crail[v] is on the wire), crelay[V-1] last. Without streaming the one
relay phase is named 'dispatch.relay' / 'combine.relay'; streamed, 'dispatch.relay[u]'.

Transfers are stored for the dispatch phases as one table (phase, src rank, dst rank, rows);
a combine phase's transfers are its mirror's with source and destination swapped. Rows count
records on stages 1-2 and copies (record x target GPU) on stage 3; a transfer with
src == dst is a copy a GPU keeps (stage 3 to itself) and never touches a wire.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal, Protocol

import numpy as np
import torch

from megatron_railwave.planner import (
    PathPlan,
    arrival_mask_counts_NGM,
    chunk_arrival_counts,
    chunk_sizes,
    delivery_copies_NGG,
    relay_chunk_rows_NNGGC,
)
from megatron_railwave.schedule.wire import RecordWireFormat
from megatron_railwave.traffic import mask_bits

__all__ = ["Direction", "PhaseKind", "Phase", "ExecutionSchedule", "MaskSource", "compile_schedule"]


class MaskSource(Protocol):
    """The mask histogram of the records into one node (``traffic.DemandCounts``)."""

    def masks_into(self, node: int) -> torch.Tensor:
        """[W, M] int64: records every rank sends to ``node``, by target mask."""
        ...


class Direction(StrEnum):
    DISPATCH = "dispatch"
    COMBINE = "combine"


class PhaseKind(StrEnum):
    RELAY = "relay"
    RAIL = "rail"
    DELIVER = "deliver"


GroupKind = Literal["node", "rail"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """One communication step of a layer.

    Attributes:
        index: position in ``ExecutionSchedule.phases``.
        name: e.g. 'dispatch.rail[1]', 'combine.deliver[0]'.
        direction: dispatch or combine.
        kind: relay, rail or deliver.
        step: the wave (rail) or the delivery round (deliver); 0 for relay.
        group: 'node' (peers are local GPU indices) or 'rail' (peers are node indices).
        depends_on: phases that must complete on a rank before it starts this one.
        mirror_of: for combine phases, the dispatch phase whose transfers run backwards.
    """

    index: int
    name: str
    direction: Direction
    kind: PhaseKind
    step: int
    group: GroupKind
    depends_on: tuple[int, ...]
    mirror_of: int | None = None


def _dispatch_layout(num_waves: int, relays: int) -> list[tuple[PhaseKind, int]]:
    order = [(PhaseKind.RELAY, 0), (PhaseKind.DELIVER, 0)]
    if num_waves:
        order.append((PhaseKind.RAIL, 0))
        for v in range(1, num_waves):
            if relays > 1:  # streamed: wave v's relay part runs while rail[v - 1] is on the wire
                order.append((PhaseKind.RELAY, v))
            order += [(PhaseKind.RAIL, v), (PhaseKind.DELIVER, v)]
        order.append((PhaseKind.DELIVER, num_waves))
    return order


def _combine_layout(num_waves: int, relays: int) -> list[tuple[PhaseKind, int]]:
    order = [(PhaseKind.DELIVER, 0)]
    for v in range(num_waves):
        order += [(PhaseKind.DELIVER, v + 1), (PhaseKind.RAIL, v)]
        if relays > 1 and v >= 1:  # streamed: crelay[v - 1] runs while crail[v] is on the wire
            order.append((PhaseKind.RELAY, v - 1))
    order.append((PhaseKind.RELAY, num_waves - 1 if relays > 1 else 0))
    return order


@functools.lru_cache(maxsize=256)
def _build_phases(num_waves: int, relays: int = 1) -> tuple[Phase, ...]:
    """The phases of a schedule with ``num_waves`` rail phases and ``relays`` relay phases (1, or
    ``num_waves`` when the relay is streamed; immutable; cached)."""
    if relays not in (1, num_waves):
        raise ValueError(f"relays={relays} must be 1 or the {num_waves} rail phases (streamed)")
    streamed = relays > 1
    phases: list[Phase] = []
    index: dict[tuple[Direction, PhaseKind, int], int] = {}
    for direction, layout in (
        (Direction.DISPATCH, _dispatch_layout(num_waves, relays)),
        (Direction.COMBINE, _combine_layout(num_waves, relays)),
    ):
        for kind, step in layout:
            index[(direction, kind, step)] = len(phases)
            phases.append(None)  # type: ignore[arg-type]  # filled below, once every index is known
    D, C = Direction.DISPATCH, Direction.COMBINE
    R, L, DL = PhaseKind.RELAY, PhaseKind.RAIL, PhaseKind.DELIVER
    for (direction, kind, step), i in index.items():
        if direction == D:
            if kind == R:
                # A streamed relay part is posted once the previous one has landed (the program
                # waits for it before rail[v - 1]).
                deps: tuple[int, ...] = (index[(D, R, step - 1)],) if step else ()
            elif kind == L:
                relay = (index[(D, R, step if streamed else 0)],)
                deps = (
                    relay if step == 0 else (index[(D, L, step - 1)],) + (relay if streamed else ())
                )
            else:
                # Round 1 does not wait for round 0 (the local node's copies) either: the two
                # write disjoint copy slots, so the first wave's copies go on as they arrive.
                deps = (
                    ()
                    if step == 0
                    else (index[(D, L, step - 1)],)
                    + ((index[(D, DL, step - 1)],) if step >= 2 else ())
                )
            mirror = None
        else:
            if kind == DL:
                # Round 1 does not wait for round 0 (the local node's copies): the local round
                # overlaps the rail waves, as dispatch's deliver[0] does.
                deps = () if step <= 1 else (index[(C, DL, step - 1)],)
            elif kind == L:
                deps = (index[(C, DL, step + 1)],) + ((index[(C, L, step - 1)],) if step else ())
            elif streamed:  # relay part v returns what rail[v] brought back
                deps = (index[(C, L, step)],) + ((index[(C, R, step - 1)],) if step else ())
            else:
                deps = (index[(C, L, num_waves - 1)],) if num_waves else ()
            mirror = index[(D, kind, step)]
        label = f"{kind.value}[{step}]" if kind != R or streamed else kind.value
        phases[i] = Phase(
            index=i,
            name=f"{direction.value}.{label}",
            direction=direction,
            kind=kind,
            step=step,
            group="rail" if kind == L else "node",
            depends_on=deps,
            mirror_of=mirror,
        )
    return tuple(phases)


@functools.lru_cache(maxsize=256)
def _dispatch_phase_indices(
    num_waves: int, relays: int = 1
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(relay phases [1 or V], rail phases [V], deliver phases [V + 1]) of a schedule with V rail
    phases."""
    index = {(p.direction, p.kind, p.step): p.index for p in _build_phases(num_waves, relays)}
    D = Direction.DISPATCH
    return (
        tuple(index[(D, PhaseKind.RELAY, u)] for u in range(relays)),
        tuple(index[(D, PhaseKind.RAIL, v)] for v in range(num_waves)),
        tuple(index[(D, PhaseKind.DELIVER, r)] for r in range(num_waves + 1)),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionSchedule:
    """The phases, transfers and wire format of one layer (identical on every rank).

    Attributes:
        plan: the path plan compiled.
        wire: bytes per row of every message.
        phases: dispatch phases, then combine phases, each list in posting order.
        delivery_nodes: nodes whose stage-3 transfers the table holds (all nodes for tools; the
            exchange compiles only its own node, the only one whose target masks it gathers).
        demand: the mask histograms stage 3 was compiled from (None without delivery nodes).
        phase_X, src_X, dst_X, rows_X: [X] int64 transfer table of the dispatch phases (global
            EP ranks), rows > 0, sorted by phase.
        transfer_ranks: None (the table holds every transfer), or the ranks whose transfers
            it holds (those from or to them): the exchange's per-layer compile keeps its own
            rank only (``compile_for_rank``: the global table is ~N^2 G transfers, 130 k at
            128 x 8, and the rank reads its own); what needs the others refuses it.
    """

    plan: PathPlan
    wire: RecordWireFormat
    phases: tuple[Phase, ...]
    delivery_nodes: tuple[int, ...]
    demand: MaskSource | None
    phase_X: torch.Tensor
    src_X: torch.Tensor
    dst_X: torch.Tensor
    rows_X: torch.Tensor
    transfer_ranks: tuple[int, ...] | None = None

    def only_ranks(self, ranks: tuple[int, ...]) -> ExecutionSchedule:
        """This schedule with the transfers from or to ``ranks`` only (``transfer_ranks``)."""
        keep = torch.zeros_like(self.src_X, dtype=torch.bool)
        for rank in ranks:
            keep |= (self.src_X == rank) | (self.dst_X == rank)
        return replace(
            self,
            phase_X=self.phase_X[keep],
            src_X=self.src_X[keep],
            dst_X=self.dst_X[keep],
            rows_X=self.rows_X[keep],
            transfer_ranks=tuple(ranks),
        )

    def require_ranks(self, what: str, ranks: tuple[int, ...] | None = None) -> None:
        """Raises ValueError when the table lacks transfers ``what`` needs: those of ``ranks``
        (None: of every rank)."""
        if self.transfer_ranks is None:
            return
        if ranks is None or not set(ranks) <= set(self.transfer_ranks):
            raise ValueError(
                f"{what} needs the transfers of {'every rank' if ranks is None else list(ranks)}; "
                f"this schedule holds those of ranks {list(self.transfer_ranks)} only (compile it "
                f"with schedule.compile_schedule for the whole table)"
            )

    @property
    def num_waves(self) -> int:
        """V: rail phases (the plan's waves x its rail chunks)."""
        return self.plan.num_rail_phases

    @property
    def num_rounds(self) -> int:
        """V' = V + 1 delivery rounds (round 0: the local node's records)."""
        return self.plan.num_rail_phases + 1

    def dispatch_phases(self) -> tuple[Phase, ...]:
        return tuple(p for p in self.phases if p.direction == Direction.DISPATCH)

    def combine_phases(self) -> tuple[Phase, ...]:
        return tuple(p for p in self.phases if p.direction == Direction.COMBINE)

    def phase(self, direction: Direction | str, kind: PhaseKind | str, step: int = 0) -> Phase:
        for p in self.phases:
            if p.direction == direction and p.kind == kind and p.step == step:
                return p
        raise KeyError(
            f"no phase {direction}.{kind}[{step}] in a schedule of {self.num_waves} waves"
        )

    def transfers(self, phase: Phase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src [x], dst [x], rows [x]) int64 of one phase; combine phases are mirrored. Of the
        ranks the table holds (``transfer_ranks``): a rank's own compile has its own only."""
        source = phase.index if phase.mirror_of is None else phase.mirror_of
        sel = self.phase_X == source
        src, dst, rows = self.src_X[sel], self.dst_X[sel], self.rows_X[sel]
        return (dst, src, rows) if phase.mirror_of is not None else (src, dst, rows)

    def row_bytes(self, phase: Phase, *, backward: bool = False) -> int:
        """Bytes of one row of ``phase`` in the forward pass, or in its backward."""
        if phase.direction == Direction.DISPATCH:
            return self.wire.combine_bytes if backward else self.wire.dispatch_bytes
        return self.wire.dispatch_grad_bytes if backward else self.wire.combine_bytes

    def wire_rows_P(self) -> torch.Tensor:
        """[P] int64: rows that cross a link (src != dst) in each phase."""
        self.require_ranks("wire_rows_P")
        mirror = torch.tensor(
            [p.index if p.mirror_of is None else p.mirror_of for p in self.phases],
            dtype=torch.int64,
        )
        moved = torch.zeros(len(self.phases), dtype=torch.int64)
        off = self.src_X != self.dst_X
        moved.index_add_(0, self.phase_X[off], self.rows_X[off])
        return moved[mirror]

    def rank_bytes(self, rank: int, *, backward: bool = False) -> dict[str, list[int]]:
        """Bytes ``rank`` sends and receives over links in each phase (self copies excluded).

        Returns:
            {'sent': [P], 'received': [P]} in phase order.
        """
        self.require_ranks("rank_bytes", (rank,))
        sent, received = [], []
        for p in self.phases:
            src, dst, rows = self.transfers(p)
            off = src != dst
            width = self.row_bytes(p, backward=backward)
            sent.append(int(rows[off & (src == rank)].sum()) * width)
            received.append(int(rows[off & (dst == rank)].sum()) * width)
        return {"sent": sent, "received": received}

    def to_json(self) -> dict:
        rows = self.wire_rows_P().tolist()
        return {
            "path": str(self.plan.path),
            "num_waves": self.num_waves,
            "wire": self.wire.to_dict(),
            "delivery_nodes": list(self.delivery_nodes),
            "phases": [
                {
                    "name": p.name,
                    "group": p.group,
                    "depends_on": [self.phases[d].name for d in p.depends_on],
                    "wire_rows": rows[p.index],
                    "wire_bytes": rows[p.index] * self.row_bytes(p),
                }
                for p in self.phases
            ],
        }


# Transfer tables are built in numpy: tiny integer arrays on every layer's planning path, where
# numpy's per-call cost is a fraction of torch's.


def _relay_transfers(plan: PathPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(relay phase, src, dst, rows): one relay phase (0), or with a streamed relay, rail phase
    v's part in relay phase v (``relay_chunk_rows_NNGGC``)."""
    g, c = plan.topology.gpus_per_node, plan.chunks
    off_diagonal = ~np.eye(g, dtype=bool)  # kept records are not transfers
    if not plan.streamed:
        remote = (plan.pair_wave_NN >= 0).numpy()
        relay_NGG = np.einsum("sdgl,sd->sgl", plan.relay_NNGG.numpy(), remote) * off_diagonal
        s, o, l = np.nonzero(relay_NGG)
        return np.zeros(s.shape, dtype=np.int64), s * g + o, s * g + l, relay_NGG[s, o, l]
    parts = relay_chunk_rows_NNGGC(plan) * off_diagonal[:, :, None]  # [s, d, o, l, k]
    wave_NN = plan.pair_wave_NN.numpy()
    per_phase = np.zeros((plan.num_rail_phases, *parts.shape[:1], g, g), dtype=np.int64)
    s, d = np.nonzero(wave_NN >= 0)
    for k in range(c):  # phase [u, s, o, l] += parts of the pairs whose chunk k is rail phase u
        np.add.at(per_phase, (wave_NN[s, d] * c + k, s), parts[s, d, :, :, k])
    u, s, o, l = np.nonzero(per_phase)
    return u, s * g + o, s * g + l, per_phase[u, s, o, l]


def _rail_transfers(plan: PathPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rail phase, src, dst, rows): wave v's chunk k of every remote (s, d, l) is rail phase
    v * chunks + k (rows: ``chunk_sizes`` of the quota)."""
    g, c = plan.topology.gpus_per_node, plan.chunks
    wave_NN = plan.pair_wave_NN.numpy()
    remote_quota = plan.quota_NNG.numpy() * (wave_NN >= 0)[:, :, None]
    s, d, l = np.nonzero(remote_quota)
    rows_XC = chunk_sizes(remote_quota[s, d, l], c)
    phase_XC = wave_NN[s, d][:, None] * c + np.arange(c)
    keep = rows_XC > 0
    src, dst = (
        np.broadcast_to((s * g + l)[:, None], keep.shape),
        np.broadcast_to((d * g + l)[:, None], keep.shape),
    )
    return phase_XC[keep], src[keep], dst[keep], rows_XC[keep]


def _delivery_transfers(
    plan: PathPlan, demand: MaskSource, node: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    g, c = plan.topology.gpus_per_node, plan.chunks
    copies_NGG = delivery_copies_NGG(plan, demand, node).numpy()  # [s, arrive l, target j]
    wave_N = plan.pair_wave_NN[:, node].numpy()
    per_round = np.zeros((plan.num_rail_phases + 1, g, g), dtype=np.int64)
    if c == 1:
        round_N = wave_N + 1
        round_N[node] = 0
        np.add.at(per_round, round_N, copies_NGG)
    else:
        # Round 0 as above; chunk k of a remote source's block at arrival GPU l holds the cut of its
        # (owner, mask) arrival counts (``chunk_arrival_counts``): its copies per target follow.
        per_round[0] = copies_NGG[node]
        remote = np.flatnonzero(wave_N >= 0)
        bits = mask_bits(g).numpy()  # [M, G]
        for l in range(g):
            arrival_NGM = arrival_mask_counts_NGM(plan, demand, node, l).numpy()[remote]
            copies_NCJ = chunk_arrival_counts(arrival_NGM, c).sum(axis=2) @ bits  # [remote s, k, j]
            rounds_NC = 1 + wave_N[remote][:, None] * c + np.arange(c)
            np.add.at(per_round[:, l, :], rounds_NC, copies_NCJ)
    r, l, j = np.nonzero(per_round)
    return r, node * g + l, node * g + j, per_round[r, l, j]


def compile_schedule(
    plan: PathPlan,
    wire: RecordWireFormat,
    *,
    demand: MaskSource | None = None,
    delivery_nodes: tuple[int, ...] | None = None,
) -> ExecutionSchedule:
    """Compile ``plan`` into the phases and transfers of one layer. Pure; host tensors only.

    Args:
        plan: the path plan.
        wire: the record wire format.
        demand: target-mask histograms (``DemandCounts``); stage 3 needs them for every node in
            ``delivery_nodes``.
        delivery_nodes: nodes whose stage-3 transfers to compile; default: every node whose
            masks ``demand`` holds (all for a full demand, the view node for the exchange's
            node view, none without a demand).

    Host sync: no (CPU tensors in and out).
    """
    n = plan.topology.num_nodes
    if delivery_nodes is None:
        if demand is None:
            delivery_nodes = ()
        elif getattr(demand, "records_WNM", None) is not None:
            delivery_nodes = tuple(range(n))
        else:
            view = getattr(demand, "view_node", None)
            delivery_nodes = () if view is None else (int(view),)
    elif delivery_nodes and demand is None:
        raise ValueError(
            "compile_schedule: delivery_nodes need the demand's target-mask histograms"
        )
    phases = _build_phases(plan.num_rail_phases, plan.num_relay_phases)
    relay_phases, rail_phases, deliver_phases = _dispatch_phase_indices(
        plan.num_rail_phases, plan.num_relay_phases
    )
    parts = []  # (phase [x], src [x], dst [x], rows [x])

    relay, src, dst, rows = _relay_transfers(plan)
    parts.append((np.array(relay_phases, dtype=np.int64)[relay], src, dst, rows))

    rail_phase_V = np.array(rail_phases, dtype=np.int64)
    wave, src, dst, rows = _rail_transfers(plan)
    parts.append((rail_phase_V[wave], src, dst, rows))

    deliver_phase_R = np.array(deliver_phases, dtype=np.int64)
    for node in delivery_nodes:
        rnd, src, dst, rows = _delivery_transfers(plan, demand, node)  # type: ignore[arg-type]
        parts.append((deliver_phase_R[rnd], src, dst, rows))

    table = np.stack(
        [np.concatenate([p[k] for p in parts]).astype(np.int64, copy=False) for k in range(4)]
    )
    table = table[:, np.argsort(table[0], kind="stable")]  # sorted by phase, stable
    phase_X, src_X, dst_X, rows_X = (torch.from_numpy(row) for row in table)
    return ExecutionSchedule(
        plan=plan,
        wire=wire,
        phases=phases,
        delivery_nodes=tuple(delivery_nodes),
        demand=demand if delivery_nodes else None,
        phase_X=phase_X,
        src_X=src_X,
        dst_X=dst_X,
        rows_X=rows_X,
    )
