"""The compiled kernels of ``torch.ops.railwave`` (``megatron_railwave._C``): loading them,
registering them with torch's dispatcher, and the switch to the reference.

The extension is imported with this package; importing it registers nothing (about 1 ms).
``sync_kernels`` registers its CPU kernels (and CUDA kernels, where it was built with CUDA) for
the ops ``ops._library`` defines, unless the reference is forced (``RAILWAVE_OPS=reference`` at
start, ``set_forced_reference``), and takes them out of the dispatcher again when it is. Where
no compiled kernel serves a call (the extension missing, a CUDA tensor with a CPU-only build, the
reference forced) the dispatcher runs the op's reference kernel, which calls ``note_reference``:
that logs ONE warning per reason for the whole job, naming it (nothing when the reference is
forced): on global rank 0 (``torch.distributed``'s rank, else the ``RANK`` variable, else 0), as
the dispatcher's other notices; the other ranks log the same line at INFO (a rank whose reason
differs is seen with ``logging`` at INFO), so eight processes do not print it eight times.

The host-planning ops have CPU kernels only and their references sit above this package:
``host_op`` and ``host_function`` give them or None.
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
    "host_op",
    "load_error",
    "note_reference",
    "reference_forced",
    "set_forced_reference",
    "sync_kernels",
]

_LOG = logging.getLogger("megatron_railwave.ops")
_MODULE = "megatron_railwave._C"
_FIX = (
    "build it with `make ext` in a checkout, or reinstall with `pip install --no-build-isolation` "
    "in this environment (README, Install)"
)

_module = None  # the imported extension, once loaded
_load_error: str | None = None
_kernels = None  # register_kernels()'s handle: the compiled kernels stay registered while it lives
_warned: set[str] = set()
_forced_reference = os.environ.get("RAILWAVE_OPS", "auto").strip().lower() == "reference"


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        level = logging.WARNING if global_rank() == 0 else logging.INFO
        _LOG.log(level, "megatron_railwave.ops: using the pure-torch reference ops: %s", reason)


def _load() -> None:
    global _module, _load_error
    try:
        _module = importlib.import_module(_MODULE)
    except (ImportError, OSError) as exc:
        _load_error = (
            f"the compiled ops {_MODULE} did not load ({type(exc).__name__}: {exc}); {_FIX}"
        )


def sync_kernels() -> None:
    """Registers the compiled kernels where they are to serve (the extension loaded, the reference
    not forced) and takes them out of the dispatcher otherwise. Not safe while another thread calls
    the ops."""
    global _module, _load_error, _kernels
    if _module is None or _forced_reference:
        _kernels = None  # the capsule's destructor deregisters them
    elif _kernels is None:
        try:
            _kernels = _module.register_kernels()
        except (AttributeError, RuntimeError) as exc:  # AttributeError: built from older sources
            _module = None
            _load_error = f"{_MODULE} did not register its kernels ({exc}); {_FIX}"


def load_error() -> str | None:
    """Why the compiled ops are not used (None when they loaded)."""
    if _forced_reference:
        return "RAILWAVE_OPS=reference"
    return _load_error


def reference_forced() -> bool:
    """Whether the reference ops are used on purpose (``RAILWAVE_OPS=reference`` or
    ``set_forced_reference(True)``)."""
    return _forced_reference


def set_forced_reference(forced: bool) -> bool:
    """Use the reference kernels (True: the compiled ones leave the dispatcher) or the compiled
    ones where available (False); returns the old value. Not safe while another thread calls the
    ops."""
    global _forced_reference
    old, _forced_reference = _forced_reference, bool(forced)
    sync_kernels()
    return old


def _reason(device: torch.device) -> str | None:
    """Why the compiled kernels do not serve tensors on ``device`` (None when they do)."""
    if _module is None:
        return _load_error or "unknown"
    kind = device.type
    if kind in ("cpu", "meta"):
        return None
    if kind == "cuda":
        if _module.with_cuda:
            return None
        return (
            f"{_MODULE} was built without CUDA kernels (CPU torch or no nvcc at build time); "
            "rebuild it on the GPU machine (TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext "
            "--inplace)"
        )
    return f"no compiled railwave kernels for device type {kind!r}"


def compiled_for(device: torch.device) -> bool:
    """True when compiled kernels serve ``torch.ops.railwave`` for tensors on ``device``; otherwise
    its reference kernels do (and the reason has been logged once)."""
    if _forced_reference:
        return False
    reason = _reason(device)
    if reason is not None:
        _warn_once(reason)
        return False
    return True


def note_reference(device: torch.device) -> None:
    """Called by every reference kernel (``ops._library``): logs once why no compiled kernel took
    the call on ``device``; nothing when the reference is forced."""
    if not _forced_reference:
        _warn_once(_reason(device) or f"no compiled railwave kernel for {device.type} tensors")


def host_op(name: str):
    """``torch.ops.railwave.<name>`` for a host-planning op (CPU kernels only, no reference in
    this package), or None where the compiled kernels do not serve CPU tensors (the reason logged
    once); the caller then runs its Python reference."""
    return getattr(torch.ops.railwave, name) if compiled_for(torch.device("cpu")) else None


def host_function(name: str):
    """The library's plain CPython function ``name`` (host-only helpers bound without a torch op:
    csrc/bindings/module.cpp), or None where the compiled ops are not used (the reason logged
    once)."""
    if not compiled_for(torch.device("cpu")):
        return None
    fn = getattr(_module, name, None)
    if fn is None:
        _warn_once(f"{_MODULE} has no {name} (built from older sources); {_FIX}")
    return fn


_load()
