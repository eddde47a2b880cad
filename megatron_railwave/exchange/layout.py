"""Rank-local index maps of one dispatch/combine, derived from the plan and this rank's records.

Letters: N nodes, G GPUs per node, n_rec records of this rank (canonical order: destination
node, target mask, token), V' delivery rounds.

Owner side (stage 1): records that leave on another local GPU are sent to it grouped by egress
GPU; each group stays in canonical order, so within it records are sorted by destination node.
Egress side (stage 2): the egress buffer of GPU (s, l) is ordered by (destination node, owner),
built from this GPU's kept records and the chunks received from each owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planner import PathPlan, RankSplits, RecordRoutes

__all__ = ["OwnerLayout", "owner_layout", "DeliveryLayout", "delivery_layout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnerLayout:
    """Attributes:
        relay_idx_G: per local GPU l, [n_l] int64 indices (into the canonical records) relayed to
            l over NVLink; empty for this GPU itself.
        keep_idx: [n_keep] int64, remote records that leave on this GPU's own rail.
        local_idx: [n_local] int64, records for this rank's own node (no rail).
        egress_perm: [n_egress] int64, permutation of the pool (kept records, then the chunks
            received from owners 0..G-1 in order) into the egress buffer order (node, owner).
        egress_counts_N: [N] rows of the egress buffer per destination node (own node: 0).
    """

    relay_idx_G: list[torch.Tensor]
    keep_idx: torch.Tensor
    local_idx: torch.Tensor
    egress_perm: torch.Tensor
    egress_counts_N: list[int]


def owner_layout(plan: PathPlan, splits: RankSplits, routes: RecordRoutes, node: int, local: int) -> OwnerLayout:
    """Index maps of rank (node, local). Host sync: no (CPU tensors)."""
    g = plan.topology.gpus_per_node
    n = plan.topology.num_nodes
    is_local = routes.node_R == node
    remote_idx = torch.nonzero(~is_local).squeeze(1)
    egress = routes.egress_R[remote_idx]
    order = torch.sort(egress, stable=True).indices
    by_egress = remote_idx[order]
    counts = torch.bincount(egress, minlength=g).tolist()
    chunks = list(by_egress.split(counts))
    keep_idx = chunks[local]
    relay_idx = [c if l != local else c[:0] for l, c in enumerate(chunks)]
    if [c.numel() for c in relay_idx] != splits.relay_send_G:
        raise RuntimeError(
            f"internal: relay sizes {[c.numel() for c in relay_idx]} differ from plan "
            f"{splits.relay_send_G} on node {node} GPU {local}"
        )

    # Pool = [kept records] + [chunk from owner o for o != local]; key = node * G + owner.
    remote_N = torch.ones(n, dtype=torch.bool)
    remote_N[node] = False
    relay_in = plan.relay_NNGG[node, :, :, local] * remote_N.unsqueeze(1)  # [d, owner]
    node_ids = torch.arange(n, dtype=torch.int64)
    keys = [routes.node_R[keep_idx] * g + local]
    for owner in range(g):
        if owner == local:
            continue
        keys.append(torch.repeat_interleave(node_ids, relay_in[:, owner]) * g + owner)
    pool_keys = torch.cat(keys)
    egress_perm = torch.sort(pool_keys, stable=True).indices
    egress_counts = plan.quota_NNG[node, :, local].clone()
    egress_counts[node] = 0
    return OwnerLayout(
        relay_idx_G=relay_idx,
        keep_idx=keep_idx,
        local_idx=torch.nonzero(is_local).squeeze(1),
        egress_perm=egress_perm,
        egress_counts_N=egress_counts.tolist(),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveryLayout:
    """Stage-3 index maps of the arrival GPU (this rank), from the global counts alone.

    Attributes:
        deliver_idx: per round, per target GPU j, [n_vj] int64 indices into that round's
            arrivals (round 0: this rank's records for its own node; round v + 1: the records
            of rail wave v, source nodes ascending).
        arrivals: per round, records arriving at this GPU.
        arrival_masks: per round, [arrivals] int64 target masks (for internal checks).
        local_arrivals: this rank's records for its own node (all of round 0).
    """

    deliver_idx: list[list[torch.Tensor]]
    arrivals: list[int]
    arrival_masks: list[torch.Tensor]
    local_arrivals: int


def delivery_layout(plan: PathPlan, demand, routes: RecordRoutes, owner: OwnerLayout, num_rounds: int,
                    node: int, local: int) -> DeliveryLayout:
    """Which arriving record goes to which local GPU, per round. Host sync: no (CPU only)."""
    from ..planner import arrival_mask_counts_NGM

    topo = plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    m = 1 << g
    counts_NGM = arrival_mask_counts_NGM(plan, demand, node, local)
    mask_ids = torch.arange(m, dtype=torch.int64).repeat(g)
    local_masks = routes.mask_R[owner.local_idx]
    wave_of_src = plan.pair_wave_NN[:, node].tolist()
    per_round: list[list[torch.Tensor]] = [[] for _ in range(num_rounds)]
    per_round[0].append(local_masks)
    for src in range(n):
        if src == node:
            continue
        per_round[wave_of_src[src] + 1].append(torch.repeat_interleave(mask_ids, counts_NGM[src].flatten()))
    deliver_idx, arrivals, masks_out = [], [], []
    bits = torch.arange(g, dtype=torch.int64)
    for parts in per_round:
        masks = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        hit = ((masks.unsqueeze(1) >> bits) & 1).bool()  # [arrivals, G]
        deliver_idx.append([torch.nonzero(hit[:, j]).squeeze(1) for j in range(g)])
        arrivals.append(int(masks.numel()))
        masks_out.append(masks)
    return DeliveryLayout(deliver_idx=deliver_idx, arrivals=arrivals, arrival_masks=masks_out,
                          local_arrivals=int(owner.local_idx.numel()))
