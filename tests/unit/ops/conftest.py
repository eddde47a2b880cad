"""Shared pieces of the ops tests: the compiled-ops requirement, bitwise comparison, routing maps.

Letters: T tokens, E experts, N nodes, G GPUs per node, M = 2**G masks.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_railwave import ops


@pytest.fixture(scope="session")
def compiled():
    """The compiled ops are in use on CPU. ``make test`` sets RAILWAVE_REQUIRE_EXT=1, so there a
    missing build fails these tests instead of skipping them."""
    if not ops.compiled_for(torch.device("cpu")):
        reason = f"compiled ops unavailable: {ops.load_error()}"
        if os.environ.get("RAILWAVE_REQUIRE_EXT") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return torch.ops.railwave
