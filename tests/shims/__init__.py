"""Test-only shims for running Megatron-Core on CPU (see megatron_cpu.py)."""

from tests.shims.megatron_cpu import apply_megatron_cpu_shims

__all__ = ["apply_megatron_cpu_shims"]
