"""The railwave op library, ``torch.ops.railwave``, defined once: the schemas, the pure-torch
reference as every data op's fallback kernel, the fake implementations and segment_sum's
autograd.

torch's dispatcher picks the kernel of each call: a compiled kernel registered for the tensors'
dispatch key (CPU, and CUDA where the extension was built with CUDA: ``_compiled.sync_kernels``),
else the reference kernel, registered for ``CompositeExplicitAutograd`` (torch uses it for every
backend key without a kernel of its own: the extension missing, a CPU-only build given CUDA
tensors, the reference forced). The public wrappers (``ops``) therefore call each op once and
never choose. A reference kernel runs ``ops.reference``'s function and logs, once per reason, why
it ran (``_compiled.note_reference``).

The low-level ``torch.library.Library`` API, not ``torch.library.custom_op``: custom_op would infer
``SymInt`` for ``int`` (the C++ kernels' inferred schemas say ``int``) and puts a Python layer in
front of every call, the compiled ones included.

The host-planning ops (rail_plan, flow_plan, rank_schedule) have
CPU kernels only and no kernel here: their references sit above this package
(``_compiled.host_op``).
"""

from __future__ import annotations

import torch

from megatron_railwave.ops import _compiled, reference

__all__ = ["LIBRARY", "SCHEMAS"]

