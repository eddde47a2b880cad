"""The data movement of dispatch (records -> copies) and combine (copies -> records).

Letters: N nodes, G GPUs per node, n_rec records of this rank, n_copy copies received by this
rank, V' delivery rounds.

Dispatch, for every tensor that travels with the records (payload, probs, metadata):
  1. relay: owner -> proxy inside the node (node group);
  2. rails: per wave, GPU (s, l) -> GPU (d, l) for the wave's pairs (rail group); NATIVE and RAIL
     have a single window, so all remote transfers are posted at once;
  3. delivery: per round, GPU (d, l) -> every GPU (d, j) named in the record's target mask
     (node group). Stage 3 of round v runs while stage 2 of wave v + 1 is in flight.
Combine is the exact adjoint: the same messages backwards, and where dispatch fanned a record out
to several GPUs, combine sums their contributions in local-GPU order (a fixed order, so every
path gives bitwise-identical sums).
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from ..planner import PathPlan, RankSplits
from .groups import RailGroups
from .layout import DeliveryLayout, OwnerLayout
from .p2p import PendingExchange, start_exchange

__all__ = ["dispatch_move", "combine_move", "META_MASK_COL"]

META_MASK_COL = 2
"""Column of the target mask in the int64 record metadata [src_rank, token, mask, ...]."""


def _rail_link(plan: PathPlan, node: int, local: int):
    rail = plan.topology.rail_of_gpu[local]

    def describe(peer_node: int) -> str:
        return f"rail {rail} between node {node} (GPU {local}) and node {peer_node}"

    return describe


def _empty_like_rows(t: torch.Tensor) -> torch.Tensor:
    return t[:0]


def _dispatch_move(
    tensors: list[torch.Tensor],
    *,
    plan: PathPlan,
    splits: RankSplits,
    owner: OwnerLayout,
    groups: RailGroups,
    delivery: DeliveryLayout,
    check_masks_from: "Callable[[torch.Tensor], torch.Tensor] | None" = None,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Move per-record tensors from their owner to every target GPU.

    Args:
        tensors: each [n_rec, ...] in canonical record order (rank-local).
        delivery: stage-3 index maps (``layout.delivery_layout``, from the counts alone).
        check_masks_from: index of an int64 metadata tensor whose column ``META_MASK_COL`` holds
            the target masks; on CPU they are checked against the masks the plan predicts
            (an internal invariant; skipped on GPU to avoid a device sync).

    Returns:
        Per tensor, [n_copy, ...]: copies received, ordered by round, then sending local GPU.
    """
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    node, me = groups.node, groups.local
    # Stage 1: relay surplus records to their proxies.
    send1 = [[t[idx] for idx in owner.relay_idx_G] for t in tensors]
    recv1 = start_exchange(send1, splits.relay_recv_G, group=groups.node_group, self_index=me).wait()
    egress = []
    for i, t in enumerate(tensors):
        pool = torch.cat([t[owner.keep_idx]] + [recv1[i][o] for o in range(g) if o != me])
        egress.append(pool[owner.egress_perm].split(owner.egress_counts_N))
    local_part = [t[owner.local_idx] for t in tensors]

    num_waves = plan.num_waves
    wave_of_dest = plan.pair_wave_NN[node].tolist()

    def start_wave(w: int) -> PendingExchange:
        send = [[chunks[d] if wave_of_dest[d] == w else _empty_like_rows(chunks[d]) for d in range(n)]
                for chunks in egress]
        return start_exchange(send, splits.rail_recv_VN[w], group=groups.rail_group, self_index=node,
                              describe=_rail_link(plan, node, me), timeout_s=timeout_s)

    pending = start_wave(0) if num_waves > 0 else None
    out: list[list[torch.Tensor]] = [[] for _ in tensors]
    for rnd in range(splits.num_rounds):
        if rnd == 0:
            # The local node's records need no rail: deliver them while wave 0 is in flight.
            arrivals = local_part
        else:
            received = pending.wait()
            # Post the next wave before delivering this one: stage 3 of wave v overlaps stage 2
            # of wave v + 1.
            pending = start_wave(rnd) if rnd < num_waves else None
            arrivals = []
            for i in range(len(tensors)):
                parts = [received[i][s] for s in range(n) if s != node]
                arrivals.append(torch.cat(parts) if parts else local_part[i][:0])
        if check_masks_from is not None and arrivals[0].device.type == "cpu":
            got = check_masks_from(arrivals[0])
            if not torch.equal(got, delivery.arrival_masks[rnd]):
                raise RuntimeError(
                    f"internal: arriving records on node {node} GPU {me} round {rnd} do not match "
                    "the plan's predicted masks")
        idx = delivery.deliver_idx[rnd]
        send3 = [[a[ix] for ix in idx] for a in arrivals]
        recv3 = start_exchange(send3, splits.deliver_recv_VG[rnd], group=groups.node_group,
                               self_index=me).wait()
        for i in range(len(tensors)):
            out[i].extend(recv3[i])
    return [torch.cat(parts) if parts else tensors[i][:0] for i, parts in enumerate(out)]


