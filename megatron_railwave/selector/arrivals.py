"""Which copies each arrival GPU forwards: expected (record, target GPU) copies per node pair, rail
chunk, arrival GPU and target GPU, from the gathered per-owner counts.

Why: a delivery round lasts as long as its busiest NVLink port, and which copies cross NVLink
depends on which records arrive on which GPU. RailBalance keeps each owner's records on its own
rail up to the even share and moves the rest to proxies; an owner's list is in ascending mask
order, so the part it keeps is its lowest masks and the moved parts (to GPU 0, 1, ... in turn)
its higher ones; the records of one source node arrive owner by owner, and rail chunk k is the
k-th contiguous part of that block (``planner.routes``). So a copy for target GPU j stays on its
arrival GPU far more or less often than 1/G, and one chunk's copies can crowd a few target GPUs.

The gathered counts hold, per owner, its copies per target GPU in each *mask class*
(``DemandCounts.class_copies_WNKG``: the records whose masks share their top min(2, G) bits,
``traffic.mask_classes``), not its masks. A list's classes follow one another in mask order, so
which classes a part of the list holds is exact. Inside a class the mask order is modelled: the
class's other (low) target bits independent, with probabilities that reproduce its copies per
low target (in class 0, which has no top bit, given that every record has at least one target);
a top bit is on every record of its classes and on none of the others. Under that model the
expected copies per target among a class's first x records follow by walking the low bits from
the highest: masks without bit b come before masks with it (``prefix_copies``).

Why classes and not copies per target alone (one class, all G bits walked): target bits are not
independent where experts are preferred in sets, and then the walk puts the wrong targets in an
owner's moved parts. On the one held-out request the selector got wrong (H800, seed 14000, layer
32, T = 384, ring: RAIL 3.4% slower than JOINT on the flow model, predicted 0.6% faster) the
estimate with copies per target alone took log(est_RAIL / est_JOINT) = -0.0045, with two top bits
+0.0307, with every mask (exact) +0.0308 (lab, 2026-12-02, docs/selector.md).

Letters: N nodes, G GPUs per node, K mask classes, L = G - log2(K) low bits, C rail chunks,
I owner lists, X positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.planner import chunk_sizes
from megatron_railwave.planner.railbalance import eligible_NNG, quota_and_relay
from megatron_railwave.topology import RailTopology

__all__ = ["arrival_copies_NNCGG", "arrival_copies_reference", "prefix_copies"]

_NEWTON_STEPS = 12
_MIN_SOME = 1e-3
"""Floor on P(at least one bit): owners whose records nearly all have one target have no
independent-bit solution (it tends to 0); the floor keeps the walk's arithmetic exact enough."""
_TINY = 1e-300


