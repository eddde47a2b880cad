"""Shared cases of the flow-model bound tests (tests/unit/netmodel/test_bound.py and
test_ideal_bound.py): the model variants and random demands."""

from __future__ import annotations

import numpy as np
import torch

from megatron_railwave.lab.netmodel import NetModelConfig
from megatron_railwave.traffic import DemandCounts

# rel_tol = 0: the engine is exact, so a bound must hold to rounding.
MODELS = {
    "after_rail": NetModelConfig(rel_tol=0.0),
    "streamed": NetModelConfig(rel_tol=0.0, delivery="streamed"),
    "ports": NetModelConfig(rel_tol=0.0, nvlink="ports", delivery="streamed"),
    "rank": NetModelConfig(rel_tol=0.0, phase_sync="rank"),
    "rank_streamed": NetModelConfig(rel_tol=0.0, phase_sync="rank", delivery="streamed"),
    "rank_ports": NetModelConfig(rel_tol=0.0, phase_sync="rank", nvlink="ports"),
}


def random_demand(
    n: int, g: int, seed: int, density: float, skew: int, *, consistent_experts: bool = False
) -> DemandCounts:
    """Poisson records per (rank, node, mask) with a hot source node (``skew`` times), no empty
    mask. Expert counts: random (``consistent_experts`` False), or one expert per target GPU bit,
    consistent with the masks (what the Megatron peer needs)."""
    rng = np.random.default_rng(seed)
    shape = (n * g, n, 1 << g)
    rec = rng.poisson(4.0, size=shape) * (rng.random(shape) < density)
    rec[:g] *= skew  # a hot source node
    rec[:, :, 0] = 0
    if consistent_experts:
        copies = torch.from_numpy(rec).view(n * g, n, 1 << g)
        bits = (torch.arange(1 << g).unsqueeze(1) >> torch.arange(g)) & 1
        experts = torch.einsum("wnm,mj->wnj", copies, bits).reshape(n * g, n * g)
    else:
        experts = torch.from_numpy(rng.poisson(2.0, size=(n * g, n * g)))
    return DemandCounts(records_WNM=torch.from_numpy(rec), experts_WE=experts)