def _combine_move(
    tensors: list[torch.Tensor],
    *,
    plan: PathPlan,
    splits: RankSplits,
    owner: OwnerLayout,
    groups: RailGroups,
    delivery: DeliveryLayout,
    num_records: int,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Adjoint of ``dispatch_move``: per-copy tensors back to per-record tensors at the owner,
    summing the copies of one record in local-GPU order.

    Args:
        tensors: each [n_copy, ...] in the order ``dispatch_move`` returned.
        num_records: n_rec of this rank.

    Returns:
        Per tensor, [n_rec, ...] in canonical record order.
    """
    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    node, me = groups.node, groups.local
    num_waves = plan.num_waves
    sizes = [c for rnd in splits.deliver_recv_VG for c in rnd]
    pieces = [t.split(sizes) for t in tensors]

    egress_chunks: list[list[torch.Tensor | None]] = [[None] * n for _ in tensors]
    local_part: list[torch.Tensor] = []
    pending: PendingExchange | None = None
    pending_wave = -1

    def finish_wave() -> None:
        if pending is None:
            return
        received = pending.wait()
        for i in range(len(tensors)):
            for d in range(n):
                if plan.pair_wave_NN[node, d] == pending_wave:
                    egress_chunks[i][d] = received[i][d]

    for rnd in range(splits.num_rounds):
        # Stage 3 backwards: every target GPU returns the copies it got from this GPU.
        base = rnd * g
        send3 = [[pieces[i][base + j] for j in range(g)] for i in range(len(tensors))]
        recv3 = start_exchange(send3, splits.deliver_send_VG[rnd], group=groups.node_group,
                               self_index=me).wait()
        idx = torch.cat(delivery.deliver_idx[rnd])
        summed = []
        for i, t in enumerate(tensors):
            acc = t.new_zeros((delivery.arrivals[rnd], *t.shape[1:]))
            # index_add_ walks the index in order: copies from GPU 0, then 1, ... (fixed order).
            summed.append(acc.index_add_(0, idx, torch.cat(recv3[i])))
        if rnd == 0:
            local_part = summed  # round 0 is the local node's records only
            continue
        # Stage 2 backwards: return each source node's records of wave rnd - 1 on this rail.
        finish_wave()
        wave = rnd - 1
        send2 = [list(s.split(splits.rail_recv_VN[wave])) for s in summed]
        pending = start_exchange(send2, splits.rail_send_VN[wave], group=groups.rail_group,
                                 self_index=node, describe=_rail_link(plan, node, me),
                                 timeout_s=timeout_s)
        pending_wave = wave
    finish_wave()

    results = []
    for i, t in enumerate(tensors):
        chunks = [c if c is not None else t.new_zeros((0, *t.shape[1:])) for c in egress_chunks[i]]
        egress = torch.cat(chunks)
        pool = torch.empty_like(egress)
        pool[owner.egress_perm] = egress
        keep_n = int(owner.keep_idx.numel())
        relay_sizes = [splits.relay_recv_G[o] if o != me else 0 for o in range(g)]
        back = [pool[:keep_n]]
        rest = list(pool[keep_n:].split([s for o, s in enumerate(relay_sizes) if o != me]))
        send1 = []
        it = iter(rest)
        for o in range(g):
            send1.append(next(it) if o != me else pool[:0])
        recv1 = start_exchange([send1], splits.relay_send_G, group=groups.node_group,
                               self_index=me).wait()[0]
        out = t.new_zeros((num_records, *t.shape[1:]))
        out[owner.keep_idx] = back[0]
        for o in range(g):
            if o != me and owner.relay_idx_G[o].numel():
                out[owner.relay_idx_G[o]] = recv1[o]
        out[owner.local_idx] = local_part[i]
        results.append(out)
    return results


# ---------------------------------------------------------------------- packing
# Every tensor that travels with the records goes in ONE message per peer: the rows of all
# tensors are laid side by side as bytes (dispatch) or as columns of one dtype (combine sums,
# so it can only pack tensors of the same dtype). Fewer, larger messages: this is most of the
# per-call cost on small layers.

def _pack_bytes(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    cols, spec = [], []
    for t in tensors:
        flat = t.reshape(t.shape[0], _row_width(t)).contiguous()
        as_bytes = flat.view(torch.uint8) if flat.shape[1] else flat.to(torch.uint8)
        cols.append(as_bytes)
        spec.append((t.dtype, tuple(t.shape[1:]), as_bytes.shape[1]))
    return torch.cat(cols, dim=1), spec


def _row_width(t: torch.Tensor) -> int:
    width = 1
    for size in t.shape[1:]:
        width *= size
    return width


def _unpack_bytes(packed: torch.Tensor, spec: list[tuple]) -> list[torch.Tensor]:
    out, offset = [], 0
    for dtype, rest, width in spec:
        part = packed[:, offset:offset + width].contiguous()
        out.append(part.view(dtype).reshape(packed.shape[0], *rest))
        offset += width
    return out


def dispatch_move(tensors: list[torch.Tensor], *, check_masks_from: int | None = None,
                  **kwargs) -> list[torch.Tensor]:
    """Move per-record tensors from their owner to every target GPU (see ``_dispatch_move``).

    Args:
        tensors: each [n_rec, ...] in canonical record order (rank-local); any dtypes.
        check_masks_from: index of the int64 metadata tensor whose column ``META_MASK_COL`` holds
            the target masks; on CPU the arriving masks are checked against the plan's.
        **kwargs: plan, splits, owner, groups, delivery, timeout_s.

    Returns:
        Per tensor, [n_copy, ...]: copies received, ordered by round, then sending local GPU.
    """
    if len(tensors) == 1:
        return _dispatch_move(tensors, **kwargs)
    packed, spec = _pack_bytes(tensors)
    check = None
    if check_masks_from is not None:
        def check(rows: torch.Tensor) -> torch.Tensor:
            return _unpack_bytes(rows, spec)[check_masks_from][:, META_MASK_COL]
    return _unpack_bytes(_dispatch_move([packed], check_masks_from=check, **kwargs)[0], spec)


def combine_move(tensors: list[torch.Tensor], **kwargs) -> list[torch.Tensor]:
    """Copies back to records at the owner, summed in local-GPU order (see ``_combine_move``).

    Tensors of one dtype travel as one message (columns side by side); others separately.
    """
    if len(tensors) == 1 or len({t.dtype for t in tensors}) != 1:
        return _combine_move(tensors, **kwargs)
    flats = [t.reshape(t.shape[0], _row_width(t)) for t in tensors]
    widths = [f.shape[1] for f in flats]
    moved = _combine_move([torch.cat(flats, dim=1)], **kwargs)[0]
    return [part.reshape(part.shape[0], *t.shape[1:])
            for part, t in zip(moved.split(widths, dim=1), tensors)]
