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

import functools
from typing import TypeVar

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.planner.eligible import EligiblePolicy
from megatron_railwave.topology import RailTopology

__all__ = [
    "healthy_gpus_NG",
    "eligible_NNG",
    "rail_quota_NNG",
    "relay_NNGG",
    "quota_and_relay",
    "surplus_deficit_bounds",
]

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


# Host arithmetic on tiny [N, N, G] arrays, on every layer's planning path: numpy inside (a
# fraction of torch's per-call cost), torch CPU tensors at the interface.


@functools.lru_cache(maxsize=64)
def _healthy_NG(topo: RailTopology) -> np.ndarray:
    healthy = np.ones((topo.num_nodes, topo.gpus_per_node), dtype=bool)
    for node, rail in topo.failed_rails:
        for gpu, r in enumerate(topo.rail_of_gpu):
            if r == rail:
                healthy[node, gpu] = False
    healthy.flags.writeable = False
    return healthy


def healthy_gpus_NG(topo: RailTopology) -> torch.Tensor:
    """[N, G] bool: the rail of GPU (n, l) is healthy."""
    return torch.from_numpy(_healthy_NG(topo).copy())


@functools.lru_cache(maxsize=64)
def _diagonal_N(n: int) -> np.ndarray:
    diag = np.eye(n, dtype=bool)
    diag.flags.writeable = False
    return diag


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
    healthy = _healthy_NG(topo)
    base = healthy[:, None, :] & healthy[None, :, :]  # [s, d, l]
    if policy == EligiblePolicy.ALL:
        narrowed = base
    elif policy == EligiblePolicy.ACTIVE:
        narrowed = base & (records_NNG.numpy() > 0)
    elif policy == EligiblePolicy.MASK:
        if mask_NG is None:
            raise ValueError("eligible policy 'mask' needs a rail mask [N, G]; pass rail_mask")
        if tuple(mask_NG.shape) != (topo.num_nodes, topo.gpus_per_node):
            raise ValueError(
                f"rail mask has shape {tuple(mask_NG.shape)}, expected [N, G] = "
                f"[{topo.num_nodes}, {topo.gpus_per_node}]"
            )
        narrowed = base & mask_NG.to(torch.bool).cpu().numpy()[:, None, :]
    else:  # pragma: no cover - enum exhausted
        raise ValueError(f"unknown eligible policy {policy!r}")
    out = np.where(narrowed.any(axis=-1, keepdims=True), narrowed, base)
    out[_diagonal_N(topo.num_nodes)] = True
    return torch.from_numpy(out)


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
    records, allowed = records_NNG.numpy(), eligible.numpy()
    n = records.shape[0]
    num_eligible = allowed.sum(axis=-1)  # [s, d], >= 1 by construction
    to_spread = records.sum(axis=-1) if balanced else (records * ~allowed).sum(axis=-1)
    base = to_spread // num_eligible
    rem = to_spread - base * num_eligible
    pos = allowed.cumsum(axis=-1) - 1
    node = np.arange(n, dtype=np.int64)
    rot = (node[:, None] + node[None, :] + int(phase)) % num_eligible
    extra = ((pos - rot[:, :, None]) % num_eligible[:, :, None]) < rem[:, :, None]
    share = base[:, :, None] + extra
    quota = np.where(allowed, share + (0 if balanced else records), 0).astype(np.int64)
    diag = _diagonal_N(n)
    quota[diag] = records[diag]  # the local node is never balanced
    return torch.from_numpy(quota)


def surplus_deficit_bounds(
    records_NNG: ArrayT, quota_NNG: ArrayT
) -> tuple[ArrayT, ArrayT, ArrayT, ArrayT, ArrayT]:
    """Greedy-fill intervals: (keep, s_lo, s_hi, d_lo, d_hi), each [N, N, G] int64 (numpy in,
    numpy out; CPU torch tensors in, torch tensors out).

    Owner g keeps its first ``keep`` records; its surplus occupies [s_lo, s_hi) of the pair's
    surplus line and GPU l's deficit occupies [d_lo, d_hi) of the deficit line.
    """
    as_torch = isinstance(records_NNG, torch.Tensor)
    records = records_NNG.numpy() if as_torch else records_NNG
    quota = quota_NNG.numpy() if isinstance(quota_NNG, torch.Tensor) else quota_NNG
    keep = np.minimum(records, quota)
    surplus = records - keep
    deficit = quota - keep
    s_hi = surplus.cumsum(axis=-1)
    d_hi = deficit.cumsum(axis=-1)
    out = (keep, s_hi - surplus, s_hi, d_hi - deficit, d_hi)
    return tuple(torch.from_numpy(a) for a in out) if as_torch else out  # type: ignore[return-value]


def relay_NNGG(records_NNG: torch.Tensor, quota_NNG: torch.Tensor) -> torch.Tensor:
    """[N_src, N_dst, G_owner, G_egress] int64: records of owner g that leave on GPU l.

    The diagonal (g == l) is what owners keep; off-diagonal entries move over NVLink.
    """
    keep, s_lo, s_hi, d_lo, d_hi = surplus_deficit_bounds(records_NNG.numpy(), quota_NNG.numpy())
    hi = np.minimum(s_hi[..., :, None], d_hi[..., None, :])
    lo = np.maximum(s_lo[..., :, None], d_lo[..., None, :])
    moved = np.clip(hi - lo, 0, None)
    g = keep.shape[-1]
    moved[..., np.arange(g), np.arange(g)] += keep
    return torch.from_numpy(moved)


def quota_and_relay(
    records_NNG: torch.Tensor, eligible: torch.Tensor, *, balanced: bool, phase: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rail_quota_NNG``, ``relay_NNGG``) in one call: the compiled ``ops.rail_plan`` where the
    compiled ops load, else this module's numpy (the same counts; tests/unit/planner/
    test_rail_plan_op.py)."""
    compiled = ops.rail_plan(records_NNG, eligible, balanced=balanced, phase=phase)
    if compiled is not None:
        return compiled
    quota = rail_quota_NNG(records_NNG, eligible, balanced=balanced, phase=phase)
    return quota, relay_NNGG(records_NNG, quota)
