"""Shared pieces of the ops tests: the compiled-ops requirement, bitwise comparison, routing maps.

Letters: T tokens, E experts, N nodes, G GPUs per node, M = 2**G masks.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_railwave import ops


def require_compiled(device: str):
    """torch.ops.railwave, when the compiled ops serve ``device``. ``make test`` (and the GPU
    check script) set RAILWAVE_REQUIRE_EXT=1, so there a missing build fails instead of skipping."""
    if not ops.compiled_for(torch.device(device)):
        reason = f"compiled ops unavailable for {device}: {ops.load_error()}"
        if os.environ.get("RAILWAVE_REQUIRE_EXT") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return torch.ops.railwave


@pytest.fixture(scope="session")
def compiled():
    """The compiled ops serve CPU tensors."""
    return require_compiled("cpu")


@pytest.fixture(scope="session")
def cuda_ops():
    """The compiled ops serve CUDA tensors (gpu tests only)."""
    return require_compiled("cuda")
