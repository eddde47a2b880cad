"""RailBalance: source-local rail quotas and proxy (relay) assignment.

Letters: N nodes (first axis source s, second destination d), G GPUs per node (owner g, egress l).

For every remote node pair (s, d) the records that node s sends to d are split over the eligible
GPUs (rails) of s so that per-rail counts differ by at most one. Only node-local counts
``records_NNG[s, d, :]`` are needed, so the quota needs no destination-side exchange. The
``rem = total % n`` leftover records go to the eligible GPUs at positions
``(pos - rot) mod n < rem`` with ``rot = (s + d + phase) mod n``: rotating with the destination
spreads the remainders of one source over different rails, rotating with the source spreads the
remainders that several sources send into one destination over different ingress rails, and the
phase counter moves them between layers/steps, so no rail is always favoured.

A GPU over its quota hands its surplus records to under-quota GPUs of the same node (its proxies)
over NVLink. Matching is a deterministic greedy fill: surpluses in owner order are laid end to
end, deficits in GPU order likewise, and ``relay[g, l]`` is the overlap of owner g's surplus
interval with GPU l's deficit interval. This moves the minimum number of records.

Unbalanced paths (NATIVE, PERM) keep every record on its owner, except that an owner whose rail
is not eligible (failed here or at the destination) hands its records over evenly (same rotation)
to the eligible GPUs.
"""

from __future__ import annotations

import torch

from ..topology import RailTopology
from .paths import EligiblePolicy

__all__ = ["healthy_gpus_NG", "eligible_NNG", "rail_quota_NNG", "relay_NNGG", "surplus_deficit_bounds"]


def healthy_gpus_NG(topo: RailTopology) -> torch.Tensor:
    """[N, G] bool: the rail of GPU (n, l) is healthy."""
    healthy = torch.ones(topo.num_nodes, topo.gpus_per_node, dtype=torch.bool)
    for node, rail in topo.failed_rails:
        for gpu, r in enumerate(topo.rail_of_gpu):
            if r == rail:
                healthy[node, gpu] = False
    return healthy


def eligible_NNG(
    topo: RailTopology,
    records_NNG: torch.Tensor,
    policy: EligiblePolicy = EligiblePolicy.ALL,
    mask_NG: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N_src, N_dst, G] bool: GPUs of s allowed to carry records of pair (s, d).

    A GPU is eligible only if its rail is healthy at both ends. ACTIVE and MASK narrow the
    healthy set further, falling back to all healthy GPUs when the narrowed set is empty.
    Local pairs (s, s) are marked all eligible; they are never balanced.
    """
    healthy = healthy_gpus_NG(topo)
    base = healthy.unsqueeze(1) & healthy.unsqueeze(0)  # [s, d, l]
    if policy == EligiblePolicy.ALL:
        narrowed = base
    elif policy == EligiblePolicy.ACTIVE:
        narrowed = base & (records_NNG > 0)
    elif policy == EligiblePolicy.MASK:
        if mask_NG is None:
            raise ValueError("eligible policy 'mask' needs a rail mask [N, G]; pass rail_mask")
        if tuple(mask_NG.shape) != (topo.num_nodes, topo.gpus_per_node):
            raise ValueError(
                f"rail mask has shape {tuple(mask_NG.shape)}, expected [N, G] = "
                f"[{topo.num_nodes}, {topo.gpus_per_node}]"
            )
        narrowed = base & mask_NG.to(torch.bool).unsqueeze(1)
    else:  # pragma: no cover - enum exhausted
        raise ValueError(f"unknown eligible policy {policy!r}")
    out = torch.where(narrowed.any(dim=-1, keepdim=True), narrowed, base)
    diag = torch.eye(topo.num_nodes, dtype=torch.bool)
    out[diag] = True
    return out


def rail_quota_NNG(
    records_NNG: torch.Tensor,
    eligible: torch.Tensor,
    *,
    balanced: bool,
    phase: int = 0,
) -> torch.Tensor:
    """[N_src, N_dst, G] int64: records each GPU of s sends to d.

    Args:
        records_NNG: [N, N, G] int64, records owned by GPU (s, g) for node d (global).
        eligible: [N, N, G] bool from ``eligible_NNG``.
        balanced: RailBalance (counts within one over eligible GPUs) or owner-keeps.
        phase: rotation counter for the remainder placement (same on every rank).
    """
    n, _, g = records_NNG.shape
    num_eligible = eligible.sum(dim=-1)  # [s, d], >= 1 by construction
    if balanced:
        to_spread = records_NNG.sum(dim=-1)
    else:
        to_spread = (records_NNG * ~eligible).sum(dim=-1)
    base = torch.div(to_spread, num_eligible, rounding_mode="floor")
    rem = to_spread - base * num_eligible
    pos = eligible.cumsum(dim=-1) - 1
    node = torch.arange(n, dtype=torch.int64)
    rot = (node.view(n, 1) + node.view(1, n) + int(phase)) % num_eligible
    extra = ((pos - rot.unsqueeze(-1)) % num_eligible.unsqueeze(-1)) < rem.unsqueeze(-1)
    share = base.unsqueeze(-1) + extra.to(torch.int64)
    quota = torch.where(eligible, share + (0 if balanced else records_NNG), 0)
    diag = torch.eye(n, dtype=torch.bool)
    quota[diag] = records_NNG[diag]  # the local node is never balanced
    return quota


def surplus_deficit_bounds(
    records_NNG: torch.Tensor, quota_NNG: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy-fill intervals: (keep, s_lo, s_hi, d_lo, d_hi), each [N, N, G] int64.

    Owner g keeps its first ``keep`` records; its surplus occupies [s_lo, s_hi) of the pair's
    surplus line and GPU l's deficit occupies [d_lo, d_hi) of the deficit line.
    """
    keep = torch.minimum(records_NNG, quota_NNG)
    surplus = records_NNG - keep
    deficit = quota_NNG - keep
    s_hi = surplus.cumsum(dim=-1)
    d_hi = deficit.cumsum(dim=-1)
    return keep, s_hi - surplus, s_hi, d_hi - deficit, d_hi


def relay_NNGG(records_NNG: torch.Tensor, quota_NNG: torch.Tensor) -> torch.Tensor:
    """[N_src, N_dst, G_owner, G_egress] int64: records of owner g that leave on GPU l.

    The diagonal (g == l) is what owners keep; off-diagonal entries move over NVLink.
    """
    keep, s_lo, s_hi, d_lo, d_hi = surplus_deficit_bounds(records_NNG, quota_NNG)
    hi = torch.minimum(s_hi.unsqueeze(-1), d_hi.unsqueeze(-2))
    lo = torch.maximum(s_lo.unsqueeze(-1), d_lo.unsqueeze(-2))
    moved = (hi - lo).clamp(min=0)
    return moved + torch.diag_embed(keep)
