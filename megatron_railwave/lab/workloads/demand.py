"""Demand forms of a replayed layer: the sparse counts for large clusters, and payload scaling.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, K top-k, E experts,
M = 2**G target masks.

Three forms carry one layer's demand through the tools:
  * ``traffic.DemandCounts`` (dense ``[W, N, M]`` histogram; ``capture.demand_from_topk_ids``);
  * ``SparseDemand`` (only the non-empty (rank, node, mask) cells: beyond a few hundred ranks
    the dense histogram does not fit);
  * the ``[N, G, N]`` record counts a request keeps (``DemandCounts.records_NGN()``).
``scaled_demand`` scales any of them with one rounding rule, so the same demand scaled by the
same factor gives the same counts in every tool.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch

from megatron_railwave.traffic import DemandCounts

__all__ = ["SparseDemand", "sparse_demand_from_topk_ids", "scaled_counts", "scaled_demand"]


class SparseDemand:
    """Demand counts of one layer without the dense [W, N, M] histogram (a `netmodel.MaskSource`).

    Attributes:
        records_NGN_: [N_src, G, N_dst] int64, records owned by GPU (s, g) for node d.
    """

    def __init__(
        self,
        world: int,
        num_nodes: int,
        num_masks: int,
        node_D: np.ndarray,
        rank_D: np.ndarray,
        mask_D: np.ndarray,
        count_D: np.ndarray,
    ) -> None:
        order = np.argsort(node_D, kind="stable")
        self.world, self.num_nodes, self.num_masks = world, num_nodes, num_masks
        self._ptr = np.searchsorted(node_D[order], np.arange(num_nodes + 1))
        self._rank, self._mask, self._count = rank_D[order], mask_D[order], count_D[order]
        records = np.zeros((world, num_nodes), dtype=np.int64)
        np.add.at(records, (rank_D, node_D), count_D)
        self.records_NGN_ = torch.from_numpy(
            records.reshape(num_nodes, world // num_nodes, num_nodes)
        )

    def records_NGN(self) -> torch.Tensor:
        return self.records_NGN_

    def masks_into(self, node: int) -> torch.Tensor:
        """[W, M] int64: records every rank sends to ``node``, by target mask."""
        lo, hi = self._ptr[node], self._ptr[node + 1]
        out = np.zeros(self.world * self.num_masks, dtype=np.int64)
        np.add.at(out, self._rank[lo:hi] * self.num_masks + self._mask[lo:hi], self._count[lo:hi])
        return torch.from_numpy(out.reshape(self.world, self.num_masks))

    def with_counts(self, count_D: np.ndarray) -> SparseDemand:
        """The same cells with other counts ([D] int64, in this demand's cell order)."""
        nodes = np.repeat(np.arange(self.num_nodes), np.diff(self._ptr))
        return SparseDemand(
            self.world, self.num_nodes, self.num_masks, nodes, self._rank, self._mask, count_D
        )

    @property
    def counts_D(self) -> np.ndarray:
        """[D] int64, the count of every stored cell."""
        return self._count


def sparse_demand_from_topk_ids(
    ids_WTK: np.ndarray, topo: Any, num_experts: int, *, chunk: int = 64
) -> SparseDemand:
    """The counts of `capture.demand_from_topk_ids`, built ``chunk`` ranks at a time (no dense
    masks).

    Args:
        ids_WTK: [W, T, K] expert ids, -1 = empty slot; global.
    """
    world, num_tokens, _ = ids_WTK.shape
    n, g = topo.num_nodes, topo.gpus_per_node
    per_rank = num_experts // world
    parts = []
    for lo in range(0, world, chunk):
        ids = np.sort(np.asarray(ids_WTK[lo : lo + chunk]).astype(np.int64), axis=-1)
        valid = ids >= 0
        owner = np.where(valid, ids // per_rank, -1)
        first = valid.copy()
        first[..., 1:] &= owner[..., 1:] != owner[..., :-1]  # one bit per owner GPU
        src = np.broadcast_to((lo + np.arange(ids.shape[0]))[:, None, None], ids.shape)[first]
        tok = np.broadcast_to(np.arange(num_tokens)[None, :, None], ids.shape)[first]
        own = owner[first]
        key, inv = np.unique((src * num_tokens + tok) * n + own // g, return_inverse=True)
        mask = np.bincount(inv, weights=(1 << (own % g)).astype(np.float64)).astype(np.int64)
        rank, node = key // n // num_tokens, key % n
        cell, count = np.unique((node * world + rank) * (1 << g) + mask, return_counts=True)
        parts.append(
            (cell // (1 << g) // world, (cell // (1 << g)) % world, cell % (1 << g), count)
        )
    node_D, rank_D, mask_D, count_D = (np.concatenate(x) for x in zip(*parts))
    return SparseDemand(world, n, 1 << g, node_D, rank_D, mask_D, count_D)


_Counts = TypeVar("_Counts", np.ndarray, torch.Tensor)


def scaled_counts(counts: _Counts, scale: float) -> _Counts:
    """Integer counts times ``scale``, rounded half to even; int64, same array type as given."""
    if isinstance(counts, torch.Tensor):
        return torch.round(counts.to(torch.float64) * scale).to(torch.int64)
    return np.round(np.asarray(counts, dtype=np.float64) * scale).astype(np.int64)


_Demand = TypeVar("_Demand", DemandCounts, SparseDemand, torch.Tensor)


def scaled_demand(demand: _Demand, scale: float) -> _Demand:
    """``demand`` with every record count multiplied by ``scale`` and rounded (half to even).

    Args:
        demand: a ``DemandCounts`` (full form: ``records_WNM``; ``experts_WE``, the (token, expert)
            pairs Megatron's flat all-to-all sends, scales with the records),
            a ``SparseDemand``, or a record-count tensor such as ``[N, G, N]`` int64.
        scale: the payload factor (> 0); 1.0 returns ``demand`` itself.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if scale == 1.0:
        return demand
    if isinstance(demand, DemandCounts):
        if demand.records_WNM is None:
            raise ValueError("scaled_demand needs the full demand (records_WNM), not a node view")
        experts = None if demand.experts_WE is None else scaled_counts(demand.experts_WE, scale)
        return DemandCounts(
            records_WNM=scaled_counts(demand.records_WNM, scale), experts_WE=experts
        )
    if isinstance(demand, SparseDemand):
        return demand.with_counts(scaled_counts(demand.counts_D, scale))
    if isinstance(demand, torch.Tensor):
        return scaled_counts(demand, scale)
    raise TypeError(
        f"scaled_demand: expected DemandCounts, SparseDemand or a tensor, got "
        f"{type(demand).__name__}"
    )
