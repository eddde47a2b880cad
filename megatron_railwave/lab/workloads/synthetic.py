"""Seeded synthetic routing: a fast top-k sampler, hot experts and per-rank preferences.

Letters: W ranks, T tokens per rank, E experts, K top-k, N nodes, G GPUs per node.

Every token of rank w picks K distinct experts by successive sampling without replacement from
the rank's expert weights ``weights_WE[w]`` (the same distribution as Gumbel top-k of the log
weights, i.e. of a softmax router with noise). It is drawn as "sample with replacement, skip
repeats, keep the first K distinct", which needs about K draws per token instead of E random
keys and a top-k over E, so 45 layers x 32 ranks x 4096 tokens take seconds.

``synthetic_routing_maps`` keeps the original simple workload (two independent sources of skew,
as in the paper's observation that expert-load balance explains little of source-rail
imbalance):
  * expert popularity: a log-normal popularity per expert, tuned so that max/mean expert load is
    about ``hot_ratio``;
  * per-rank locality: each source rank draws a preference strength for its *own* node's experts
    (a rank that keeps most tokens local sends few remote records, its neighbours many), which is
    what makes some source rails hot.
The GLM-4.5-Air workload (``workloads.glm``) uses the same sampler with per-layer parameters.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from megatron_railwave.telemetry.capture import NO_EXPERT, routing_map_from_topk_ids
from megatron_railwave.topology import RailTopology

__all__ = [
    "sample_topk_ids",
    "synthetic_topk_ids",
    "synthetic_routing_maps",
    "one_destination_topk_ids",
]

_MAX_ROUNDS = 4
"""Rounds of K extra draws for unfinished tokens before the exact Gumbel completion."""


def sample_topk_ids(
    weights_WE: np.ndarray, *, num_tokens: int | np.ndarray, topk: int, rng: np.random.Generator
) -> np.ndarray:
    """K distinct experts per token, by successive sampling from per-rank weights.

    Args:
        weights_WE: [W, E] non-negative float, global; row w is rank w's unnormalised expert
            weights (each row needs at least K positive entries).
        num_tokens: T, tokens per rank, or [W] int tokens of every rank (ranks may differ).
        topk: K.
        rng: the numpy generator (same state, same ids).

    Returns:
        [W, T_max, K] int16, each row ascending (the order within a token carries no meaning);
        rank w's rows past its token count are -1 (empty tokens).
    """
    weights_WE = np.asarray(weights_WE, dtype=np.float64)
    world, num_experts = weights_WE.shape
    tokens_W = np.broadcast_to(np.asarray(num_tokens, dtype=np.int64), (world,))
    if int(tokens_W.min()) < 0:
        raise ValueError(f"token counts must be >= 0, got {int(tokens_W.min())}")
    width = int(tokens_W.max()) if world else 0
    positive_W = (weights_WE > 0).sum(axis=1)
    if topk > num_experts or int(positive_W.min()) < topk:
        raise ValueError(
            f"cannot draw topk={topk} distinct experts: E={num_experts}, fewest positive weights "
            f"in a row = {int(positive_W.min())}"
        )
    cdf_WE = np.cumsum(weights_WE, axis=1)
    cdf_WE /= cdf_WE[:, -1:]
    # Rank w's CDF shifted into (w, w + 1]: one searchsorted serves every rank.
    flat_cdf = (cdf_WE + np.arange(world)[:, None]).ravel()
    rank_X = np.repeat(np.arange(world), tokens_W)

    def draw(rank_x: np.ndarray, count: int) -> np.ndarray:
        u = rng.random((rank_x.size, count)) + rank_x[:, None]
        ids = np.searchsorted(flat_cdf, u, side="right") - rank_x[:, None] * num_experts
        return np.clip(ids, 0, num_experts - 1)  # guards rounding at the last bin only

    out_XK = np.empty((rank_X.size, topk), dtype=np.int16)
    pending_X = np.arange(rank_X.size)
    draws_XL = draw(rank_X, topk + topk // 2)
    for round_ in range(_MAX_ROUNDS):
        chosen_XK, found_X = _first_distinct(draws_XL, topk)
        done_X = found_X == topk
        out_XK[pending_X[done_X]] = chosen_XK[done_X]
        # Unfinished rows keep their draws and draw more: restarting them would bias the sample.
        pending_X, draws_XL = pending_X[~done_X], draws_XL[~done_X]
        chosen_XK, found_X = chosen_XK[~done_X], found_X[~done_X]
        if not pending_X.size or round_ == _MAX_ROUNDS - 1:
            break
        draws_XL = np.concatenate([draws_XL, draw(rank_X[pending_X], topk)], axis=1)
    if pending_X.size:
        # Weights so concentrated that repeats dominate: finish the few remaining rows exactly
        # by Gumbel top-k over the experts not yet chosen (successive sampling continues so).
        with np.errstate(divide="ignore"):  # zero weights: key -inf, never chosen
            log_w_XE = np.log(weights_WE[rank_X[pending_X]])
        keys_XE = log_w_XE + rng.gumbel(size=(pending_X.size, num_experts))
        have_XK = np.arange(topk)[None, :] < found_X[:, None]
        rows = np.repeat(np.arange(pending_X.size), topk)[have_XK.ravel()]
        keys_XE[rows, chosen_XK[have_XK]] = np.inf
        top_XK = np.argpartition(-keys_XE, topk - 1, axis=1)[:, :topk]
        out_XK[pending_X] = top_XK
    out_XK.sort(axis=1)
    if int(tokens_W.min()) == width:
        return out_XK.reshape(world, width, topk)
    out_WTK = np.full((world, width, topk), -1, dtype=np.int16)
    out_WTK[np.arange(width)[None, :] < tokens_W[:, None]] = out_XK  # rank-major, as rank_X
    return out_WTK


def _first_distinct(draws_XL: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """The first (up to) K distinct values of each row in draw order, and how many were found.

    Returns:
        ([X, K] int16 values, valid in the first ``found`` slots; [X] int64 found <= K).
    """
    num_draws = draws_XL.shape[1]
    # Sorting (value, position) groups repeats with the earliest position first.
    key_XL = draws_XL * num_draws + np.arange(num_draws)
    key_XL.sort(axis=1)
    value_XL = key_XL // num_draws
    first_XL = np.ones(value_XL.shape, dtype=bool)
    first_XL[:, 1:] = value_XL[:, 1:] != value_XL[:, :-1]
    pos_XL = np.where(first_XL, key_XL % num_draws, num_draws)
    pos_XL.sort(axis=1)
    found_X = np.minimum(first_XL.sum(axis=1), topk)
    chosen_XK = np.take_along_axis(draws_XL, np.minimum(pos_XL[:, :topk], num_draws - 1), axis=1)
    return chosen_XK.astype(np.int16), found_X


def _check_divisible(num_experts: int, world: int) -> int:
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be divisible by world size {world}")
    return num_experts // world


def synthetic_topk_ids(
    topo: RailTopology,
    *,
    num_tokens: int,
    num_experts: int,
    topk: int,
    seed: int,
    hot_ratio: float = 8.0,
    locality: float = 6.0,
) -> np.ndarray:
    """[W, T, K] int16 top-k ids of the simple workload (see ``synthetic_routing_maps``)."""
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
    world = topo.world_size
    per_rank = _check_divisible(num_experts, world)
    rng = np.random.default_rng(int(seed))
    # Log-normal popularity; sigma chosen so that the max of E draws is ~hot_ratio x the mean.
    sigma = (
        math.sqrt(2 * math.log(max(hot_ratio, 1.0001)))
        / max(math.sqrt(2 * math.log(num_experts)), 1.0)
        * 1.6
    )
    log_pop_E = rng.standard_normal(num_experts) * sigma
    node_of_expert_E = np.arange(num_experts) // (per_rank * topo.gpus_per_node)
    node_of_rank_W = np.arange(world) // topo.gpus_per_node
    bonus_W = rng.random(world) * locality
    own_WE = node_of_expert_E[None, :] == node_of_rank_W[:, None]
    log_w_WE = log_pop_E[None, :] + bonus_W[:, None] * own_WE
    weights_WE = np.exp(log_w_WE - log_w_WE.max(axis=1, keepdims=True))
    return sample_topk_ids(weights_WE, num_tokens=num_tokens, topk=topk, rng=rng)


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
    ids_WTK = synthetic_topk_ids(
        topo,
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        seed=seed,
        hot_ratio=hot_ratio,
        locality=locality,
    )
    return [routing_map_from_topk_ids(ids_TK, num_experts) for ids_TK in ids_WTK]


def one_destination_topk_ids(
    topo: RailTopology,
    *,
    records_per_gpu: int,
    destination: int = 0,
    source_weights: tuple[float, ...] | None = None,
) -> np.ndarray:
    """[W, T, 1] int64 top-1 ids of the paper's UltraEP traffic: every other node sends to one node.

    The paper's appendix A.2 ("three source nodes send to one destination", routing about uniform
    over the destination node's experts): here E = W experts (one per GPU), every GPU of a source
    node sends ``round(records_per_gpu * weight)`` tokens, token t of source GPU l to GPU
    (t + l) mod G of ``destination`` (uniform over the destination's GPUs, the same count on every
    source rail: rails locally balanced). The destination node sends nothing; empty slots are -1.

    Args:
        topo: the cluster (N nodes x G GPUs).
        records_per_gpu: remote tokens per source GPU at weight 1.
        destination: the receiving node.
        source_weights: one factor per source node in node order (source-node skew, the paper's
            first family; its skew is not published); default all 1.
    """
    n, g, world = topo.num_nodes, topo.gpus_per_node, topo.world_size
    if n < 2:
        raise ValueError(f"one-destination traffic needs at least 2 nodes, the cluster has {n}")
    if not 0 <= destination < n:
        raise ValueError(f"destination must be a node in [0, {n}), got {destination}")
    if (
        isinstance(records_per_gpu, bool)
        or not isinstance(records_per_gpu, (int, np.integer))
        or records_per_gpu < 0
    ):
        raise ValueError(f"records_per_gpu must be an int >= 0, got {records_per_gpu!r}")
    sources = [node for node in range(n) if node != destination]
    weights = tuple(source_weights) if source_weights is not None else (1.0,) * len(sources)
    if len(weights) != len(sources) or any(not (math.isfinite(w) and w >= 0) for w in weights):
        raise ValueError(
            f"need {len(sources)} finite source weights >= 0 (one per source node), got "
            f"{source_weights}"
        )
    counts = [int(round(records_per_gpu * w)) for w in weights]
    ids = np.full((world, max(counts, default=0), 1), NO_EXPERT, dtype=np.int64)
    for node, count in zip(sources, counts):
        for local in range(g):  # each source GPU starts one GPU further, so remainders spread
            ids[node * g + local, :count, 0] = destination * g + (np.arange(count) + local) % g
    return ids
