"""Which copies each arrival GPU forwards: expected (record, target GPU) copies per node pair, rail
chunk, arrival GPU and target GPU, from the gathered per-owner counts.

Why: a delivery round lasts as long as its busiest NVLink port, and which copies cross NVLink
depends on which records arrive on which GPU. RailBalance keeps each owner's records on its own
rail up to the even share and moves the rest to proxies; an owner's list is in ascending mask
order, so the part it keeps is its lowest masks and the moved parts (to GPU 0, 1, ... in turn)
its higher ones; the records of one source node arrive owner by owner, and rail chunk k is the
k-th contiguous part of that block (``planner.routes``). So a copy for target GPU j stays on its
arrival GPU far more or less often than 1/G, and one chunk's copies can crowd a few target GPUs.

The gathered counts hold, per owner, only its copies per target GPU (``DemandCounts.copies_WNG``),
not its masks. The mask order is therefore modelled: a record's target bits independent, with
probabilities that reproduce the owner's copies per target given that every record has at least
one target. Under that model the expected copies per target among an owner's first x records
(``prefix_copies``) follow by walking the mask bits from the highest: masks without bit b come
before masks with it.

Letters: N nodes, G GPUs per node, C rail chunks, K owner lists, X positions.
"""

from __future__ import annotations

import numpy as np
import torch

from . import ops
from .planner import chunk_sizes
from .planner.railbalance import eligible_NNG, quota_and_relay
from .topology import RailTopology

__all__ = ["arrival_copies_NNCGG", "arrival_copies_reference", "prefix_copies"]

_NEWTON_STEPS = 12
_MIN_SOME = 1e-3
"""Floor on P(at least one bit): owners whose records nearly all have one target have no
independent-bit solution (it tends to 0); the floor keeps the walk's arithmetic exact enough."""
_TINY = 1e-300


