"""Pure-torch reference of the RailWave data-movement ops: the definition of their meaning.

Letters: T tokens of one rank, E experts, N nodes, G GPUs per node, M = 2**G target masks,
C = T * N record capacity of one rank, n rows, H row width.

Every op here runs on any device with plain torch ops and never synchronises with the host
(no ``.item()``, no ``nonzero``, no ``bincount``, no boolean-mask indexing): output sizes come
from the arguments' shapes or from host integers the caller passes. The compiled ops
(``torch.ops.railwave.*``, csrc/) must return bitwise-identical results; the tests hold them
to that.

Canonical record order (the planner's): by destination node, then target mask, then token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "RowSpec",
    "records_from_routing",
    "assign_egress",
    "pack_rows",
    "unpack_rows",
    "row_bytes",
    "segment_sum",
    "records_per_node_rail",
]

RowSpec = tuple[torch.dtype, tuple[int, ...]]
"""(dtype, per-row shape) of one tensor packed into a byte row."""


def records_from_routing(
    routing_map_TE: torch.Tensor, num_nodes: int, gpus_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unique (token, destination node) records of one rank, in canonical order.

    Experts are placed contiguously: expert e lives on GPU (e // E_node, (e % E_node) // E_loc)
    with E_node = E / N and E_loc = E_node / G.

    Args:
        routing_map_TE: [T, E] bool, rank-local; True where the token is routed to the expert.
        num_nodes: N.
        gpus_per_node: G (1..8).

    Returns:
        token_C: [C] int64, token of each record; -1 past the last record.
        node_C: [C] int64, destination node; -1 past the last record.
        mask_C: [C] int64, target-GPU mask (bit j: GPU j of that node owns one of the token's
            experts); 0 past the last record.
        counts_NM: [N, M] int64, records per (node, mask); column 0 is zero. The number of
            records is ``counts_NM.sum()``: it stays on the device (no host sync).
    """
    t, e = routing_map_TE.shape
    n, g = num_nodes, gpus_per_node
    m = 1 << g
    device = routing_map_TE.device
    if e % (n * g):
        raise ValueError(f"E={e} experts do not split evenly over {n} nodes x {g} GPUs")
    hit_NTG = routing_map_TE.view(t, n, g, e // (n * g)).any(dim=-1).transpose(0, 1)
    weights_G = torch.ones(g, dtype=torch.int64, device=device) << torch.arange(g, device=device)
    mask_NT = (hit_NTG.to(torch.int64) * weights_G).sum(dim=-1)
    node_NT = torch.arange(n, dtype=torch.int64, device=device).unsqueeze(1).expand(n, t)
    # Sort key node * M + mask; "no record" (mask 0) sorts last. The stable sort of the
    # node-major flattening keeps tokens ascending inside each (node, mask) group.
    key_C = torch.where(mask_NT > 0, node_NT * m + mask_NT, n * m).reshape(-1)
    order_C = torch.sort(key_C, stable=True).indices
    valid_C = key_C[order_C] < n * m
    token_C = torch.where(valid_C, order_C % t if t else order_C, -1)
    node_C = torch.where(valid_C, order_C // max(t, 1), -1)
    mask_C = torch.where(valid_C, mask_NT.reshape(-1)[order_C], 0)
    counts = torch.zeros(n * m + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_C, torch.ones_like(key_C))
    return token_C, node_C, mask_C, counts[: n * m].view(n, m)


def assign_egress(
    node_R: torch.Tensor,
    *,
    owner_gpu: int,
    counts_N: torch.Tensor,
    keep_N: torch.Tensor,
    surplus_lo_N: torch.Tensor,
    deficit_hi_NG: torch.Tensor,
    wave_N: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RailBalance on the device: each record's egress GPU and wave.

    The records of one owner GPU for one destination node are in canonical order; the owner
    keeps the first ``keep_N[d]`` and hands the rest, in order, to its proxies: the surplus
    record at position p of the node pair's surplus line goes to the first GPU l whose deficit
    interval ends after p (``planner.railbalance``'s greedy fill).

    Args:
        node_R: [n] int64, destination node of each record, non-decreasing (canonical order);
            -1 past the last record (``records_from_routing``'s padding), which gets egress -1
            and wave -1, so the padded capacity-sized output can be passed without a host sync.
        owner_gpu: g, the local GPU that owns the records.
        counts_N: [N] int64, records of this owner per destination node (``node_R``'s histogram).
        keep_N: [N] int64, records the owner keeps on its own rail per destination node.
        surplus_lo_N: [N] int64, start of this owner's surplus on each pair's surplus line.
        deficit_hi_NG: [N, G] int64, end of GPU l's deficit interval on the pair's deficit line.
        wave_N: [N] int64, wave of each destination node (-1 for the local node).

    Returns:
        egress_R: [n] int64, local GPU whose rail carries the record (-1 for padding).
        wave_R: [n] int64, wave of the record's node pair (-1 for padding).
    """
    n = node_R.numel()
    device = node_R.device
    valid_R = node_R >= 0
    # Padding (-1) would index the last node from the end: give it node 0's row, then mask it.
    node_c = node_R.clamp(min=0)
    start_N = torch.cumsum(counts_N, 0) - counts_N
    pos_R = torch.arange(n, dtype=torch.int64, device=device) - start_N[node_c]
    keep_R = keep_N[node_c]
    surplus_pos_R = (surplus_lo_N[node_c] + pos_R - keep_R).clamp(min=0)
    proxy_R = (deficit_hi_NG[node_c] <= surplus_pos_R.unsqueeze(1)).sum(dim=1)
    egress_R = torch.where(valid_R, torch.where(pos_R < keep_R, owner_gpu, proxy_R), -1)
    return egress_R, torch.where(valid_R, wave_N[node_c], -1)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] -> [rows, width] contiguous (width = product of the other dims)."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    # An explicit width: reshape(0, -1) is ambiguous for zero rows.
    return t.reshape(t.shape[0], width).contiguous()


def row_bytes(specs: Sequence[RowSpec]) -> int:
    """Bytes of one packed row holding one row of each spec."""
    total = 0
    for dtype, shape in specs:
        width = 1
        for size in shape:
            width *= size
        total += width * dtype.itemsize
    return total


def pack_rows(
    tensors: Sequence[torch.Tensor], row_index: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Gather rows of several tensors (any dtypes) side by side into one byte buffer.

    Args:
        tensors: each [rows_k, *shape_k], same device.
        row_index: per tensor, [n] int64 rows to take (None: all rows, rows_k == n).

    Returns:
        [n, row_bytes] uint8: row i holds ``tensors[k][row_index[k][i]]`` for k = 0, 1, ...
        as raw bytes, in order.
    """
    parts = []
    n = None
    for t, idx in zip(tensors, row_index, strict=True):
        rows = _as_rows(t if idx is None else t.index_select(0, idx))
        if n is None:
            n = rows.shape[0]
        elif rows.shape[0] != n:
            raise ValueError(f"pack_rows: tensors give {rows.shape[0]} and {n} rows")
        parts.append(
            rows.view(torch.uint8) if rows.shape[1] else rows.new_empty((n, 0)).view(torch.uint8)
        )
    return torch.cat(parts, dim=1)


def unpack_rows(
    packed: torch.Tensor,
    specs: Sequence[RowSpec],
    *,
    row_index: torch.Tensor | None = None,
    num_rows: int | None = None,
) -> list[torch.Tensor]:
    """Inverse of ``pack_rows``: split byte rows back into typed tensors.

    Args:
        packed: [n, row_bytes(specs)] uint8.
        specs: (dtype, shape) of each tensor, in packing order.
        row_index: [n] int64 distinct output rows (None: row i goes to row i).
        num_rows: output rows when ``row_index`` is given (rows not written are zero; with
            num_rows = n, a full permutation, every row is written and nothing is zero-filled).

    Returns:
        Per spec, [n or num_rows, *shape] of that dtype.
    """
    n = packed.shape[0]
    if packed.shape[1] != row_bytes(specs):
        raise ValueError(
            f"unpack_rows: rows have {packed.shape[1]} bytes, specs need {row_bytes(specs)}"
        )
    out, offset = [], 0
    for dtype, shape in specs:
        width = row_bytes([(dtype, shape)])
        # A fresh copy, not .contiguous(): with 0 or 1 rows the slice already counts as contiguous
        # and keeps its byte offset, which view(dtype) rejects for offsets not a multiple of the
        # element size.
        if width == 0:  # nothing to copy (and view(dtype) rejects a [n, 0] byte tensor's strides)
            part = packed.new_empty((n, *shape), dtype=dtype)
        else:
            part = packed[:, offset : offset + width].clone(memory_format=torch.contiguous_format)
            part = part.view(dtype).reshape(n, *shape)
        offset += width
        if row_index is not None:
            if num_rows is None:
                raise ValueError("unpack_rows: num_rows is required with row_index")
            # n distinct rows of num_rows = n: a full permutation writes every row, so the
            # output needs no zero fill (decided from the sizes, no host sync).
            fresh = part.new_empty if n == num_rows else part.new_zeros
            part = fresh((num_rows, *shape)).index_copy_(0, row_index, part)
        out.append(part)
    return out


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_sum(
    values: torch.Tensor,
    segment_ids: torch.Tensor,
    num_segments: int,
    *,
    out_dtype: torch.dtype | None = None,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """Sum rows into segments in a fixed order: bitwise reproducible on every device.

    ``out[s] = cast(((0 + v[i0]) + v[i1]) + ...)`` over the rows i0 < i1 < ... with
    ``segment_ids[i] == s``, accumulated in float32 (float64 for float64 input), rounded to
    nearest at every addition, cast to ``out_dtype`` once. Empty segments are zero.

    Args:
        values: [n, *shape] floating point.
        segment_ids: [n] int64; rows with an id outside [0, num_segments) are left out (the
            exchange marks padding rows so), the same in the compiled ops on CPU and CUDA.
        num_segments: S.
        out_dtype: result dtype (default: ``values.dtype``).
        max_segment_len: an upper bound on the rows of one segment (host int). Off the CPU the
            reference adds position by position, so it needs the bound; None means n.

    Returns:
        [S, *shape] of ``out_dtype``.
    """
    out_dtype = out_dtype or values.dtype
    acc_dtype = _accumulation_dtype(values.dtype)
    # One extra segment takes the rows whose id is out of range; it is dropped at the end.
    acc = torch.zeros((num_segments + 1, *values.shape[1:]), dtype=acc_dtype, device=values.device)
    if values.shape[0] == 0:
        return acc[:num_segments].to(out_dtype)
    ids = torch.where((segment_ids >= 0) & (segment_ids < num_segments), segment_ids, num_segments)
    v = values.to(acc_dtype)
    if values.device.type == "cpu":
        # CPU index_add_ walks the index in order, one addition per row: the fixed order.
        return acc.index_add_(0, ids, v)[:num_segments].to(out_dtype)
    return _segment_sum_stepwise(acc, v, ids, max_segment_len)[:num_segments].to(out_dtype)


def _segment_sum_stepwise(
    acc: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor, max_segment_len: int | None
) -> torch.Tensor:
    """``segment_sum``'s order on any device: step k adds the k-th row of every segment."""
    num_segments = acc.shape[0]
    # Elsewhere index_add_ uses atomics (order not fixed), so add the k-th row of every segment
    # in step k: each step touches every segment at most once. Rows not at step k add +0.0,
    # which leaves every accumulator unchanged (an accumulator that starts at +0.0 is never -0.0).
    n = v.shape[0]
    order = torch.sort(segment_ids, stable=True).indices
    counts = torch.zeros(num_segments, dtype=torch.int64, device=v.device)
    counts.scatter_add_(0, segment_ids, torch.ones_like(segment_ids))
    first = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(n, device=v.device) - first[segment_ids[order]]
    pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    view = (-1,) + (1,) * (v.dim() - 1)
    for k in range(n if max_segment_len is None else max_segment_len):
        step = torch.where((pos == k).view(view), v, 0.0)
        acc.index_add_(0, segment_ids, step)
    return acc


def records_per_node_rail(
    node_R: torch.Tensor,
    egress_R: torch.Tensor,
    rail_of_gpu_G: torch.Tensor,
    num_nodes: int,
    num_rails: int,
) -> torch.Tensor:
    """[N, R] int64: this rank's records per (destination node, egress rail); no host sync
    (``torch.bincount`` reads its maximum back to the host on CUDA).

    Args:
        node_R: [n] int64 destination nodes; -1 (padding past the last record) is not counted.
        egress_R: [n] int64 egress GPUs. A record whose node, egress GPU or rail is out of range
            (e.g. RailBalance bounds that do not come from one plan) is not counted either, on
            every device: the counts then sum to fewer than the records.
        rail_of_gpu_G: [G] int64 rail of each local GPU (same device).
    """
    g = rail_of_gpu_G.numel()
    valid_R = (node_R >= 0) & (node_R < num_nodes) & (egress_R >= 0) & (egress_R < g)
    rail_R = rail_of_gpu_G[egress_R.clamp(min=0, max=max(g - 1, 0))]
    valid_R &= (rail_R >= 0) & (rail_R < num_rails)
    # Padding and out-of-range records go to one extra bin that is dropped (no boolean indexing:
    # no host sync); the compiled ops leave them out too, on CPU and CUDA alike.
    key = torch.where(valid_R, node_R * num_rails + rail_R, num_nodes * num_rails)
    out = torch.zeros(num_nodes * num_rails + 1, dtype=torch.int64, device=node_R.device)
    return out.scatter_add_(0, key, torch.ones_like(key))[:-1].view(num_nodes, num_rails)
