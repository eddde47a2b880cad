"""Max-min fair rates of one set of flows (parallel progressive filling), used by `maxmin`.

Shape letters: L links (+1: a sentinel link L of infinite capacity that pads short
paths), H hops per flow, A active flow classes, E entries (one per class and hop, sorted
by link).

Progressive filling raises all rates together and freezes the flows of each link as it
saturates. Both functions here freeze many links per round: a link is a *local minimum*
when no unfrozen flow through it sees a clearly smaller fair share (remaining capacity /
unfrozen weight) on another of its links; its flows are then frozen at their smallest
share. Frozen rates never exceed the shares of the other links they cross, so shares only
grow, and freezing any set of local minima is exact progressive filling; the global
minimum is always one, so every round makes progress.

`max_min_rates` tests every link in every round: O(A H) numpy work per round.
`max_min_rates_indexed` tests only the k links with the smallest shares (k = a few times
the number of minima found in the previous round), reading their flows through a
link-sorted index (`LinkIndex`), so a round costs O(flows of those k links) plus O(L).
Dense traffic has deep bottleneck chains (about 200 rounds per event for a 256 x 8 rail
all-to-all with random sizes), where this is 3-4x less work; on small sets the plain
version wins (fewer numpy calls per round), and `maxmin` switches by size.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LinkIndex", "max_min_rates", "max_min_rates_indexed"]

SHARE_TOL = 1e-9
"""Shares within this relative distance count as equal in the local-minimum test."""


def max_min_rates(
    links_HA: np.ndarray, weight_A: np.ndarray, capacity_L1: np.ndarray
) -> np.ndarray:
    """Max-min fair per-flow rates of weighted classes, testing every link each round.

    Args:
        links_HA: [H, A] intp, C-contiguous, row h = the h-th link of each class; padding
            points at the sentinel link L. Hop-major so that reductions over hops run along
            contiguous rows (numpy reduces a short inner axis slowly).
        weight_A: [A] float64, integer-valued > 0, flows per class (so link loads are exact).
        capacity_L1: [L + 1] float64, capacities; the last entry is inf.

    Returns:
        [A] float64 > 0, rate of each flow of each class.
    """
    num_links1 = capacity_L1.size
    num_hops = links_HA.shape[0]
    links, weight = links_HA, weight_A
    load_L1 = np.bincount(
        links.ravel(), weights=np.concatenate((weight,) * num_hops), minlength=num_links1
    )
    remaining_L1 = capacity_L1.copy()
    rate_A = np.empty(weight_A.size)
    idx = np.arange(weight_A.size)
    while True:
        share_L1 = _shares(remaining_L1, load_L1)
        share_HA = share_L1.take(links)
        fmin_A = share_HA.min(axis=0)
        # np.compress: boolean-mask indexing is several times slower here.
        blocking = share_HA > fmin_A * (1.0 + SHARE_TOL)
        blocked_L1 = np.zeros(num_links1, dtype=bool)
        blocked_L1[np.compress(blocking.ravel(), links.ravel())] = True
        blocked_L1[-1] = True
        freeze = ~blocked_L1[links].all(axis=0)
        frozen = np.flatnonzero(freeze)
        assert frozen.size, "water-filling made no progress"
        if frozen.size == idx.size:
            rate_A[idx] = fmin_A
            break
        rate = fmin_A[frozen]
        rate_A[idx[frozen]] = rate
        # np.take along axis 1: plain fancy indexing ``links[:, i]`` is several times slower.
        _consume(remaining_L1, load_L1, links.take(frozen, axis=1), weight[frozen], rate)
        kept = np.flatnonzero(~freeze)
        links, weight, idx = links.take(kept, axis=1), weight[kept], idx[kept]
    assert np.all(rate_A > 0), "water-filling produced a zero rate"
    return rate_A


class LinkIndex:
    """Entries (class position, hop) of the active classes sorted by link: a CSR by link.

    Rebuilt when classes are added (`build`), filtered when classes leave (`compact`).
    """

    def __init__(self, links_HA: np.ndarray, num_links1: int):
        self.num_links1 = num_links1
        self.build(links_HA)

    def build(self, links_HA: np.ndarray) -> None:
        """Index every entry of ``links_HA`` ([H, A] intp)."""
        flat = links_HA.ravel()
        if flat.size == 0:
            self.pos_E = self.link_E = np.empty(0, dtype=np.intp)
            self._set_ptr()
            return
        # A stable sort of small unsigned ints is a radix sort in numpy: O(E).
        key = flat.astype(np.uint16) if self.num_links1 <= np.iinfo(np.uint16).max else flat
        order = np.argsort(key, kind="stable")
        self.pos_E = order % links_HA.shape[1]
        self.link_E = flat[order]
        self._set_ptr()

    def compact(self, kept_A: np.ndarray, num_active: int) -> None:
        """Keep the entries of the classes at ``kept_A`` (sorted positions) and renumber them."""
        new_pos = np.full(num_active, -1, dtype=np.intp)
        new_pos[kept_A] = np.arange(kept_A.size)
        pos = new_pos[self.pos_E]
        keep = pos >= 0
        self.pos_E = np.compress(keep, pos)
        self.link_E = np.compress(keep, self.link_E)
        self._set_ptr()

    def _set_ptr(self) -> None:
        self.ptr_L2 = np.zeros(self.num_links1 + 1, dtype=np.intp)
        np.cumsum(np.bincount(self.link_E, minlength=self.num_links1), out=self.ptr_L2[1:])

    def entries_of(self, links_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, links) of every entry on the given links, link by link."""
        start_K = self.ptr_L2[links_K]
        count_K = self.ptr_L2[links_K + 1] - start_K
        total = int(count_K.sum())
        # Expand the ranges [start, start + count) without a Python loop.
        offset_K = np.cumsum(count_K) - count_K
        ent = np.arange(total) + np.repeat(start_K - offset_K, count_K)
        return self.pos_E[ent], self.link_E[ent]