def _bit_probabilities(p_IL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([I, L] bit probabilities q, [I] P(at least one bit) s) of independent bits whose masks,
    given at least one bit, include target j with probability p_j: q = p s with s the largest
    root of s = 1 - prod(1 - p_j s) (Newton from s = 1: the right side is concave in s)."""
    some = np.ones(p_IL.shape[0])
    for _ in range(_NEWTON_STEPS):
        free_IL = np.maximum(1.0 - p_IL * some[:, None], 0.0)
        none = free_IL.prod(axis=1)
        slope = none * (p_IL / np.maximum(free_IL, _TINY)).sum(axis=1) - 1.0
        some = np.clip(some - (1.0 - none - some) / np.minimum(slope, -_TINY), _MIN_SOME, 1.0)
    return np.minimum(p_IL * some[:, None], 1.0), some


def _target_probabilities(records: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """[..., L] P(a record of the list (or class) has target j)."""
    return np.clip(
        np.where(records[..., None] > 0, copies / np.maximum(records[..., None], 1.0), 0.0),
        0.0,
        1.0,
    )


def _walk(records: np.ndarray, q: np.ndarray, some: np.ndarray, x_IX: np.ndarray) -> np.ndarray:
    """[I, X, L] expected copies per target among the first x records of mask-sorted lists
    (``records`` [I]) of independent bits ``q`` [I, L] (``some`` [I]: P(at least one bit); 1
    where the empty mask is a record's too)."""
    g = q.shape[1]
    mass = records / some  # the walk counts the empty mask too: it sorts first
    left = x_IX + (mass - records)[:, None]
    subtree = np.broadcast_to(mass[:, None], x_IX.shape)
    taken_so_far = np.zeros(x_IX.shape)
    # Bit-major [L, I, X] scratch: each level writes one contiguous slab.
    below = np.empty((g,) + x_IX.shape)  # per target j: records of subtrees taken at bits above j
    taken = np.empty((g,) + x_IX.shape)
    on_path = np.empty((g,) + x_IX.shape)
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


@dataclass(frozen=True, slots=True)
class _Lists:
    """Owner lists (any leading shape [...]) split into their mask classes."""

    class_copies: np.ndarray
    """[..., K, G] copies per class and target GPU."""
    class_records: np.ndarray
    """[..., K] records per class (a top bit's copies; class 0 the rest, at least 0)."""
    starts: np.ndarray
    """[..., K + 1] where each class starts in the list (the last entry: the list's end)."""
    before: np.ndarray
    """[..., K + 1, G] copies of the classes before each class (the last: all the list's)."""
    q: np.ndarray
    """[..., K, L] each class's low-bit probabilities (``_bit_probabilities`` in class 0, which
    has no top bit; the bare frequencies in the others, where the empty low mask is a record's)."""
    some: np.ndarray
    """[..., K] P(at least one low bit) in the walk (1 outside class 0)."""

    @classmethod
    def of(cls, records: np.ndarray, class_copies: np.ndarray) -> _Lists:
        k, g = class_copies.shape[-2:]
        low = g - (k.bit_length() - 1)
        # A class >= 1 has a top bit on every record: its records are that bit's copies.
        top = class_copies[..., 1:, low:].max(axis=-1)
        class_records = np.concatenate(
            [np.maximum(records - top.sum(axis=-1), 0.0)[..., None], top], axis=-1
        )
        starts = np.concatenate(
            [np.zeros(records.shape + (1,)), np.cumsum(class_records, axis=-1)], axis=-1
        )
        before = np.concatenate(
            [np.zeros(records.shape + (1, g)), np.cumsum(class_copies, axis=-2)], axis=-2
        )
        q = _target_probabilities(class_records, class_copies[..., :low])
        some = np.ones(class_records.shape)
        if low:
            first = q[..., 0, :].reshape(-1, low)
            q0, some0 = _bit_probabilities(np.ascontiguousarray(first))
            q[..., 0, :], some[..., 0] = (
                q0.reshape(q.shape[:-2] + (low,)),
                some0.reshape(some.shape[:-1]),
            )
        return cls(
            class_copies=class_copies,
            class_records=class_records,
            starts=starts,
            before=before,
            q=q,
            some=some,
        )

    def copies_at(self, x: np.ndarray, index: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
        """[..., X, G] expected copies per target among the first x records of lists ``index``
        (fancy indices into the leading shape, broadcast to x's leading shape; None: all lists,
        x [..., X]) at positions x [..., X]: 0 before a list, all its copies at its end, whole
        classes plus the walk of the class a position falls inside."""
        pick = (lambda a: a[index]) if index is not None else (lambda a: a)
        starts, before = pick(self.starts), pick(self.before)
        k, g = self.class_copies.shape[-2:]
        low = self.q.shape[-1]
        # The class a position falls in: the last one starting at or before it (empty ones skipped).
        where_k = (starts[..., None, 1:k] <= x[..., None]).sum(axis=-1)  # [..., X]
        take = np.take_along_axis
        inside = x - take(starts, where_k, axis=-1)
        out = take(before[..., None, :, :], where_k[..., None, None], axis=-2)[
            ..., 0, :
        ].copy()  # [..., X, G]
        out = np.where((x >= starts[..., -1:])[..., None], before[..., None, -1, :], out)
        walked = (inside > 0) & (x < starts[..., -1:])
        at = np.nonzero(walked)
        if at[0].size:
            lead, cls_at = at[:-1], where_k[at]
            lists = (
                tuple(np.broadcast_to(i, x.shape[:-1])[lead] for i in index)
                if index is not None
                else lead
            )
            part = np.empty((at[0].size, g))
            cls_index = lists + (cls_at,)
            part[:, :low] = _walk(
                self.class_records[cls_index],
                self.q[cls_index],
                self.some[cls_index],
                inside[at][:, None],
            )[:, 0]
            part[:, low:] = inside[at][:, None] * (self.class_copies[cls_index][:, low:] > 0)
            out[at] = out[at] + part
        return out


def prefix_copies(
    records_I: np.ndarray, class_copies_IKG: np.ndarray, x_IX: np.ndarray
) -> np.ndarray:
    """[I, X, G] float64: expected copies per target GPU among the first x records of an owner's
    mask-sorted list (module docstring).

    Args:
        records_I: [I] records of each list.
        class_copies_IKG: [I, K, G] copies per mask class (``traffic.mask_classes``) and target
            GPU of each list (a class's records are its top bit's copies; class 0 the rest).
        x_IX: [I, X] positions, 0 <= x <= records.
    """
    records = np.asarray(records_I, dtype=np.float64)
    return _Lists.of(records, np.asarray(class_copies_IKG, dtype=np.float64)).copies_at(
        np.asarray(x_IX, np.float64)
    )


def arrival_copies_NNCGG(
    records_NGN: np.ndarray, class_copies_NGNKG: np.ndarray, topo: RailTopology, chunks: int
) -> np.ndarray:
    """[N_src, N_dst, C, G_arrive, G_target] float64: expected copies that arrive on GPU
    (d, l) from node s in rail chunk k and are for GPU (d, j), l == j included (they stay).
    Local pairs (s == d) are zero (no rail). Uses RailBalance's default eligible rails (all
    healthy ones) and remainder rotation 0.

    Runs the compiled twin (``ops.arrival_copies``) where the compiled ops load, else
    ``arrival_copies_reference`` (the meaning; the two agree bit for bit,
    tests/unit/test_arrival_copies_op.py).

    Args:
        records_NGN: [N, G, N] records owned by GPU (s, o) for node d.
        class_copies_NGNKG: [N, G, N, K, G] copies owner (s, o) sends to GPU (d, j) among its
            records of mask class k (``traffic.mask_classes``).
        chunks: rail chunks per wave (1: whole waves).
    """
    relay = _rail_relay_NNGG(records_NGN, topo)
    compiled = ops.arrival_copies(
        torch.from_numpy(np.ascontiguousarray(records_NGN, dtype=np.float64)),
        torch.from_numpy(np.ascontiguousarray(class_copies_NGNKG, dtype=np.float64)),
        relay,
        chunks=chunks,
    )
    if compiled is not None:
        return compiled.numpy()
    return _arrival_copies(records_NGN, class_copies_NGNKG, relay.numpy(), chunks)


def _rail_relay_NNGG(records_NGN: np.ndarray, topo: RailTopology) -> torch.Tensor:
    """[N, N, G, G] int64: RailBalance's relay (rotation 0, all healthy rails eligible)."""
    records_NNG = torch.from_numpy(np.ascontiguousarray(records_NGN.transpose(0, 2, 1))).to(
        torch.int64
    )
    return quota_and_relay(records_NNG, eligible_NNG(topo, records_NNG), balanced=True, phase=0)[1]


def arrival_copies_reference(
    records_NGN: np.ndarray, class_copies_NGNKG: np.ndarray, topo: RailTopology, chunks: int
) -> np.ndarray:
    """``arrival_copies_NNCGG`` in numpy: the meaning the compiled twin reproduces."""
    return _arrival_copies(
        records_NGN, class_copies_NGNKG, _rail_relay_NNGG(records_NGN, topo).numpy(), chunks
    )


def _arrival_copies(
    records_NGN: np.ndarray, class_copies_NGNKG: np.ndarray, relay: np.ndarray, chunks: int
) -> np.ndarray:
    n, g = records_NGN.shape[0], records_NGN.shape[1]
    remote = ~np.eye(n, dtype=bool)
    relay = np.where(remote[:, :, None, None], relay, 0).astype(
        np.float64
    )  # [s, d, owner, arrival]
    eye = np.eye(g, dtype=bool)
    keep = np.einsum("sdoo->sdo", relay)
    moved = np.where(eye, 0.0, relay)
    # An owner's list: kept part first, then its moved parts to arrival GPU 0, 1, ... in turn.
    records = records_NGN.transpose(0, 2, 1).astype(np.float64) * remote[:, :, None]  # [s, d, o]
    class_copies = (
        class_copies_NGNKG.transpose(0, 2, 1, 3, 4).astype(np.float64)
        * remote[:, :, None, None, None]
    )  # [s, d, o, k, j]
    lists = _Lists.of(records, class_copies)
    owner_copies = lists.before[..., -1, :]  # [s, d, o, j]
    moved_end = keep[..., None] + np.cumsum(
        moved, axis=-1
    )  # [s, d, o, l]: where the part for l ends
    # Where each part ends, in list order: keep, then l = 0 .. G-2 (the last ends at the list's
    # end).
    bounds = np.concatenate([keep[..., None], moved_end[..., :-1]], axis=-1)  # [s, d, o, G]
    at_bounds = lists.copies_at(bounds)  # [s, d, o, G, j]
    seg_copies = np.empty_like(at_bounds)  # [s, d, o, l, j]: the part moved to l (0 for l == o)
    np.subtract(at_bounds[..., 1:, :], at_bounds[..., :-1, :], out=seg_copies[..., :-1, :])
    np.subtract(owner_copies, at_bounds[..., -1, :], out=seg_copies[..., -1, :])
    seg_copies[:, :, np.arange(g), np.arange(g)] = at_bounds[
        :, :, :, 0
    ]  # the kept part: its first `keep`
    total = seg_copies.sum(axis=2)  # [s, d, l, j]
    if chunks == 1:
        return total[:, :, None]
    # Chunk cuts inside each arrival block (owners ascending): the owner each cut falls in and
    # the cut's position in that owner's list.
    block = relay.transpose(0, 1, 3, 2)  # [s, d, l, o] segment lengths in block order
    block_end = np.cumsum(block, axis=-1)
    cuts = np.cumsum(chunk_sizes(block_end[..., -1].astype(np.int64), chunks), axis=-1)[
        ..., :-1
    ].astype(np.float64)
    cut_owner = np.minimum(
        (block_end[..., None, :] <= cuts[..., None]).sum(axis=-1), g - 1
    )  # [s, d, l, C-1]
    pick = np.take_along_axis
    seg_start = np.where(eye, 0.0, moved_end - moved).transpose(
        0, 1, 3, 2
    )  # [s, d, l, o] in the owner's list
    position = (
        pick(seg_start, cut_owner, axis=-1) + cuts - pick(block_end - block, cut_owner, axis=-1)
    )
    s_i, d_i, l_i = np.ix_(np.arange(n), np.arange(n), np.arange(g))
    s_i, d_i, l_i = s_i[..., None], d_i[..., None], l_i[..., None]
    at_cut = lists.copies_at(position[..., None], (s_i, d_i, cut_owner))[..., 0, :]
    # Where the cut owner's part starts: 0 for its kept part, else where its previous part ends.
    at_start = np.where((cut_owner == l_i)[..., None], 0.0, at_bounds[s_i, d_i, cut_owner, l_i])
    owners_before = (np.arange(g) < cut_owner[..., None]).astype(np.float64)  # [s, d, l, C-1, o]
    cum = (
        np.einsum("sdlko,sdolj->sdlkj", owners_before, seg_copies) + at_cut - at_start
    )  # [s, d, l, C-1, j]
    cum = np.concatenate([np.zeros_like(cum[..., :1, :]), cum, total[:, :, :, None]], axis=-2)
    return np.diff(cum, axis=-2).transpose(0, 1, 3, 2, 4)  # [s, d, C, l, j]
