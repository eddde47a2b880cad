"""Sending arrangements (RING, MODERATE, EXTREME) and the demand transformation of the replay.

Letters: N nodes (s source, d destination), G GPUs per node, W = N * G ranks, M = 2**G target
masks, E experts, T tokens, K top-k, V = N - 1 sending windows.

An arrangement is a ``WaveSchedule`` of V windows in which every source node sends to exactly one
remote node per window, so each ordered remote pair is sent exactly once (``dest_NV[s, v]`` is the
destination of s in window v). Patterns differ in how many sources meet at one receiver:
  RING      window v: s -> s + v + 1 (mod N); peak incast 1 in every window.
  MODERATE  the shifts k and N - k are mixed into two windows: in one, nodes s < ceil(N/2) send
            +k and the others -k, in the other the reverse; each window has peak incast <= 2
            (two sources meet where the halves touch). Shift N/2 (N even) stays a one-to-one
            window. Order: mixed windows for k = 1, 2, ..., then shift N/2, then the partner
            windows in reverse order. N = 4: peaks [2, 1, 2] (the paper's MODERATE).
  EXTREME   targets t = 0..N-3 each get a window in which every other node sends to t (incast
            N - 1); t itself sends to a = N - 2 (t even) or b = N - 1 (t odd). In the last window
            a and b swap and every target sends to the one of a, b it has not reached yet.
            Peaks [N - 1] * (N - 2) + [1 + ceil((N - 2) / 2)]; N = 4: [3, 3, 2] (the paper's).

The transformation (paper: patterns "keep each source's total volume and destination-local-GPU
histogram but change which node pairs send together"): the records a source rank sends to remote
nodes are relabelled to new destination nodes; a record keeps its source rank and its target mask
over the destination node's local GPUs, and local (same-node) records are untouched. Window v's
share of a source goes to ``dest_NV[s, v]``. Two modes:
  "even"     a source rank's remote records are pooled and split evenly over the V windows, per
             target mask (counts differ by at most one; the remainders rotate with the rank), so
             receivers concentrate exactly as the pattern says;
  "relabel"  the records for the node at ring distance v + 1 (d = s + v + 1) move as a whole to
             window v; per-pair volumes survive, only the node labels change.
Either way each rank keeps its remote total and its histogram of masks, hence of destination-local
GPUs. On top-k ids (``arrange_topk_ids``), a token's remote experts keep their local index and move
to the new node; "relabel" gives exactly the counts of ``arrange``, "even" rotates each token's
windows so that the tokens of a rank with the same set of remote windows cycle through all
rotations (window shares equal within a few records, masks only in expectation), and never merges
two records of a token. NATIVE and RAIL keep the arrangement's windows
(``PlanOptions(windows=...)``); PERM and JOINT run the same demand in one-to-one waves.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from enum import StrEnum
from typing import Literal

import numpy as np
import torch

from megatron_railwave.planner.waves import WaveSchedule
from megatron_railwave.telemetry.capture import LayerTrace, Trace
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "Pattern",
    "ArrangeMode",
    "arrangement_schedule",
    "window_peaks",
    "arrange",
    "arrange_topk_ids",
    "arrange_trace",
]

ArrangeMode = Literal["even", "relabel"]


class Pattern(StrEnum):
    """The paper's sending arrangements (see the module docstring for N nodes)."""

    RING = "ring"
    MODERATE = "moderate"
    EXTREME = "extreme"


def _ring_NV(n: int) -> np.ndarray:
    return (np.arange(n)[:, None] + np.arange(1, n)[None, :]) % n


