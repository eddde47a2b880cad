"""Loading of the compiled ops (``megatron_railwave._C``, exposing ``torch.ops.railwave.*``).

The library is imported lazily, on the first op call, never at package import. When it is
missing, or was built without CUDA and a CUDA tensor comes in, the public ops fall back to the
pure-torch reference and log ONE warning per reason for the whole job, naming it: on global
rank 0 (``torch.distributed``'s rank, else the ``RANK`` variable, else 0), as the dispatcher's
other notices; the other ranks log the same line at INFO (a rank whose reason differs is seen
with ``logging`` at INFO), so eight processes do not print it eight times.

On load this module also registers, for every op, the fake implementation (output shapes and
dtypes only, so ``torch.compile`` traces through the ops) and the autograd of ``segment_sum``.

Set ``RAILWAVE_OPS=reference`` to use the reference even where the compiled ops load.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from megatron_railwave.process import global_rank

__all__ = [
    "compiled_for",
    "host_function",
    "load_error",
    "reference_forced",
    "set_forced_reference",
]

_LOG = logging.getLogger("megatron_railwave.ops")
_MODULE = "megatron_railwave._C"
_FIX = (
    "build it with `make ext` in a checkout, or reinstall with `pip install --no-build-isolation` "
    "in this environment (README, Install)"
)

_module = None  # the imported extension, once loaded
_load_error: str | None = None
_loaded = False  # load attempted
_warned: set[str] = set()
_forced_reference = os.environ.get("RAILWAVE_OPS", "auto").strip().lower() == "reference"


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        level = logging.WARNING if global_rank() == 0 else logging.INFO
        _LOG.log(level, "megatron_railwave.ops: using the pure-torch reference ops: %s", reason)


def _load() -> None:
    global _module, _load_error, _loaded
    _loaded = True
    try:
        module = importlib.import_module(_MODULE)
    except (ImportError, OSError) as exc:
        _load_error = (
            f"the compiled ops {_MODULE} did not load ({type(exc).__name__}: {exc}); {_FIX}"
        )
        return
    _register_python_parts()
    _module = module


def load_error() -> str | None:
    """Why the compiled ops are not used (None when they loaded or were not tried yet)."""
    if _forced_reference:
        return "RAILWAVE_OPS=reference"
    return _load_error


def reference_forced() -> bool:
    """Whether the reference ops are used on purpose (``RAILWAVE_OPS=reference`` or
    ``set_forced_reference(True)``)."""
    return _forced_reference


def set_forced_reference(forced: bool) -> bool:
    """Use the reference ops (True) or the compiled ones where available (False); returns the old
    value."""
    global _forced_reference
    old, _forced_reference = _forced_reference, bool(forced)
    return old


def compiled_for(device: torch.device) -> bool:
    """True when ``torch.ops.railwave`` has kernels for tensors on ``device``; otherwise the caller
    uses the reference (and the reason has been logged once)."""
    if _forced_reference:
        return False
    if not _loaded:
        _load()
    if _module is None:
        _warn_once(_load_error or "unknown")
        return False
    kind = device.type
    if kind in ("cpu", "meta"):
        return True
    if kind == "cuda":
        if _module.with_cuda:
            return True
        _warn_once(
            f"{_MODULE} was built without CUDA kernels (CPU torch or no nvcc at build time); "
            f"rebuild it "
            "on the GPU machine (TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace)"
        )
        return False
    _warn_once(f"no compiled railwave kernels for device type {kind!r}")
    return False


def host_function(name: str):
    """The library's plain CPython function ``name`` (host-only helpers bound without a torch op:
    csrc/bindings/module.cpp), or None where the compiled ops are not used (the reason logged
    once)."""
    if _forced_reference:
        return None
    if not _loaded:
        _load()
    if _module is None:
        _warn_once(_load_error or "unknown")
        return None
    fn = getattr(_module, name, None)
    if fn is None:
        _warn_once(f"{_MODULE} has no {name} (built from older sources); {_FIX}")
    return fn


def _register_python_parts() -> None:
    """Fake implementations of every op and the autograd of segment_sum."""
    lib = "railwave::"

    @torch.library.register_fake(lib + "records_from_routing")
    def _records_fake(routing_map, num_nodes, gpus_per_node):
        capacity = routing_map.shape[0] * num_nodes
        new = routing_map.new_empty
        return (
            new(capacity, dtype=torch.int64),
            new(capacity, dtype=torch.int64),
            new(capacity, dtype=torch.int64),
            new((num_nodes, 1 << gpus_per_node), dtype=torch.int64),
        )

    @torch.library.register_fake(lib + "assign_egress")
    def _assign_fake(node, owner_gpu, counts, keep, surplus_lo, deficit_hi, wave):
        return torch.empty_like(node), torch.empty_like(node)

    @torch.library.register_fake(lib + "records_per_node_rail")
    def _node_rail_fake(node, egress, rail_of_gpu, num_nodes, num_rails):
        return node.new_empty((num_nodes, num_rails))

    @torch.library.register_fake(lib + "pack_rows")
    def _pack_fake(tensors, row_index):
        rows = row_index[0].shape[0] if row_index[0] is not None else tensors[0].shape[0]
        row_bytes = 0
        for t in tensors:
            width = t.dtype.itemsize
            for size in t.shape[1:]:
                width *= size
            row_bytes += width
        return tensors[0].new_empty((rows, row_bytes), dtype=torch.uint8)

    @torch.library.register_fake(lib + "unpack_rows")
    def _unpack_fake(packed, widths, row_index, num_rows):
        rows = num_rows if row_index is not None else packed.shape[0]
        return [packed.new_empty((rows, w)) for w in widths]

    @torch.library.register_fake(lib + "segment_sum")
    def _segment_sum_fake(values, segment_ids, num_segments, out_dtype):
        return values.new_empty((num_segments, *values.shape[1:]), dtype=out_dtype)

    @torch.library.register_fake(lib + "rail_plan")
    def _rail_plan_fake(records, eligible, balanced, phase):
        n, g = records.shape[0], records.shape[2]
        return records.new_empty((n, n, g)), records.new_empty((n, n, g, g))

    @torch.library.register_fake(lib + "arrival_copies")
    def _arrival_copies_fake(records, copies, relay, chunks):
        n, g = records.shape[0], records.shape[1]
        return records.new_empty((n, n, chunks, g, g))

    @torch.library.register_fake(lib + "path_estimates")
    def _path_estimates_fake(
        records,
        copies,
        eligible,
        window,
        num_windows,
        chunks,
        record_bytes,
        nvlink_bytes_per_s,
        rail_bytes_per_s,
        rail_phase_s,
        layer_s,
        combine_share,
    ):
        return records.new_empty((2,))

    @torch.library.register_fake(lib + "rank_schedule")
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

    def _segment_sum_setup(ctx, inputs, output):
        values, segment_ids, _, _ = inputs
        ctx.save_for_backward(segment_ids)
        ctx.values_dtype = values.dtype

    def _segment_sum_backward(ctx, grad_S):
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
        return grad_values, None, None, None

    torch.library.register_autograd(
        lib + "segment_sum", _segment_sum_backward, setup_context=_segment_sum_setup
    )
