"""The data movement of one layer as rank programs that follow the ``ExecutionSchedule``.

Letters: N nodes, G GPUs per node, n_rec records of this rank, n_copy copies it receives,
n_arr rows arriving at it in one round, b bytes per row.

Rows travel as packed bytes (``ops.pack_rows``): one buffer per peer and phase, whatever the
dtypes inside. Both programs walk their direction's phases in the schedule's order; before a
phase starts, every phase in its ``depends_on`` is waited for and its result consumed, so the
overlap the schedule allows (wave v + 1's rail transfers in flight while wave v is delivered)
is exactly what runs.

* ``forward_moves`` (dispatch direction): owner rows -> every target GPU's copies.
* ``backward_moves`` (combine direction): copies -> owner rows; where dispatch fanned a record
  out to several GPUs, the arrival GPU sums the returned copies in local-GPU order
  (``ops.segment_sum``, fixed order), so every path gives bitwise-identical sums.
* ``relay_forward`` / ``relay_backward``: the relay phase alone (owner -> proxy and back), for a
  backend that moves the rest itself (``exchange.deepep``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.exchange.groups import RankGroups
from megatron_railwave.exchange.layout import LayerLayout
from megatron_railwave.exchange.transport import FlatBlocks, Post, Program, Wait
from megatron_railwave.planner import chunk_sizes
from megatron_railwave.schedule import ExecutionSchedule, Phase, PhaseKind, RankView

__all__ = [
    "forward_moves",
    "backward_moves",
    "relay_forward",
    "relay_backward",
    "as_row_bytes",
    "part_view",
    "unpack_views",
]


def _copy_slices(
    copies: torch.Tensor, view: RankView, schedule: ExecutionSchedule
) -> tuple[dict[tuple[int, int], torch.Tensor], list[torch.Tensor]]:
    """Rows of the copies buffer per (round, sending GPU), rounds ascending, then GPUs; and the
    rows of each round (its GPUs' blocks, contiguous)."""
    out, rounds, offset = {}, [], 0
    for rnd in range(schedule.num_rounds):
        counts = view.counts(schedule.phase("dispatch", "deliver", rnd)).recv_Q
        rounds.append(copies[offset : offset + sum(counts)])
        for l, c in enumerate(counts):
            out[(rnd, l)] = copies[offset : offset + c]
            offset += c
    return out, rounds


def _flat(
    phase: Phase,
    schedule: ExecutionSchedule,
    local: int,
    send: torch.Tensor,
    send_rows: list[int],
    recv: torch.Tensor,
    recv_rows: list[int],
) -> FlatBlocks | None:
    """The phase as one buffer per direction (``transport.FlatBlocks``) where that is decided by
    the schedule alone, hence the same on every member of the group: every delivery round (all
    GPUs of the node are peers), and the rail phase when all node pairs travel in one wave (the
    egress rows of all destination nodes lie in one buffer) and the rail of GPU ``local`` is
    healthy on every node. Waves of a permutation keep the point-to-point form: one peer each.

    A failed rail keeps its group point-to-point: an all-to-all reaches every member, even with
    nothing to send, and waits forever on the member whose NIC is down (gloo; seen on the
    testbed), where the point-to-point form never posts to it."""
    if phase.kind == PhaseKind.RELAY:
        return None
    if phase.kind == PhaseKind.RAIL:
        topo = schedule.plan.topology
        if schedule.num_waves != 1 or not all(
            topo.gpu_rail_healthy(n, local) for n in range(topo.num_nodes)
        ):
            return None
    if send.shape[0] != sum(send_rows) or recv.shape[0] != sum(recv_rows):
        raise RuntimeError(
            f"internal: {phase.name}: flat buffers of {send.shape[0]} / {recv.shape[0]} rows for "
            f"{sum(send_rows)} / {sum(recv_rows)} rows of blocks"
        )
    return FlatBlocks(send=send, send_rows=send_rows, recv=recv, recv_rows=recv_rows)


def as_row_bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [n, bytes] uint8 view of the same memory (contiguous tensors; else a copy):
    a one-tensor message needs no packing copy."""
    width = math.prod(t.shape[1:])
    rows = t.reshape(t.shape[0], width)
    if not rows.is_contiguous() or width == 0:
        return ops.pack_rows([t], [None])
    return rows.view(torch.uint8)


def part_view(packed: torch.Tensor, specs: Sequence[ops.RowSpec], k: int) -> torch.Tensor | None:
    """Part ``k`` of packed rows as a strided view of its dtype (no copy), or None when its
    byte offset or the row width is not a multiple of its element size."""
    dtype, shape = specs[k]
    offset = ops.row_bytes(specs[:k])
    width = ops.row_bytes([specs[k]])
    size = dtype.itemsize
    if (
        offset % size
        or packed.shape[1] % size
        or width == 0
        or packed.stride(1) != 1
        or (packed.storage_offset() + offset) % size
    ):
        return None
    part = packed[:, offset : offset + width]
    if packed.shape[0] <= 1:
        part = part.contiguous()
    return part.view(dtype).reshape(packed.shape[0], *shape)


def unpack_views(packed: torch.Tensor, specs: Sequence[ops.RowSpec]) -> list[torch.Tensor]:
    """The parts of packed rows: views where alignment allows (one part: always), else copies."""
    if len(specs) == 1:
        view = part_view(packed, specs, 0)
        if view is not None:
            return [view]
    return ops.unpack_rows(packed, specs)


def _egress_parts(egress: torch.Tensor, view: RankView, chunks: int) -> list[torch.Tensor]:
    """The egress buffer's rows per (destination node, rail chunk), node-major: part d * chunks + k
    is what rail phase w * chunks + k carries to node d (w: the pair's wave)."""
    if chunks == 1:
        return list(egress.split(view.egress_N))
    return list(
        egress.split(
            chunk_sizes(np.asarray(view.egress_N, dtype=np.int64), chunks).reshape(-1).tolist()
        )
    )


def _take_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for packed byte rows: one row copy each (``ops.pack_rows``), where a plain
    ``index_select`` on uint8 moves byte by byte on the CPU."""
    return ops.pack_rows([rows], [index])


def _joins_next(phase: Phase, schedule: ExecutionSchedule) -> bool:
    """Whether the program posts the next delivery round before it waits for this one: round 0
    (the local node's copies) when round 1 does not depend on it (``_execute`` posts in schedule
    order and waits only for dependencies). Decided by the schedule alone: the same on every
    member of the node group, as joining two phases into one collective requires."""
    if phase.kind != PhaseKind.DELIVER or phase.step != 0 or schedule.num_rounds < 2:
        return False
    return phase.index not in schedule.phase(phase.direction, PhaseKind.DELIVER, 1).depends_on


def _post(
    phase: Phase,
    groups: RankGroups,
    sends: list,
    recvs: list,
    flat: FlatBlocks | None = None,
    schedule: ExecutionSchedule | None = None,
) -> Post:
    group = groups.rail if phase.kind == PhaseKind.RAIL else groups.node
    hold = flat is not None and schedule is not None and _joins_next(phase, schedule)
    return Post(
        tag=phase.index,
        stage=phase.name,
        group=group,
        sends=sends,
        recvs=recvs,
        flat=flat,
        hold=hold,
    )


def _relay_out(
    phase: Phase, groups: RankGroups, owner_rows: list[torch.Tensor], pool_rows: list[torch.Tensor]
) -> Post:
    """The relay phase: owner rows of category l != me go to GPU l; the kept rows (category me)
    are copied to the first pool block; pool block b >= 1 receives from the b-th other owner.
    No pool blocks (nothing relayed in): only the sends."""
    g, me = len(owner_rows) - 1, groups.local  # owner categories: egress GPUs 0..G-1, then local
    sends = [owner_rows[l] if l != me else None for l in range(g)]
    recvs: list = [None] * g
    if pool_rows:
        pool_rows[0].copy_(owner_rows[me])  # kept records leave on this GPU's own rail
        for block, owner in enumerate([o for o in range(g) if o != me], start=1):
            recvs[owner] = pool_rows[block]
    return _post(phase, groups, sends, recvs)


def _relay_back(
    phase: Phase, groups: RankGroups, pool_rows: list[torch.Tensor], out_rows: list[torch.Tensor]
) -> Post:
    """The mirror of ``_relay_out``: pool blocks return to their owners' egress categories."""
    g, me = len(pool_rows), groups.local
    out_rows[me].copy_(pool_rows[0])
    sends: list = [None] * g
    for block, owner in enumerate([o for o in range(g) if o != me], start=1):
        sends[owner] = pool_rows[block]
    recvs = [out_rows[l] if l != me else None for l in range(g)]
    return _post(phase, groups, sends, recvs)


def relay_forward(
    rows: torch.Tensor, *, layout: LayerLayout, schedule: ExecutionSchedule, groups: RankGroups
) -> Program:
    """The dispatch relay phase alone (owner -> proxy inside the node).

    Args:
        rows: [n_rec, b] uint8, this rank's records in owner order (``layout.owner_order``).

    Returns (as the program's result):
        [n_pool, b] uint8 pool: the kept records, then those relayed by each other owner in
        owner order (``layout.pool_counts``).
    """
    if layout.streamed is not None:
        raise ValueError(
            "relay_forward moves the relay as one phase; this layout's relay is streamed "
            "(PlanOptions.streamed): plan without streaming for a backend that moves the rest "
            "itself"
        )
    owner_rows = list(rows.split(layout.category_counts))
    pool = rows.new_empty((sum(layout.pool_counts), rows.shape[1]))
    ticket = yield _relay_out(
        schedule.phase("dispatch", PhaseKind.RELAY),
        groups,
        owner_rows,
        list(pool.split(layout.pool_counts)),
    )
    yield Wait(ticket=ticket)
    return pool


def relay_backward(
    pool: torch.Tensor,
    out: torch.Tensor,
    *,
    layout: LayerLayout,
    schedule: ExecutionSchedule,
    groups: RankGroups,
) -> Program:
    """The combine relay phase alone: pool rows back to their owners.

    Args:
        pool: [n_pool, b] uint8 in ``relay_forward``'s pool order.
        out: [n_rec, b] uint8 in owner order; its egress categories (0..G-1) are written here,
            the local-node category is left as it is.
    """
    ticket = yield _relay_back(
        schedule.phase("combine", PhaseKind.RELAY),
        groups,
        list(pool.split(layout.pool_counts)),
        list(out.split(layout.category_counts)),
    )
    yield Wait(ticket=ticket)


def _execute(
    phases: tuple[Phase, ...], start: Callable[[Phase], Post], complete: Callable[[Phase], None]
) -> Program:
    """The schedule's executor: post each phase (``start``) once every phase in its ``depends_on``
    has completed (``complete`` consumes its result), then wait for the rest in order."""
    tickets: dict[int, object] = {}
    by_index = {p.index: p for p in phases}
    for phase in phases:
        for dep in phase.depends_on:
            if dep in tickets:
                yield Wait(ticket=tickets.pop(dep))
                complete(by_index[dep])
        tickets[phase.index] = yield start(phase)
    for index in list(tickets):
        yield Wait(ticket=tickets.pop(index))
        complete(by_index[index])


def forward_moves(
    rows: torch.Tensor,
    *,
    layout: LayerLayout,
    view: RankView,
    schedule: ExecutionSchedule,
    groups: RankGroups,
) -> Program:
    """Dispatch-direction program.

    Args:
        rows: [n_rec, b] uint8, this rank's records in owner order (``layout.owner_order``).

    Returns (as the program's result):
        [n_copy, b] uint8 copies received, ordered by (round, sending GPU).
    """
    g, me, chunks = schedule.plan.topology.gpus_per_node, view.local, schedule.plan.chunks
    owner_rows = list(rows.split(layout.category_counts))
    # Without records relayed in, the kept rows are the egress rows already: no pool, no copy.
    pool = rows.new_empty((0 if layout.egress_is_kept else sum(layout.pool_counts), rows.shape[1]))
    pool_rows = [] if layout.egress_is_kept else list(pool.split(layout.pool_counts))
    copies = rows.new_empty((layout.num_copies, rows.shape[1]))
    copy_rows, round_rows = _copy_slices(copies, view, schedule)
    arrivals: dict[int, torch.Tensor] = {0: owner_rows[g]}
    egress: list[torch.Tensor] = []  # the egress buffer, once the relay is done
    egress_rows: list[torch.Tensor] = []
    streamed = layout.streamed
    if streamed is not None:  # relay phase u moves slice u of every owner and pool block
        owner_UL = [list(b.split(c)) for b, c in zip(owner_rows, streamed.owner_UL)]
        pool_UB = [list(b.split(c)) for b, c in zip(pool_rows, streamed.pool_UB)]

    def start(phase: Phase) -> Post:
        counts = view.counts(phase)
        if phase.kind == PhaseKind.RELAY:
            if streamed is None:
                return _relay_out(phase, groups, owner_rows, pool_rows)
            u = phase.step
            return _relay_out(
                phase, groups, [b[u] for b in owner_UL] + [owner_rows[g]], [b[u] for b in pool_UB]
            )
        if phase.kind == PhaseKind.RAIL:
            buf = rows.new_empty((sum(counts.recv_Q), rows.shape[1]))
            arrivals[phase.step + 1] = buf
            if streamed is None:
                send_all, k = egress[0], phase.step % chunks
                sends = [
                    egress_rows[d * chunks + k] if c else None for d, c in enumerate(counts.send_Q)
                ]
            else:
                # The egress rows of this rail phase's chunks, gathered from the pool as soon as
                # its relay part has landed (the earlier parts' rows are there already).
                send_all = _take_rows(pool, streamed.rail_pool_index[phase.step])
                parts = iter(send_all.split([c for c in counts.send_Q if c]))
                sends = [next(parts) if c else None for c in counts.send_Q]
            return _post(
                phase,
                groups,
                sends,
                list(buf.split(counts.recv_Q)),
                _flat(phase, schedule, me, send_all, counts.send_Q, buf, counts.recv_Q),
            )
        rnd = phase.step
        delivered_all = _take_rows(arrivals.pop(rnd), layout.deliver_index[rnd])
        delivered = delivered_all.split(counts.send_Q)
        copy_rows[(rnd, me)].copy_(delivered[me])
        return _post(
            phase,
            groups,
            [delivered[j] if j != me else None for j in range(g)],
            [copy_rows[(rnd, l)] if l != me else None for l in range(g)],
            _flat(
                phase, schedule, me, delivered_all, counts.send_Q, round_rows[rnd], counts.recv_Q
            ),
            schedule,
        )

    def complete(phase: Phase) -> None:
        if phase.kind == PhaseKind.RELAY and streamed is None:
            # Without relayed records the kept rows are already in egress order (node ascending).
            egress.append(
                owner_rows[me] if layout.egress_is_kept else _take_rows(pool, layout.egress_perm)
            )
            egress_rows.extend(_egress_parts(egress[0], view, chunks))

    yield from _execute(schedule.dispatch_phases(), start, complete)
    return copies


def _reduce_rows(
    received: torch.Tensor,
    index: torch.Tensor,
    num_rows: int,
    specs: Sequence[ops.RowSpec],
    max_fanout: int,
) -> torch.Tensor:
    """Sum returned copies into their arrival rows (copies of one row in index order)."""
    parts = unpack_views(received, specs)
    summed = [
        ops.segment_sum(p, index, num_rows, out_dtype=p.dtype, max_segment_len=max_fanout)
        for p in parts
    ]
    return (
        as_row_bytes(summed[0]) if len(summed) == 1 else ops.pack_rows(summed, [None] * len(summed))
    )


def backward_moves(
    rows: torch.Tensor,
    specs: Sequence[ops.RowSpec],
    *,
    layout: LayerLayout,
    view: RankView,
    schedule: ExecutionSchedule,
    groups: RankGroups,
) -> Program:
    """Combine-direction program (the adjoint of ``forward_moves``).

    Args:
        rows: [n_copy, b] uint8, one row per copy in ``forward_moves``' order.
        specs: the row layout (``ops.RowSpec`` list); the floating parts are summed.

    Returns (as the program's result):
        [n_rec, b] uint8, this rank's records in owner order.
    """
    g, me, chunks = schedule.plan.topology.gpus_per_node, view.local, schedule.plan.chunks
    width = rows.shape[1]
    copy_rows, round_rows = _copy_slices(rows, view, schedule)
    out = rows.new_empty((view.num_records, width))
    out_rows = list(out.split(layout.category_counts))
    egress = rows.new_empty((sum(view.egress_N), width))
    egress_rows = _egress_parts(egress, view, chunks)
    streamed = layout.streamed
    if streamed is not None:
        out_UL = [list(b.split(c)) for b, c in zip(out_rows, streamed.owner_UL)]
    returned: dict[int, torch.Tensor] = {}
    reduced: dict[int, torch.Tensor] = {}

    def start(phase: Phase) -> Post:
        counts = view.counts(phase)
        if phase.kind == PhaseKind.DELIVER:
            rnd = phase.step
            buf = rows.new_empty((sum(counts.recv_Q), width))
            returned[rnd] = buf
            back = list(buf.split(counts.recv_Q))
            back[me].copy_(copy_rows[(rnd, me)])
            return _post(
                phase,
                groups,
                [copy_rows[(rnd, l)] if l != me else None for l in range(g)],
                [back[j] if j != me else None for j in range(g)],
                _flat(phase, schedule, me, round_rows[rnd], counts.send_Q, buf, counts.recv_Q),
                schedule,
            )
        if phase.kind == PhaseKind.RAIL:
            arrived = reduced.pop(phase.step + 1)
            k = phase.step % chunks
            return _post(
                phase,
                groups,
                list(arrived.split(counts.send_Q)),
                [egress_rows[d * chunks + k] if c else None for d, c in enumerate(counts.recv_Q)],
                _flat(phase, schedule, me, arrived, counts.send_Q, egress, counts.recv_Q),
            )
        if streamed is not None:  # relay phase u returns the pool rows of rail phase u
            pool_u = _take_rows(egress, streamed.relay_back_index[phase.step])
            return _relay_back(
                phase,
                groups,
                list(pool_u.split([b[phase.step] for b in streamed.pool_UB])),
                [b[phase.step] for b in out_UL] + [out_rows[g]],
            )
        pool = egress if layout.egress_is_kept else _take_rows(egress, layout.egress_inverse)
        return _relay_back(phase, groups, list(pool.split(layout.pool_counts)), out_rows)

    def complete(phase: Phase) -> None:
        if phase.kind == PhaseKind.DELIVER:
            rnd = phase.step
            reduced[rnd] = _reduce_rows(
                returned.pop(rnd), layout.deliver_index[rnd], layout.arrivals[rnd], specs, g
            )

    yield from _execute(schedule.combine_phases(), start, complete)
    out_rows[g].copy_(reduced.pop(0))  # round 0: the local node's records, summed here
    return out