def max_min_rates_indexed(
    links_HA: np.ndarray, weight_A: np.ndarray, capacity_L1: np.ndarray, index: LinkIndex
) -> np.ndarray:
    """Same result as `max_min_rates`, testing only the links with the smallest shares.

    Args:
        links_HA: [H, A] intp, as in `max_min_rates`.
        weight_A: [A] float64, as in `max_min_rates`.
        capacity_L1: [L + 1] float64, as in `max_min_rates`.
        index: the `LinkIndex` of exactly these A classes.

    Returns:
        [A] float64 > 0, rate of each flow of each class.
    """
    num_links1 = capacity_L1.size
    num_active = weight_A.size
    load_L1 = np.bincount(index.link_E, weights=weight_A[index.pos_E], minlength=num_links1)
    remaining_L1 = capacity_L1.copy()
    rate_A = np.empty(num_active)
    live_A = np.ones(num_active, dtype=bool)
    slot_A = np.empty(num_active, dtype=np.intp)  # scratch, read only where just written
    num_live = num_active
    num_cand = max(1, int(np.count_nonzero(load_L1[:-1])) // 16)
    while num_live:
        share_L1 = _shares(remaining_L1, load_L1)
        loaded = np.flatnonzero(load_L1[:-1] > 0.5)
        if num_cand < loaded.size:
            share_K = share_L1[loaded]
            tau = np.partition(share_K, num_cand - 1)[num_cand - 1]
            cand = np.compress(share_K <= tau, loaded)
        else:
            cand = loaded
        pos, link = index.entries_of(cand)
        live = live_A[pos]
        pos, link = np.compress(live, pos), np.compress(live, link)
        fmin = share_L1.take(links_HA.take(pos, axis=1)).min(axis=0)
        blocked_L1 = np.zeros(num_links1, dtype=bool)
        blocked_L1[np.compress(share_L1[link] > fmin * (1.0 + SHARE_TOL), link)] = True
        at_min = ~blocked_L1[link]
        frozen, rate = np.compress(at_min, pos), np.compress(at_min, fmin)
        # A class on two local-minimum links appears twice: keep one entry per class
        # (the last write into the scratch array wins), without sorting.
        slot_A[frozen] = np.arange(frozen.size)
        once = np.flatnonzero(slot_A[frozen] == np.arange(frozen.size))
        frozen, rate = frozen[once], rate[once]
        assert frozen.size, "water-filling made no progress"
        rate_A[frozen] = rate
        live_A[frozen] = False
        num_live -= frozen.size
        if num_live:
            _consume(remaining_L1, load_L1, links_HA.take(frozen, axis=1), weight_A[frozen], rate)
        # Next round, test a few times as many links as were minima now: local minima sit
        # among the smallest shares, but not only there (measured on dense rail traffic:
        # about 20 minima per round, rank up to a few hundred of ~2,000 links).
        num_min = cand.size - int(np.count_nonzero(blocked_L1[cand]))
        num_cand = 3 * num_min + 8
    assert np.all(rate_A > 0), "water-filling produced a zero rate"
    return rate_A


def _shares(remaining_L1: np.ndarray, load_L1: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        share_L1 = remaining_L1 / load_L1
    share_L1[-1] = np.inf
    return share_L1


def _consume(
    remaining_L1: np.ndarray,
    load_L1: np.ndarray,
    links_HF: np.ndarray,
    weight_F: np.ndarray,
    rate_F: np.ndarray,
) -> None:
    """Take frozen classes (links [H, F], weights, rates) out of the links' capacity and load."""
    num_hops = links_HF.shape[0]
    flat = links_HF.ravel()
    remaining_L1 -= np.bincount(
        flat, weights=np.concatenate((weight_F * rate_F,) * num_hops), minlength=remaining_L1.size
    )
    load_L1 -= np.bincount(
        flat, weights=np.concatenate((weight_F,) * num_hops), minlength=load_L1.size
    )
    np.maximum(remaining_L1, 0.0, out=remaining_L1)
