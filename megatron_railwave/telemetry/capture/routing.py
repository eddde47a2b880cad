"""Conversions between routing maps, top-k expert ids and demand counts.

Letters: W ranks (N nodes x G GPUs), T tokens of one rank, K top-k, E experts, M = 2**G masks.

A replay stores routing compactly as top-k expert ids, ``[W, T, K]`` int16 with -1 meaning "no
expert" (a padding token, or a token routed to fewer than K experts). The exchange needs boolean
routing maps and the planner needs ``DemandCounts``; both follow from the ids. Experts are placed
contiguously as in ``traffic``: expert e lives on rank e // (E / W).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "NO_EXPERT",
    "topk_ids_from_routing_map",
    "routing_map_from_topk_ids",
    "demand_from_topk_ids",
]

NO_EXPERT = -1
"""Sentinel of an empty top-k slot."""


def topk_ids_from_routing_map(routing_map_TE: torch.Tensor | np.ndarray, topk: int) -> np.ndarray:
    """Top-k expert ids of a boolean routing map.

    Args:
        routing_map_TE: [T, E] bool, rank-local, CPU or GPU; True where the token goes to the
        expert.
        topk: K, slots per token; a row may have fewer True entries (the rest become -1).

    Returns:
        [T, K] int16 on the host: each row's experts in ascending order, then -1 padding.
        Host sync: yes when the map is on a GPU.

    Raises:
        ValueError: a row has more than ``topk`` experts, or E does not fit int16.
    """
    if isinstance(routing_map_TE, torch.Tensor):
        routing_map_TE = routing_map_TE.detach().to("cpu").numpy()  # host sync
    routing_map_TE = np.asarray(routing_map_TE, dtype=bool)
    if routing_map_TE.ndim != 2:
        raise ValueError(f"routing map must be [T, E], got shape {routing_map_TE.shape}")
    num_tokens, num_experts = routing_map_TE.shape
    if num_experts > np.iinfo(np.int16).max:
        raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")
    per_row = routing_map_TE.sum(axis=1)
    if num_tokens and int(per_row.max()) > topk:
        row = int(per_row.argmax())
        raise ValueError(
            f"routing map row {row} selects {int(per_row[row])} experts but topk={topk}; pass the "
            "model's router top-k (moe_router_topk)"
        )
    # A stable sort of "not selected" puts the selected experts first, in ascending id order.
    order_TE = np.argsort(~routing_map_TE, axis=1, kind="stable")[:, :topk]
    ids_TK = order_TE.astype(np.int16)
    ids_TK[np.arange(topk)[None, :] >= per_row[:, None]] = NO_EXPERT
    return ids_TK


def routing_map_from_topk_ids(
    topk_ids_TK: np.ndarray | torch.Tensor, num_experts: int
) -> torch.Tensor:
    """[T, E] bool CPU routing map of one rank's top-k ids (-1 slots select nothing)."""
    ids_TK = np.asarray(topk_ids_TK).astype(np.int64)
    num_tokens = ids_TK.shape[0]
    # Column E collects the -1 slots and is dropped.
    out_TE = np.zeros((num_tokens, num_experts + 1), dtype=bool)
    out_TE[np.arange(num_tokens)[:, None], np.where(ids_TK < 0, num_experts, ids_TK)] = True
    return torch.from_numpy(np.ascontiguousarray(out_TE[:, :num_experts]))


def demand_from_topk_ids(
    topk_ids_WTK: np.ndarray | torch.Tensor, topo: RailTopology, num_experts: int
) -> DemandCounts:
    """Global demand counts of one layer straight from the ids (no [T, E] maps are built).

    Args:
        topk_ids_WTK: [W, T, K] integer expert ids, -1 = empty slot; global (every rank's tokens).
        topo: the cluster, W = N * G.
        num_experts: E, divisible by W.

    Returns:
        ``DemandCounts`` equal to ``DemandCounts.from_routing_maps`` of the same routing.
    """
    ids_WTK = np.asarray(topk_ids_WTK).astype(np.int64)
    world = ids_WTK.shape[0]
    topo.check_world_size(world)
    if num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {world}"
        )
    n, g = topo.num_nodes, topo.gpus_per_node
    num_masks = 1 << g
    # Sorted ids put experts of one owner GPU next to each other, so a GPU is counted once.
    ids_WTK = np.sort(ids_WTK, axis=-1)
    valid = ids_WTK >= 0
    owner = np.where(valid, ids_WTK // (num_experts // world), -1)
    first = valid.copy()
    first[..., 1:] &= owner[..., 1:] != owner[..., :-1]
    bit = np.where(first, np.left_shift(1, owner % g), 0)
    node = owner // g
    masks_WTN = np.stack([np.where(node == d, bit, 0).sum(axis=-1) for d in range(n)], axis=-1)
    src = np.arange(world).reshape(world, 1, 1)
    keys = ((src * n + np.arange(n)) * num_masks + masks_WTN).ravel()
    records = np.bincount(keys, minlength=world * n * num_masks).reshape(world, n, num_masks)
    records[:, :, 0] = 0
    experts = np.bincount((src * num_experts + ids_WTK)[valid], minlength=world * num_experts)
    return DemandCounts(
        records_WNM=torch.from_numpy(records.astype(np.int64)),
        experts_WE=torch.from_numpy(experts.reshape(world, num_experts).astype(np.int64)),
    )