def _bit_probabilities(p_KG: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([K, G] bit probabilities q, [K] P(at least one bit) s) of independent bits whose masks,
    given at least one bit, include target j with probability p_j: q = p s with s the largest
    root of s = 1 - prod(1 - p_j s) (Newton from s = 1: the right side is concave in s)."""
    some = np.ones(p_KG.shape[0])
    for _ in range(_NEWTON_STEPS):
        free_KG = np.maximum(1.0 - p_KG * some[:, None], 0.0)
        none = free_KG.prod(axis=1)
        slope = none * (p_KG / np.maximum(free_KG, _TINY)).sum(axis=1) - 1.0
        some = np.clip(some - (1.0 - none - some) / np.minimum(slope, -_TINY), _MIN_SOME, 1.0)
    return np.minimum(p_KG * some[:, None], 1.0), some


def prefix_copies(records_K: np.ndarray, copies_KG: np.ndarray, x_KX: np.ndarray) -> np.ndarray:
    """[K, X, G] float64: expected copies per target GPU among the first x records of an owner's
    mask-sorted list (independent bits, module docstring).

    Args:
        records_K: [K] records of each list.
        copies_KG: [K, G] copies per target GPU of each list (<= records_K per target).
        x_KX: [K, X] positions, 0 <= x <= records.
    """
    records = np.asarray(records_K, dtype=np.float64)
    q, some = _bit_probabilities(_target_probabilities(records, copies_KG))
    return _walk(records, q, some, x_KX)


def _target_probabilities(records: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """[..., G] P(a record of the list has target j)."""
    return np.clip(np.where(records[..., None] > 0, copies / np.maximum(records[..., None], 1.0), 0.0), 0.0, 1.0)


def _walk(records: np.ndarray, q: np.ndarray, some: np.ndarray, x_KX: np.ndarray) -> np.ndarray:
    """``prefix_copies`` given the lists' bit probabilities (``_bit_probabilities``)."""
    g = q.shape[1]
    mass = records / some  # the walk counts the empty mask too: it sorts first
    left = x_KX + (mass - records)[:, None]
    subtree = np.broadcast_to(mass[:, None], x_KX.shape)
    taken_so_far = np.zeros(x_KX.shape)
    # Bit-major [G, K, X] scratch: each level writes one contiguous slab.
    below = np.empty((g,) + x_KX.shape)  # per target j: records of subtrees taken at bits above j
    taken = np.empty((g,) + x_KX.shape)
    on_path = np.empty((g,) + x_KX.shape)
    for b in range(g - 1, -1, -1):
        without = subtree * (1.0 - q[:, b, None])  # masks without bit b come first
        take = left >= without
        below[b] = taken_so_far
        taken[b] = np.where(take, without, 0.0)
        on_path[b] = take
        taken_so_far = taken_so_far + taken[b]
        left = left - taken[b]
        subtree = np.where(take, subtree - without, without)
    leaf = np.clip(left, 0.0, subtree)  # what is left of the last subtree has the path's mask
    # A subtree taken at bit b holds target j < b with probability q_j and j > b as on the path.
    above = taken_so_far - below - taken
    copies = q.T[:, :, None] * below + on_path * (above + leaf)
    return np.moveaxis(copies, 0, -1)


def _copies_at(records: np.ndarray, copies: np.ndarray, q: np.ndarray, some: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[..., X, G] ``prefix_copies`` at positions x [..., X] of lists ``records`` [...] with
    ``copies`` [..., G] (bit probabilities ``q`` [..., G], ``some`` [...]), walking only positions
    strictly inside their list (0 before it starts, all copies at its end), each distinct
    position of a list once (x ascending along X)."""
    lead = x.shape[:-1]
    full = np.broadcast_to(records[..., None], x.shape)
    out = np.where((x >= full)[..., None], copies[..., None, :], 0.0)
    inside = (x > 0) & (x < full)
    first = inside & (x != np.concatenate([np.full(lead + (1,), -1.0), x[..., :-1]], axis=-1))
    where = np.nonzero(first)
    if where[0].size:
        lists = where[:-1]
        out[where] = _walk(records[lists], q[lists], some[lists], x[where][:, None])[:, 0]
        repeated = np.nonzero(inside & ~first)
        if repeated[0].size:  # a repeated position takes the value of its first occurrence
            first_at = np.maximum.accumulate(np.where(first, np.arange(x.shape[-1]), 0), axis=-1)
            out[repeated] = out[repeated[:-1] + (first_at[repeated],)]
    return out


def arrival_copies_NNCGG(records_NGN: np.ndarray, copies_NGNG: np.ndarray, topo: RailTopology,
                         chunks: int) -> np.ndarray:
    """[N_src, N_dst, C, G_arrive, G_target] float64: expected copies that arrive on GPU
    (d, l) from node s in rail chunk k and are for GPU (d, j), l == j included (they stay).
    Local pairs (s == d) are zero (no rail). Uses RailBalance's default eligible rails (all
    healthy ones) and remainder rotation 0.

    Runs the compiled twin (``ops.arrival_copies``) where the compiled ops load, else
    ``arrival_copies_reference`` (the meaning; the two agree to rounding,
    tests/unit/test_arrival_copies_op.py).

    Args:
        records_NGN: [N, G, N] records owned by GPU (s, o) for node d.
        copies_NGNG: [N, G, N, G] copies owner (s, o) sends to GPU (d, j).
        chunks: rail chunks per wave (1: whole waves).
    """
    relay = _rail_relay_NNGG(records_NGN, topo)
    compiled = ops.arrival_copies(torch.from_numpy(np.ascontiguousarray(records_NGN, dtype=np.float64)),
                                  torch.from_numpy(np.ascontiguousarray(copies_NGNG, dtype=np.float64)),
                                  relay, chunks=chunks)
    if compiled is not None:
        return compiled.numpy()
    return _arrival_copies(records_NGN, copies_NGNG, relay.numpy(), chunks)


def _rail_relay_NNGG(records_NGN: np.ndarray, topo: RailTopology) -> torch.Tensor:
    """[N, N, G, G] int64: RailBalance's relay (rotation 0, all healthy rails eligible)."""
    records_NNG = torch.from_numpy(np.ascontiguousarray(records_NGN.transpose(0, 2, 1))).to(torch.int64)
    return quota_and_relay(records_NNG, eligible_NNG(topo, records_NNG), balanced=True, phase=0)[1]


def arrival_copies_reference(records_NGN: np.ndarray, copies_NGNG: np.ndarray, topo: RailTopology,
                             chunks: int) -> np.ndarray:
    """``arrival_copies_NNCGG`` in numpy: the meaning the compiled twin reproduces."""
    return _arrival_copies(records_NGN, copies_NGNG, _rail_relay_NNGG(records_NGN, topo).numpy(), chunks)


def _arrival_copies(records_NGN: np.ndarray, copies_NGNG: np.ndarray, relay: np.ndarray, chunks: int) -> np.ndarray:
    n, g = records_NGN.shape[0], records_NGN.shape[1]
    remote = ~np.eye(n, dtype=bool)
    relay = np.where(remote[:, :, None, None], relay, 0).astype(np.float64)  # [s, d, owner, arrival]
    eye = np.eye(g, dtype=bool)
    keep = np.einsum("sdoo->sdo", relay)
    moved = np.where(eye, 0.0, relay)
    # An owner's list: kept part first, then its moved parts to arrival GPU 0, 1, ... in turn.
    records = records_NGN.transpose(0, 2, 1).astype(np.float64) * remote[:, :, None]  # [s, d, o]
    owner_copies = copies_NGNG.transpose(0, 2, 1, 3).astype(np.float64) * remote[:, :, None, None]  # [s, d, o, j]
    moved_end = keep[..., None] + np.cumsum(moved, axis=-1)  # [s, d, o, l]: where the part for l ends
    # Where each part ends, in list order: keep, then l = 0 .. G-2 (the last ends at the list's end).
    bounds = np.concatenate([keep[..., None], moved_end[..., :-1]], axis=-1)  # [s, d, o, G]
    walked = ((bounds > 0) & (bounds < records[..., None])).any(axis=-1)  # lists split between rails
    if chunks > 1:
        # Chunk cuts inside each arrival block (owners ascending): the owner each cut falls in and
        # the cut's position in that owner's list.
        block = relay.transpose(0, 1, 3, 2)  # [s, d, l, o] segment lengths in block order
        block_end = np.cumsum(block, axis=-1)
        cuts = np.cumsum(chunk_sizes(block_end[..., -1].astype(np.int64), chunks), axis=-1)[..., :-1].astype(np.float64)
        cut_owner = np.minimum((block_end[..., None, :] <= cuts[..., None]).sum(axis=-1), g - 1)  # [s, d, l, C-1]
        pick = np.take_along_axis
        seg_start = np.where(eye, 0.0, moved_end - moved).transpose(0, 1, 3, 2)  # [s, d, l, o] in the owner's list
        position = pick(seg_start, cut_owner, axis=-1) + cuts - pick(block_end - block, cut_owner, axis=-1)
        s_i, d_i, l_i = np.ix_(np.arange(n), np.arange(n), np.arange(g))
        s_i, d_i, l_i = s_i[..., None], d_i[..., None], l_i[..., None]
        cut = s_i, d_i, cut_owner
        inside = (position > 0) & (position < records[cut])
        walked[np.broadcast_to(s_i, cut_owner.shape)[inside], np.broadcast_to(d_i, cut_owner.shape)[inside],
               cut_owner[inside]] = True
    # Bit probabilities only for the lists a walk visits (per list, so the same values as for all).
    q, some = np.zeros(owner_copies.shape), np.ones(records.shape)
    q[walked], some[walked] = _bit_probabilities(_target_probabilities(records[walked], owner_copies[walked]))
    at_bounds = _copies_at(records, owner_copies, q, some, bounds)  # [s, d, o, G, j]
    seg_copies = np.empty_like(at_bounds)  # [s, d, o, l, j]: the part moved to l (0 for l == o)
    np.subtract(at_bounds[..., 1:, :], at_bounds[..., :-1, :], out=seg_copies[..., :-1, :])
    np.subtract(owner_copies, at_bounds[..., -1, :], out=seg_copies[..., -1, :])
    seg_copies[:, :, np.arange(g), np.arange(g)] = at_bounds[:, :, :, 0]  # the kept part: its first `keep`
    total = seg_copies.sum(axis=2)  # [s, d, l, j]
    if chunks == 1:
        return total[:, :, None]
    at_cut = _copies_at(records[cut], owner_copies[cut], q[cut], some[cut], position[..., None])[..., 0, :]
    # Where the cut owner's part starts: 0 for its kept part, else where its previous part ends.
    at_start = np.where((cut_owner == l_i)[..., None], 0.0, at_bounds[s_i, d_i, cut_owner, l_i])
    owners_before = (np.arange(g) < cut_owner[..., None]).astype(np.float64)  # [s, d, l, C-1, o]
    cum = np.einsum("sdlko,sdolj->sdlkj", owners_before, seg_copies) + at_cut - at_start  # [s, d, l, C-1, j]
    cum = np.concatenate([np.zeros_like(cum[..., :1, :]), cum, total[:, :, :, None]], axis=-2)
    return np.diff(cum, axis=-2).transpose(0, 1, 3, 2, 4)  # [s, d, C, l, j]