def _moderate_NV(n: int) -> np.ndarray:
    half = np.arange(n) < (n + 1) // 2
    node = np.arange(n)
    first, second = [], []
    for k in range(1, (n - 1) // 2 + 1):
        first.append(np.where(half, node + k, node - k) % n)
        second.append(np.where(half, node - k, node + k) % n)
    middle = [(node + n // 2) % n] if n % 2 == 0 and n > 1 else []
    return np.stack(first + middle + second[::-1], axis=1) if n > 1 else np.zeros((n, 0), np.int64)


def _extreme_NV(n: int) -> np.ndarray:
    if n < 3:
        return _ring_NV(n)
    a, b = n - 2, n - 1
    dest = np.zeros((n, n - 1), dtype=np.int64)
    for t in range(n - 2):
        dest[:, t] = t
        dest[t, t] = a if t % 2 == 0 else b
    dest[a, n - 2], dest[b, n - 2] = b, a
    for t in range(n - 2):
        dest[t, n - 2] = b if t % 2 == 0 else a
    return dest


@functools.lru_cache(maxsize=64)
def arrangement_schedule(pattern: Pattern | str, num_nodes: int) -> WaveSchedule:
    """The V = N - 1 sending windows of a pattern (kind 'arrangement:<pattern>')."""
    pattern = _parse_pattern(pattern)
    build = {Pattern.RING: _ring_NV, Pattern.MODERATE: _moderate_NV, Pattern.EXTREME: _extreme_NV}
    dest_NV = build[pattern](num_nodes)
    waves = tuple(
        tuple((s, int(dest_NV[s, v])) for s in range(num_nodes)) for v in range(dest_NV.shape[1])
    )
    return WaveSchedule(num_nodes=num_nodes, waves=waves, kind=f"arrangement:{pattern}")


def _parse_pattern(pattern: Pattern | str) -> Pattern:
    try:
        return Pattern(str(pattern).strip().lower())
    except ValueError:
        raise ValueError(
            f"unknown arrangement pattern {pattern!r}; choose one of {[p.value for p in Pattern]}"
        ) from None


def window_peaks(schedule: WaveSchedule) -> list[int]:
    """Peak incast degree (most senders into one node) of every window."""
    peaks = []
    for wave in schedule.waves:
        counts = np.bincount([d for _, d in wave], minlength=schedule.num_nodes)
        peaks.append(int(counts.max()) if wave else 0)
    return peaks


def _dest_NV(schedule: WaveSchedule) -> np.ndarray:
    """[N, V] destination of each source per window; requires one destination per source."""
    n = schedule.num_nodes
    dest = np.full((n, schedule.num_waves), -1, dtype=np.int64)
    for v, wave in enumerate(schedule.waves):
        for s, d in wave:
            dest[s, v] = d
    if schedule.num_waves != n - 1 or (dest < 0).any():
        raise ValueError(
            f"schedule {schedule.kind!r} is not a sending arrangement: it needs N - 1 = {n - 1} "
            f"windows with exactly one destination per source node, got {schedule.num_waves} "
            f"windows"
        )
    return dest


def _resolve(
    pattern: Pattern | str | WaveSchedule, topo: RailTopology
) -> tuple[WaveSchedule, np.ndarray]:
    schedule = (
        pattern
        if isinstance(pattern, WaveSchedule)
        else arrangement_schedule(pattern, topo.num_nodes)
    )
    if schedule.num_nodes != topo.num_nodes:
        raise ValueError(
            f"arrangement is for {schedule.num_nodes} nodes but topology {topo.name!r} has "
            f"{topo.num_nodes}"
        )
    return schedule, _dest_NV(schedule)


def _even_split(hist_WX: torch.Tensor, parts: int) -> torch.Tensor:
    """[W, V, X]: category x's records of row w, laid end to end, go round-robin to the V parts
    starting at part w mod V, so per-part totals and per-category counts differ by at most one."""
    world = hist_WX.shape[0]
    hi = hist_WX.cumsum(dim=1)
    lo = hi - hist_WX
    # record j of row w goes to part (j + w) mod V; count j in [lo, hi) with j = r mod V.
    r = (torch.arange(parts).view(1, parts, 1) - torch.arange(world).view(world, 1, 1)) % parts

    def upto(x: torch.Tensor) -> torch.Tensor:  # #{j in [0, x): j = r (mod V)}
        return torch.div(x.unsqueeze(1) - r + parts - 1, parts, rounding_mode="floor")

    return upto(hi) - upto(lo)


def arrange(
    demand: DemandCounts,
    pattern: Pattern | str | WaveSchedule,
    topo: RailTopology,
    *,
    mode: ArrangeMode = "even",
) -> tuple[DemandCounts, WaveSchedule]:
    """Relabel a layer's demand onto an arrangement's windows.

    Args:
        demand: the layer's global ``DemandCounts`` ([W, N, M] records, [W, E] experts).
        pattern: RING / MODERATE / EXTREME (or its name), or an explicit arrangement schedule.
        topo: the cluster.
        mode: "even" (pool and split per window) or "relabel" (move whole node pairs).

    Returns:
        (arranged demand, the windows): per rank, remote totals and mask histograms are unchanged.
        ``experts_WE`` moves with the records (in "even" mode pooled per local expert index and
        split alike; the planner does not read it).
    """
    if mode not in ("even", "relabel"):
        raise ValueError(f"unknown arrange mode {mode!r}; choose 'even' or 'relabel'")
    schedule, dest_NV = _resolve(pattern, topo)
    n, g = topo.num_nodes, topo.gpus_per_node
    records_WNM, experts_WE = demand.records_WNM, demand.experts_WE
    world, num_experts = experts_WE.shape
    if tuple(records_WNM.shape) != (topo.world_size, n, 1 << g):
        raise ValueError(
            f"demand has shape {list(records_WNM.shape)}, expected [W, N, M] = "
            f"[{topo.world_size}, {n}, {1 << g}] for topology {topo.name!r}"
        )
    if n < 2:
        return demand, schedule
    per_node = num_experts // n
    experts_WNX = experts_WE.view(world, n, per_node)
    src_W = torch.arange(world) // g
    dest_WV = torch.as_tensor(dest_NV)[src_W]  # [W, V]
    local = torch.nn.functional.one_hot(src_W, n).to(torch.bool)  # [W, N]
    out_records = records_WNM * local.unsqueeze(-1)
    out_experts = experts_WNX * local.unsqueeze(-1)
    idx_W = torch.arange(world).view(world, 1)
    if mode == "relabel":
        ring_WV = (src_W.view(world, 1) + torch.arange(1, n).view(1, n - 1)) % n
        out_records[idx_W, dest_WV] = records_WNM[idx_W, ring_WV]
        out_experts[idx_W, dest_WV] = experts_WNX[idx_W, ring_WV]
    else:
        remote = ~local.unsqueeze(-1)
        out_records[idx_W, dest_WV] = _even_split((records_WNM * remote).sum(dim=1), n - 1)
        out_experts[idx_W, dest_WV] = _even_split((experts_WNX * remote).sum(dim=1), n - 1)
    arranged = DemandCounts(
        records_WNM=out_records, experts_WE=out_experts.reshape(world, num_experts)
    )
    return arranged, schedule


def arrange_topk_ids(
    topk_ids_WTK: np.ndarray,
    pattern: Pattern | str | WaveSchedule,
    topo: RailTopology,
    *,
    num_experts: int,
    mode: ArrangeMode = "even",
) -> tuple[np.ndarray, WaveSchedule]:
    """Token-level arrangement: [W, T, K] ids -> [W, T, K] int16 ids (rows ascending), windows.

    A remote expert keeps its index within its node and moves to the node its token's record is
    relabelled to; local experts and -1 slots stay. See the module docstring for the modes.
    """
    schedule, dest_NV = _resolve(pattern, topo)
    if mode not in ("even", "relabel"):
        raise ValueError(f"unknown arrange mode {mode!r}; choose 'even' or 'relabel'")
    ids = np.asarray(topk_ids_WTK).astype(np.int64)
    world, num_tokens, _ = ids.shape
    topo.check_world_size(world)
    n, g = topo.num_nodes, topo.gpus_per_node
    if n < 2:
        return ids.astype(np.int16), schedule
    per_node = num_experts // n
    valid = ids >= 0
    node = np.where(valid, ids // per_node, -1)
    src = (np.arange(world) // g).reshape(world, 1, 1)
    remote = valid & (node != src)
    window = (node - src - 1) % n  # ring distance - 1, in 0..V-1 for remote experts
    if mode == "even":
        window = (window + _token_rotation(remote, window, n - 1)[:, :, None]) % (n - 1)
    new_node = dest_NV[np.broadcast_to(src, ids.shape), np.where(remote, window, 0)]
    out = np.where(remote, ids + (new_node - node) * per_node, ids)
    out = np.sort(np.where(out < 0, num_experts, out), axis=-1)
    return np.where(out == num_experts, -1, out).astype(np.int16), schedule


def _token_rotation(remote_WTK: np.ndarray, window_WTK: np.ndarray, parts: int) -> np.ndarray:
    """[W, T] window rotation of every token for mode "even".

    Tokens of one rank that occupy the same set of windows form a class; the i-th token of a
    class is rotated by (i + w) mod V, so each class spreads evenly over the windows and every
    window's share of a rank is within (number of classes) records of equal.
    """
    world, num_tokens, _ = remote_WTK.shape
    occupied_WTV = np.zeros((world, num_tokens, parts), dtype=bool)
    w_idx, t_idx, k_idx = np.nonzero(remote_WTK)
    occupied_WTV[w_idx, t_idx, window_WTK[w_idx, t_idx, k_idx]] = True
    rows = np.concatenate(
        [np.repeat(np.arange(world), num_tokens)[:, None], occupied_WTV.reshape(-1, parts)], axis=1
    )
    _, group = np.unique(rows, axis=0, return_inverse=True)
    group = group.ravel()
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    position = np.empty_like(group)
    position[order] = np.arange(group.size) - np.repeat(starts, np.diff(np.r_[starts, group.size]))
    rot = position.reshape(world, num_tokens) + np.arange(world)[:, None]
    return rot % parts


def arrange_trace(
    trace: Trace, pattern: Pattern | str | WaveSchedule, *, mode: ArrangeMode = "even"
) -> tuple[Trace, WaveSchedule]:
    """Every layer of a trace arranged (``arrange_topk_ids``); meta.extra records the pattern."""
    meta, topo = trace.meta, trace.meta.topology
    layers, schedule = [], None
    for lt in trace.layers:
        ids, schedule = arrange_topk_ids(
            lt.topk_ids_WTK, pattern, topo, num_experts=meta.num_experts, mode=mode
        )
        layers.append(LayerTrace(layer=lt.layer, topk_ids_WTK=ids))
    if schedule is None:
        schedule, _ = _resolve(pattern, topo)
    label = schedule.kind if isinstance(pattern, WaveSchedule) else str(_parse_pattern(pattern))
    extra = {
        **meta.extra,
        "arrangement": label,
        "arrange_mode": mode,
        "windows": schedule.to_list(),
    }
    return Trace(meta=replace(meta, extra=extra), layers=tuple(layers)), schedule