SCHEMAS = (
    "records_from_routing(Tensor routing_map, int num_nodes, int gpus_per_node) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "assign_egress(Tensor node, int owner_gpu, Tensor counts, Tensor keep, Tensor surplus_lo, "
    "Tensor deficit_hi, Tensor wave) -> (Tensor, Tensor)",
    "records_per_node_rail(Tensor node, Tensor egress, Tensor rail_of_gpu, int num_nodes, "
    "int num_rails) -> Tensor",
    "pack_rows(Tensor[] tensors, Tensor?[] row_index) -> Tensor",
    "unpack_rows(Tensor packed, int[] widths, Tensor? row_index, int num_rows) -> Tensor[]",
    # max_segment_len: the reference's bound off the CPU (see reference.segment_sum); the compiled
    # kernels ignore it.
    "segment_sum(Tensor values, Tensor segment_ids, int num_segments, ScalarType out_dtype, "
    "int? max_segment_len=None) -> Tensor",
    # Host planning: CPU kernels only (its inputs are the gathered counts, always on the host).
    "rail_plan(Tensor records, Tensor eligible, bool balanced, int phase) -> (Tensor, Tensor)",
    "flow_plan(Tensor records, Tensor copies, Tensor eligible, Tensor wave, Tensor rail_of_gpu, "
    "int num_waves, int num_rails, int nvlink_cost, int nic_cost, int units, int sweeps) -> Tensor",
    "rank_schedule(Tensor records, Tensor quota, Tensor relay, Tensor wave, Tensor masks, "
    "int rank, int chunks, int num_phases, int[] relay_phase, int[] rail_phase, "
    "int[] deliver_phase) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
"""The op schemas (the C++ kernels' signatures must match them: csrc/common/ops.h)."""

try:
    LIBRARY = torch.library.Library("railwave", "DEF")
except RuntimeError as exc:
    raise ImportError(
        f"torch.ops.railwave is defined already ({exc}): a megatron_railwave._C built from older "
        "sources defines it when imported, or a second copy of megatron_railwave is loaded; "
        "rebuild the extension with `make ext`"
    ) from exc
for _schema in SCHEMAS:
    LIBRARY.define(_schema)


def _register_fakes() -> None:
    """Output shapes and dtypes only, so that ``torch.compile`` traces through the ops."""

    def fake(name):
        return torch.library.register_fake(f"railwave::{name}", lib=LIBRARY)

    @fake("records_from_routing")
    def _records_fake(routing_map, num_nodes, gpus_per_node):
        capacity = routing_map.shape[0] * num_nodes
        new = routing_map.new_empty
        return (
            new(capacity, dtype=torch.int64),
            new(capacity, dtype=torch.int64),
            new(capacity, dtype=torch.int64),
            new((num_nodes, 1 << gpus_per_node), dtype=torch.int64),
        )

    @fake("assign_egress")
    def _assign_fake(node, owner_gpu, counts, keep, surplus_lo, deficit_hi, wave):
        return torch.empty_like(node), torch.empty_like(node)

    @fake("records_per_node_rail")
    def _node_rail_fake(node, egress, rail_of_gpu, num_nodes, num_rails):
        return node.new_empty((num_nodes, num_rails))

    @fake("pack_rows")
    def _pack_fake(tensors, row_index):
        rows = row_index[0].shape[0] if row_index[0] is not None else tensors[0].shape[0]
        row_bytes = 0
        for t in tensors:
            width = t.dtype.itemsize
            for size in t.shape[1:]:
                width *= size
            row_bytes += width
        return tensors[0].new_empty((rows, row_bytes), dtype=torch.uint8)

    @fake("unpack_rows")
    def _unpack_fake(packed, widths, row_index, num_rows):
        rows = num_rows if row_index is not None else packed.shape[0]
        return [packed.new_empty((rows, w)) for w in widths]

    @fake("segment_sum")
    def _segment_sum_fake(values, segment_ids, num_segments, out_dtype, max_segment_len=None):
        return values.new_empty((num_segments, *values.shape[1:]), dtype=out_dtype)

    @fake("rail_plan")
    def _rail_plan_fake(records, eligible, balanced, phase):
        n, g = records.shape[0], records.shape[2]
        return records.new_empty((n, n, g)), records.new_empty((n, n, g, g))

    @fake("rank_schedule")
    def _rank_schedule_fake(
        records,
        quota,
        relay,
        wave,
        masks,
        rank,
        chunks,
        num_phases,
        relay_phase,
        rail_phase,
        deliver_phase,
    ):
        n, g = records.shape[0], records.shape[2]
        m, width = 1 << g, max(n, g)
        new = records.new_empty
        transfers = torch.library.get_ctx().new_dynamic_size()
        return (
            new((4, transfers)),
            new((num_phases, width)),
            new((num_phases, width)),
            new((g + 1 + 3 * n + n * g + n * g * m + 1,)),
            new((4 * n + n * g + 2 * g * n + (n - 1) * g * m * chunks,)),
        )


def _register_reference_kernels() -> None:
    """``ops.reference`` as the CompositeExplicitAutograd kernel of each data op: the kernel of
    every dispatch key without a compiled one. Each takes the schema's arguments."""

    def kernel(name):
        def register(fn):
            LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
            return fn

        return register

    @kernel("records_from_routing")
    def _records_from_routing(routing_map, num_nodes, gpus_per_node):
        _compiled.note_reference(routing_map.device)
        return reference.records_from_routing(routing_map, num_nodes, gpus_per_node)

    @kernel("assign_egress")
    def _assign_egress(node, owner_gpu, counts, keep, surplus_lo, deficit_hi, wave):
        _compiled.note_reference(node.device)
        return reference.assign_egress(
            node,
            owner_gpu=owner_gpu,
            counts_N=counts,
            keep_N=keep,
            surplus_lo_N=surplus_lo,
            deficit_hi_NG=deficit_hi,
            wave_N=wave,
        )

    @kernel("records_per_node_rail")
    def _records_per_node_rail(node, egress, rail_of_gpu, num_nodes, num_rails):
        _compiled.note_reference(node.device)
        return reference.records_per_node_rail(node, egress, rail_of_gpu, num_nodes, num_rails)

    @kernel("pack_rows")
    def _pack_rows(tensors, row_index):
        _compiled.note_reference(tensors[0].device)
        return reference.pack_rows(tensors, row_index)

    @kernel("unpack_rows")
    def _unpack_rows(packed, widths, row_index, num_rows):
        # The op gives byte parts (the wrapper views them as their dtypes): unpack as uint8 rows.
        _compiled.note_reference(packed.device)
        return reference.unpack_rows(
            packed,
            [(torch.uint8, (width,)) for width in widths],
            row_index=row_index,
            num_rows=None if row_index is None else num_rows,
        )

    @kernel("segment_sum")
    def _segment_sum(values, segment_ids, num_segments, out_dtype, max_segment_len=None):
        _compiled.note_reference(values.device)
        return reference.segment_sum(
            values,
            segment_ids,
            num_segments,
            out_dtype=out_dtype,
            max_segment_len=max_segment_len,
        )


def _register_segment_sum_autograd() -> None:
    def setup_context(ctx, inputs, output):
        values, segment_ids = inputs[0], inputs[1]
        ctx.save_for_backward(segment_ids)
        ctx.values_dtype = values.dtype

    def backward(ctx, grad_S):
        # d out[s] / d values[i] = 1 where segment_ids[i] == s: a gather of the gradient, through
        # the accumulation dtype, as autograd gives for the reference (to(acc) -> index_add_ ->
        # to(out)). Rows the forward left out (id outside [0, S): fixed-capacity padding) get a zero
        # gradient from an appended zero row: index_select on such an id is a device assert on CUDA.
        (segment_ids,) = ctx.saved_tensors
        acc = torch.float64 if ctx.values_dtype == torch.float64 else torch.float32
        num_segments = grad_S.shape[0]
        grad_ext = torch.cat([grad_S.to(acc), grad_S.new_zeros((1, *grad_S.shape[1:]), dtype=acc)])
        ids = torch.where(
            (segment_ids >= 0) & (segment_ids < num_segments), segment_ids, num_segments
        )
        grad_values = grad_ext.index_select(0, ids).to(ctx.values_dtype)
        return grad_values, None, None, None, None

    torch.library.register_autograd(
        "railwave::segment_sum", backward, setup_context=setup_context, lib=LIBRARY
    )


_register_fakes()
_register_reference_kernels()
_register_segment_sum_autograd()
# Last, the compiled kernels, now that their schemas exist (torch refuses a kernel whose C++
# signature does not match its schema here, and _compiled then reports the reason).
_compiled.sync_kernels()
