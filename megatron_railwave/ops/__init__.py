"""RailWave data-movement ops: records from routing, RailBalance egress, row packing and the
fixed-order segment sum; and host-planning ops (compiled only: ``rail_plan``, ``flow_plan``,
``rank_schedule``, ``layer_descriptors``).

Letters: T tokens of one rank, E experts, N nodes, G GPUs per node, M = 2**G target masks,
C = T * N record capacity, n rows, S segments, R rails.

``megatron_railwave.ops.<name>`` is the public API; each data op is one call of
``torch.ops.railwave.<name>`` (``ops._library`` defines the library), and torch's dispatcher picks
its kernel: the compiled one (csrc/, built into ``megatron_railwave._C``; bitwise-identical results
on CPU and CUDA) where it is registered for the tensors' device, else the op's pure-torch reference
kernel (``ops.reference``, the definition of the meaning), which logs one warning per reason
(``ops._compiled``). ``RAILWAVE_OPS=reference`` / ``set_forced_reference`` take the compiled kernels
out. One exception chooses in Python: segment_sum of dtypes its kernels do not take (e.g. float8)
calls the reference directly.

The host-planning ops have CPU kernels only, and their references sit above this package, so they
return None where the compiled ops are not used (the caller runs the reference): ``rail_plan``,
``flow_plan`` and ``rank_schedule`` are torch ops
(``_compiled.host_op``); ``layer_descriptors`` is a plain CPython function of the extension
(``_compiled.host_function``), called on every MoE layer, where a torch op's dispatch (~3 us) would
cost more than the work.

No op synchronises with the host. This package imports nothing else from megatron_railwave but
``process``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_railwave.ops import (
    _library,  # noqa: F401  (its import defines torch.ops.railwave)
    reference,
)
from megatron_railwave.ops._compiled import (
    compiled_for,
    host_function,
    host_op,
    load_error,
    reference_forced,
    set_forced_reference,
)
from megatron_railwave.ops.reference import RowSpec, row_bytes

__all__ = [
    "RowSpec",
    "records_from_routing",
    "assign_egress",
    "pack_rows",
    "unpack_rows",
    "row_bytes",
    "segment_sum",
    "records_per_node_rail",
    "rank_schedule",
    "rail_plan",
    "flow_plan",
    "layer_descriptors",
    "compiled_for",
    "load_error",
    "reference_forced",
    "set_forced_reference",
]

# Dtypes segment_sum's compiled kernels take; others (e.g. float8 values) go to the reference.
_SEGMENT_SUM_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def records_from_routing(
    routing_map_TE: torch.Tensor, num_nodes: int, gpus_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unique (token, destination node) records of one rank, in canonical order (node, mask,
    token). See ``reference.records_from_routing``.

    Args:
        routing_map_TE: [T, E] bool, rank-local.
        num_nodes: N.
        gpus_per_node: G (1..8).

    Returns:
        token_C, node_C, mask_C: [C] int64 (-1, -1, 0 past the last record); counts_NM: [N, M]
        int64. Host sync: no.
    """
    return torch.ops.railwave.records_from_routing(routing_map_TE, num_nodes, gpus_per_node)


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
    """Each record's egress GPU and wave (RailBalance's greedy fill). See
    ``reference.assign_egress``.

    Args:
        node_R: [n] int64 canonical order, -1 past the last record. Other arguments: [N] int64
            (``deficit_hi_NG`` [N, G] int64), all on node_R's device.

    Returns:
        egress_R, wave_R: [n] int64 (-1 for padding). Host sync: no.
    """
    return torch.ops.railwave.assign_egress(
        node_R, owner_gpu, counts_N, keep_N, surplus_lo_N, deficit_hi_NG, wave_N
    )


