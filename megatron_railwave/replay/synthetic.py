"""Seeded synthetic routing with hot experts and per-rank preferences.

Letters: W ranks, T tokens per rank, E experts, K top-k, N nodes.

Two independent sources of skew, as in the paper's observation that expert-load balance explains
little of source-rail imbalance:
  * expert popularity: a log-normal popularity per expert, tuned so that max/mean expert load is
    about ``hot_ratio``;
  * per-rank locality: each source rank draws a preference strength for its *own* node's experts
    (a rank that keeps most tokens local sends few remote records, its neighbours many), which is
    what makes some source rails hot.
"""

from __future__ import annotations

import math

import torch

from ..topology import RailTopology

__all__ = ["synthetic_routing_maps"]


def synthetic_routing_maps(
    topo: RailTopology,
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    seed: int,
    hot_ratio: float = 8.0,
    locality: float = 6.0,
) -> list[torch.Tensor]:
    """One [T, E] bool routing map per rank (top-k True per row).

    Args:
        topo: the cluster (W = N * G ranks; experts contiguous, E / W per rank).
        num_tokens: T, tokens per rank.
        num_experts: E.
        topk: K experts per token.
        seed: generator seed (same seed, same maps).
        hot_ratio: target max/mean expert popularity.
        locality: maximum per-rank log-odds bonus for experts on the rank's own node; each rank
            draws its bonus uniformly in [0, locality], so 0 disables rail skew from locality.
    """
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
    gen = torch.Generator().manual_seed(int(seed))
    world = topo.world_size
    per_rank = num_experts // world if num_experts % world == 0 else None
    if per_rank is None:
        raise ValueError(f"num_experts={num_experts} must be divisible by world size {world}")
    # Log-normal popularity; sigma chosen so that the max of E draws is ~hot_ratio x the mean.
    sigma = math.sqrt(2 * math.log(max(hot_ratio, 1.0001))) / max(math.sqrt(2 * math.log(num_experts)), 1.0) * 1.6
    log_pop = torch.randn(num_experts, generator=gen) * sigma
    node_of_expert = torch.arange(num_experts) // (per_rank * topo.gpus_per_node)
    bonus_W = torch.rand(world, generator=gen) * locality
    maps = []
    for rank in range(world):
        node = topo.node_of(rank)
        gumbel = -torch.log(-torch.log(torch.rand(num_tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)))
        scores = gumbel + log_pop + bonus_W[rank] * (node_of_expert == node)
        idx = scores.topk(topk, dim=1).indices
        routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
        routing.scatter_(1, idx, True)
        maps.append(routing)
    return maps
