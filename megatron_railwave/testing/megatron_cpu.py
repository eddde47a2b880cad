"""CPU shims that let Megatron-Core (0.15 to 0.19) MoE layers run on a CPU-only torch over gloo.

What it is for: running Megatron's own code (its ``alltoall`` dispatcher, MoELayer, GPTModel)
without GPUs, as ``railwave bench-exchange`` does for its Megatron baseline; the CPU examples
(``examples/train_glm_tiny.py``) and the test suite use this same module. It is a tool, not part
of the runtime: it lives in ``megatron_railwave.testing``, which no runtime module imports (an
import contract in pyproject.toml), and on a CUDA build of torch the stream and device shims do
nothing.

Call :func:`apply_megatron_cpu_shims` before the first ``import megatron.core``; after
``parallel_state.initialize_model_parallel`` call :func:`seed_megatron_cpu_rng`. Nothing here
changes numerics.
"""

from __future__ import annotations

import contextlib
import sys
import types
import typing

import torch
import torch.distributed as dist

__all__ = ["apply_megatron_cpu_shims", "seed_megatron_cpu_rng"]

_APPLIED = False
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so every event is complete."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs

    def record(self, stream: object = None) -> None:
        del stream

    def wait(self, stream: object = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: object) -> float:
        del end_event
        return 0.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: one in-order CPU queue, so waits are no-ops."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        del args, kwargs
        self.device = torch.device("cpu")

    def wait_stream(self, stream: object) -> None:
        del stream

    def wait_event(self, event: object) -> None:
        del event

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _shim_paged_stash_ops() -> None:
    # megatron.core.transformer.moe.paged_stash (imported by experts.py and gpt_model.py) imports
    # the Triton kernels in moe/ops/paged_stash.py unconditionally. A CPU torch has no triton.
    # We stub only that one module instead of faking `triton` itself: a fake `triton` would flip
    # the `HAVE_TRITON` probes elsewhere in Megatron and route CPU code into Triton kernels.
    # The kernels are only launched by the paged-stash feature, which these tests never enable.
    try:
        import triton  # noqa: F401  (real triton present: nothing to stub)

        return
    except ImportError:
        pass
    if _PAGED_STASH_OPS in sys.modules:
        return

    def _unavailable(*args: object, **kwargs: object) -> None:
        del args, kwargs
        raise RuntimeError(
            "paged stash needs triton and CUDA; stubbed by megatron_railwave.testing.megatron_cpu"
        )

    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _unavailable
    stub.paged_stash_pop_kernel = _unavailable
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH_OPS] = stub


def _shim_cuda_streams_and_device() -> None:
    # MoEAlltoAllTokenDispatcher.__init__ builds torch.cuda.Stream() for its DtoH copies and
    # _maybe_dtoh_and_synchronize enters torch.cuda.stream(...) / current_stream(); the router
    # and tensor_parallel.mappings pass device=torch.cuda.current_device(). On a CPU build each
    # of these raises "Torch not compiled with CUDA enabled". "cpu" is a valid device= argument.
    if torch.cuda.is_available():
        return
    torch.cuda.Stream = _CpuStream  # type: ignore[misc,assignment]
    torch.cuda.Event = _CpuEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _shim_gloo_all_to_all_split_sizes() -> None:
    # Megatron's _AllToAll passes split sizes as CPU tensors or numpy arrays (on GPU they are
    # produced by maybe_move_tensor_to_cpu(as_numpy=True) only for CUDA tensors). torch's
    # all_to_all_single wants list[int]; convert here so gloo gets plain Python lists.
    original = dist.all_to_all_single
    if getattr(original, "_railwave_cpu_shim", False):
        return

    def _as_list(split_sizes: object) -> object:
        if split_sizes is None or isinstance(split_sizes, list):
            return split_sizes
        if isinstance(split_sizes, torch.Tensor):
            return [int(v) for v in split_sizes.tolist()]
        return [int(v) for v in split_sizes]  # numpy array, tuple

    def all_to_all_single(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
    ):
        return original(
            output,
            input,
            _as_list(output_split_sizes),
            _as_list(input_split_sizes),
            group=group,
            async_op=async_op,
        )

    all_to_all_single._railwave_cpu_shim = True  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single


def _shim_typing_override() -> None:
    # megatron.training uses typing.override (Python 3.12+); the venv runs Python 3.11.
    if hasattr(typing, "override"):
        return
    try:
        from typing_extensions import override
    except ImportError:  # pragma: no cover - typing_extensions ships with the venv

        def override(func):  # type: ignore[no-redef]
            return func

    typing.override = override  # type: ignore[attr-defined]


def _shim_router_gemm_without_te() -> None:
    # Megatron-Core 0.15's router_gating_linear reads `te_general_gemm`, which moe_utils only
    # defines when Transformer Engine imports: without TE the router raises NameError. The
    # function's own fallback (torch.mm) runs when the name is None.
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # no Megatron-Core: nothing to patch
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_megatron_cpu_shims() -> None:
    """Install every CPU shim once per process; later calls do nothing.

    Must run before ``megatron.core`` is imported (the paged-stash stub works only then); the
    last shim imports Megatron's MoE utilities itself, after the others are in place.
    """
    global _APPLIED
    if _APPLIED:
        return
    _shim_paged_stash_ops()
    _shim_cuda_streams_and_device()
    _shim_gloo_all_to_all_split_sizes()
    _shim_typing_override()
    _shim_router_gemm_without_te()
    _APPLIED = True


def seed_megatron_cpu_rng(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker so the tracker forks the CPU generator.

    Megatron's CudaRNGStatesTracker keeps named CUDA generator states and every attention
    forward enters ``get_cuda_rng_tracker().fork()`` (dropout 0 or not). On a CPU build the CUDA
    generator does not exist, so the tracker's two state helpers and ``torch.cuda`` seeding are
    pointed at the CPU generator. Call after ``parallel_state.initialize_model_parallel``.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    if not torch.cuda.is_available():
        mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
            torch.get_rng_state()
        )
        mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
            torch.set_rng_state(new_state)
        )
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore
        torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.manual_seed(seed)
    mcore_random.model_parallel_cuda_manual_seed(seed)