def pack_rows(
    tensors: Sequence[torch.Tensor], row_index: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Gather rows of several tensors (any dtypes) side by side into one [n, row_bytes] uint8
    buffer, in one pass (one kernel launch on CUDA). See ``reference.pack_rows``.

    Args:
        tensors: each [rows_k, *shape_k], same device.
        row_index: per tensor, [n] int64 rows to take, or None (all rows, rows_k == n). Indices are
            range-checked on CPU only (a check on CUDA would need a host sync).
    """
    return torch.ops.railwave.pack_rows(list(tensors), list(row_index))


def unpack_rows(
    packed: torch.Tensor,
    specs: Sequence[RowSpec],
    *,
    row_index: torch.Tensor | None = None,
    num_rows: int | None = None,
) -> list[torch.Tensor]:
    """Inverse of ``pack_rows``: per spec, [n or num_rows, *shape] of that dtype. See
    ``reference.unpack_rows``.

    Args:
        packed: [n, row_bytes(specs)] uint8.
        specs: (dtype, shape) of each tensor, in packing order.
        row_index: [n] int64 distinct output rows (None: row i goes to row i).
        num_rows: output rows when ``row_index`` is given (rows not written are zero; a full
            permutation, num_rows = n, is not zero-filled first: CPU, CUDA and the reference).
    """
    if row_index is not None and num_rows is None:
        raise ValueError("unpack_rows: num_rows is required with row_index")
    widths = [row_bytes([spec]) for spec in specs]
    parts = torch.ops.railwave.unpack_rows(
        packed, widths, row_index, -1 if num_rows is None else num_rows
    )
    return [
        part.view(dtype).reshape(part.shape[0], *shape)
        if part.shape[1]
        else part.new_empty(
            (part.shape[0], *shape), dtype=dtype
        )  # zero bytes: view(dtype) rejects the strides
        for part, (dtype, shape) in zip(parts, specs, strict=True)
    ]


def segment_sum(
    values: torch.Tensor,
    segment_ids: torch.Tensor,
    num_segments: int,
    *,
    out_dtype: torch.dtype | None = None,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """Sum rows into segments in a fixed order (rows of a segment in index order, float32
    accumulation rounded at every addition, one cast): bitwise equal on CPU and CUDA and from run
    to run. Differentiable in ``values``. See ``reference.segment_sum``.

    Args:
        values: [n, *shape] float32, float64, bfloat16 or float16.
        segment_ids: [n] int64; rows with an id outside [0, S) are left out (CPU, CUDA and the
            reference alike; their gradient is zero): fixed-capacity padding uses that.
        num_segments: S.
        out_dtype: result dtype (default: ``values.dtype``).
        max_segment_len: only the reference kernel's non-CPU path uses it (see there).

    Returns:
        [S, *shape] of ``out_dtype``. Host sync: no.
    """
    out_dtype = out_dtype or values.dtype
    if values.dtype not in _SEGMENT_SUM_DTYPES or out_dtype not in _SEGMENT_SUM_DTYPES:
        # The one choice made here, by dtype: the compiled kernels reject these (an error, not a
        # dispatch key), the reference sums any floating dtype.
        return reference.segment_sum(
            values, segment_ids, num_segments, out_dtype=out_dtype, max_segment_len=max_segment_len
        )
    return torch.ops.railwave.segment_sum(
        values, segment_ids, num_segments, out_dtype, max_segment_len
    )


def records_per_node_rail(
    node_R: torch.Tensor,
    egress_R: torch.Tensor,
    rail_of_gpu_G: torch.Tensor,
    num_nodes: int,
    num_rails: int,
) -> torch.Tensor:
    """[N, R] int64: records per (destination node, egress rail); padding (node -1) not counted.
    A record with an out-of-range node, egress or rail is not counted either, on CPU and CUDA
    alike (the CUDA kernel cannot raise without a host sync): the counts then sum to fewer than
    the records. See ``reference.records_per_node_rail``. Host sync: no."""
    return torch.ops.railwave.records_per_node_rail(
        node_R, egress_R, rail_of_gpu_G, num_nodes, num_rails
    )


def rank_schedule(
    records_NNG: torch.Tensor,
    quota_NNG: torch.Tensor,
    relay_NNGG: torch.Tensor,
    wave_NN: torch.Tensor,
    masks_WM: torch.Tensor,
    *,
    rank: int,
    chunks: int = 1,
    num_phases: int,
    relay_phase_U: Sequence[int],
    rail_phase_V: Sequence[int],
    deliver_phase_R: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One rank's part of compiling a plan, in one compiled call (csrc/cpu/schedule.cpp); None
    where the compiled ops do not load (the caller then runs the Python pipeline it replaces).

    Meaning: ``schedule.compile_schedule`` with the deliveries of the rank's node, then
    ``schedule.rank_view`` and ``exchange.layout``'s host counts; that pipeline is the reference
    (it sits above this package, so the equality is checked by
    tests/unit/schedule/test_rank_schedule_op.py).

    Args:
        records_NNG, quota_NNG: [N, N, G] int64, relay_NNGG: [N, N, G, G] int64, wave_NN: [N, N]
            int64: the ``PathPlan``'s tensors (CPU).
        masks_WM: [W, M] int64 (CPU), records every rank sends to the rank's node, by target mask.
        rank: the EP rank (node * G + local GPU).
        chunks: the plan's rail chunks per wave (``PathPlan.chunks``).
        num_phases, relay_phase_U [1, or V with a streamed relay], rail_phase_V [V],
            deliver_phase_R [V + 1]: the schedule's phase count and the indices of its dispatch
            phases.

    Returns:
        table [4, X] (phase, src, dst, rows of the dispatch transfers from or to ``rank``,
        sorted by phase, stable: ``ExecutionSchedule.transfer_ranks``),
        send_PQ and recv_PQ [P, max(N, G)] (rows to / from each peer per phase: node on rails,
        GPU on NVLink; combine phases zero), view (categories [G + 1], kept_N [N], relay_in_NG
        [N * G], egress_N [N], source_round_N [N], arrival_NGM [N * G * M], num_copies [1]) and
        layout (``exchange.layout``'s host counts, in its order); all int64 on the CPU. Host
        sync: no (host tensors only).
    """
    op = host_op("rank_schedule")
    if op is None:
        return None
    return op(
        records_NNG.contiguous(),
        quota_NNG.contiguous(),
        relay_NNGG.contiguous(),
        wave_NN.contiguous(),
        masks_WM.contiguous(),
        rank,
        chunks,
        num_phases,
        list(relay_phase_U),
        list(rail_phase_V),
        list(deliver_phase_R),
    )


def rail_plan(
    records_NNG: torch.Tensor, eligible_NNG: torch.Tensor, *, balanced: bool, phase: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RailBalance's quotas and relay counts in one compiled call (csrc/cpu/schedule.cpp); None
    where the compiled ops do not load (the caller then runs ``planner.railbalance``'s numpy,
    the reference: tests/unit/planner/test_rail_plan_op.py checks the equality).

    Args:
        records_NNG: [N, N, G] int64 (CPU), records owned by GPU (s, g) for node d.
        eligible_NNG: [N, N, G] bool (CPU), GPUs of s allowed to carry the pair's records.
        balanced: RailBalance (counts within one over the eligible GPUs) or owner-keeps.
        phase: remainder-rotation counter.

    Returns:
        quota_NNG [N, N, G] and relay_NNGG [N, N, G, G], int64 on the CPU. Host sync: no.
    """
    op = host_op("rail_plan")
    if op is None:
        return None
    return op(records_NNG.contiguous(), eligible_NNG.contiguous(), balanced, phase)


def flow_plan(
    records_NNG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    eligible_NNG: torch.Tensor,
    wave_NN: torch.Tensor,
    rail_of_gpu_G: torch.Tensor,
    *,
    num_waves: int,
    num_rails: int,
    nvlink_cost: int,
    nic_cost: int,
    units: int,
    sweeps: int,
) -> torch.Tensor | None:
    """The min-max relay plan of FLOW / FLOW_WAVES in one compiled call (csrc/cpu/flow.cpp); None
    where the compiled ops do not load (the caller then runs ``planner.flow.flow_relay_reference``,
    the reference: tests/unit/planner/test_flow.py checks the equality, bit for bit).

    Args:
        records_NNG: [N, N, G] int64 (CPU), records owned by GPU (s, g) for node d.
        copies_NNGG: [N, N, G, G] int64 (CPU), (record, target GPU) copies of those records for
            GPU (d, j).
        eligible_NNG: [N, N, G] bool (CPU), GPUs of s allowed to carry the pair's records.
        wave_NN: [N, N] int64 (CPU), wave of each remote pair (-1: local).
        rail_of_gpu_G: [G] int64 (CPU), the rail of each local GPU.
        num_waves / num_rails: V and R.
        nvlink_cost / nic_cost: integer cost of one record on an NVLink / NIC direction.
        units / sweeps: units per (owner, node pair) and refinement passes.

    Returns:
        relay_NNGG [N, N, G, G] int64 on the CPU (diagonal = kept). Host sync: no.
    """
    op = host_op("flow_plan")
    if op is None:
        return None
    return op(
        records_NNG.contiguous(),
        copies_NNGG.contiguous(),
        eligible_NNG.contiguous(),
        wave_NN.contiguous(),
        rail_of_gpu_G.contiguous(),
        num_waves,
        num_rails,
        nvlink_cost,
        nic_cost,
        units,
        sweeps,
    )


def layer_descriptors(
    records_WN, geometry
) -> tuple[float, float, float, float, float, float] | None:
    """The sums behind one layer's B, rho_g and kappa from the gathered counts in one compiled call
    (csrc/cpu/descriptors.cpp, a plain CPython function: a torch op's dispatch would cost more than
    the work); None where the compiled ops are not used (the caller then runs
    ``selector.online.fast_descriptors``' numpy, the reference: tests/unit/test_online_selector.py
    checks the two agree bitwise).

    Args:
        records_WN: [W, N] int64 numpy array (any strides: a view of the count message), records
            rank w = s * G + o sends to node d.
        geometry: [3 + G + N * R] int64 contiguous numpy array: N, G, R, the rail of each local GPU,
            then 1 / 0 for each port (node, rail) that carries traffic / does not.

    Returns:
        (remote records in all, the most remote records of one GPU, the most remote records of one
        port (node, rail), their mean over healthy ports, kappa (the largest (sum)^2 / sum of
        squares over source nodes of one (rail, destination node); 1.0 when nothing is remote or N =
        1), records in all) as floats. Host sync: no (host arrays).

    Raises:
        ValueError: shapes or dtypes that do not match (names the argument).
    """
    fn = host_function("layer_descriptors")
    return None if fn is None else fn(records_WN, geometry)
