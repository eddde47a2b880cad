"""Test-only shims that let Megatron-Core 0.19.2 MoE layers run on a CPU-only torch over gloo.

The shims themselves live in ``examples/cpu_shims.py`` (the CPU example needs the same ones);
the tests load that file by path so there is one copy, and none of it is part of
``megatron_railwave``. Call :func:`apply_megatron_cpu_shims` before the first
``import megatron.core`` in a process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["apply_megatron_cpu_shims", "seed_megatron_cpu_rng"]

_EXAMPLE_SHIMS = Path(__file__).resolve().parents[2] / "examples" / "cpu_shims.py"


def _load():
    name = "railwave_example_cpu_shims"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _EXAMPLE_SHIMS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def apply_megatron_cpu_shims() -> None:
    """Apply the CPU shims of ``examples/cpu_shims.py`` (idempotent)."""
    _load().apply_megatron_cpu_shims()


def seed_megatron_cpu_rng(seed: int) -> None:
    """See ``examples/cpu_shims.seed_megatron_cpu_rng``."""
    _load().seed_megatron_cpu_rng(seed)
