"""Helpers of the ops tests: bitwise comparison and random routing maps.

Letters: T tokens, E experts.
"""

from __future__ import annotations

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def random_routing_map(
    num_tokens: int, num_experts: int, topk: int, generator: torch.Generator
) -> torch.Tensor:
    """[T, E] bool with exactly min(topk, E) experts per token."""
    k = min(topk, num_experts)
    routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    if num_tokens and k:
        ids = torch.rand(num_tokens, num_experts, generator=generator).topk(k, dim=1).indices
        routing.scatter_(1, ids, True)
    return routing


def egress_inputs(plan, rank: int) -> dict[str, object]:
    """assign_egress's keyword arguments for ``rank`` from a real plan (what the exchange and
    ops-bench pass): the owner's egress intervals under the plan's relay counts, on the CPU."""
    from megatron_railwave.planner import owner_egress_bounds

    topo = plan.topology
    s, g = topo.node_of(rank), topo.local_of(rank)
    keep, s_lo, d_hi = (torch.from_numpy(a) for a in owner_egress_bounds(plan.relay_NNGG[s], g))
    return dict(
        owner_gpu=g,
        counts_N=plan.records_NNG[s, :, g].contiguous(),
        keep_N=keep.contiguous(),
        surplus_lo_N=s_lo.contiguous(),
        deficit_hi_NG=d_hi.contiguous(),
        wave_N=plan.pair_wave_NN[s].contiguous(),
    )


def random_failed_topology(rng, num_nodes: int, gpus: int, failed: int):
    """A ``RailTopology`` with up to ``failed`` random failed rails (every node keeps a healthy
    one), or None when two nodes are left without a common healthy rail (the topology rejects it).

    Args:
        rng: a numpy ``Generator``.
    """
    from megatron_railwave.topology import RailTopology

    picked = {(int(rng.integers(num_nodes)), int(rng.integers(gpus))) for _ in range(failed)}
    failed_rails = frozenset(
        (n, r) for n, r in picked if sum(1 for m, _ in picked if m == n) < gpus
    )
    try:
        return RailTopology(num_nodes=num_nodes, gpus_per_node=gpus, failed_rails=failed_rails)
    except ValueError:
        return None
