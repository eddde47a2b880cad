"""The fallback: without the compiled module the public ops run the reference (the ops' reference
kernels) and log ONE warning naming the reason; RAILWAVE_OPS=reference / set_forced_reference force
the reference."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron_railwave import ops
from megatron_railwave.ops import _compiled, reference
from tests.helpers.ops_cases import same_bits


def test_compiled_ops_load_when_built():
    # make test builds the extension first and sets RAILWAVE_REQUIRE_EXT=1: there it must load.
    if os.environ.get("RAILWAVE_REQUIRE_EXT") != "1" and not ops.compiled_for(torch.device("cpu")):
        pytest.skip(f"extension not built here: {ops.load_error()}")
    assert ops.compiled_for(torch.device("cpu")), ops.load_error()
    assert ops.load_error() is None


@pytest.fixture
def without_module(monkeypatch):
    """As if megatron_railwave._C had not loaded: its kernels leave the dispatcher, and come back
    after the test."""
    monkeypatch.setattr(_compiled, "_forced_reference", False)
    monkeypatch.setattr(_compiled, "_module", None)
    monkeypatch.setattr(
        _compiled, "_load_error", "the compiled ops megatron_railwave._C did not load (test)"
    )
    monkeypatch.setattr(_compiled, "_warned", set())
    _compiled.sync_kernels()
    yield monkeypatch
    monkeypatch.undo()
    _compiled.sync_kernels()


def test_missing_module_falls_back_with_one_warning(without_module, caplog):
    values = torch.randn(5, 3)
    ids = torch.tensor([0, 1, 0, 2, 1])
    with caplog.at_level(logging.WARNING, logger="megatron_railwave.ops"):
        first = ops.segment_sum(values, ids, 3)
        ops.pack_rows([values], [None])
        ops.records_from_routing(torch.zeros(2, 4, dtype=torch.bool), 2, 2)
    assert same_bits(first, reference.segment_sum(values, ids, 3))
    warnings = [r for r in caplog.records if r.name == "megatron_railwave.ops"]
    assert len(warnings) == 1
    assert "did not load (test)" in warnings[0].getMessage()
    assert "reference" in warnings[0].getMessage()


def test_fallback_warning_is_rank_zeros_other_ranks_log_it_at_info(without_module, caplog):
    # Eight processes of one job would print the same line eight times: rank 0 warns, the others
    # (RANK from the launcher here: no process group) log it at INFO.
    monkeypatch = without_module
    levels = {}
    for rank in ("0", "3"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(_compiled, "_warned", set())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_railwave.ops"):
            assert not ops.compiled_for(torch.device("cpu"))
            assert not ops.compiled_for(torch.device("cpu"))
        levels[rank] = [r.levelno for r in caplog.records if r.name == "megatron_railwave.ops"]
    assert levels == {"0": [logging.WARNING], "3": [logging.INFO]}


def test_cuda_tensors_with_a_cpu_only_build_warn_once(monkeypatch, caplog):
    class CpuOnly:
        with_cuda = 0

    monkeypatch.setattr(_compiled, "_forced_reference", False)
    monkeypatch.setattr(_compiled, "_module", CpuOnly())
    monkeypatch.setattr(_compiled, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="megatron_railwave.ops"):
        assert not ops.compiled_for(torch.device("cuda", 0))
        assert not ops.compiled_for(torch.device("cuda", 1))
        assert ops.compiled_for(torch.device("cpu"))
    messages = [r.getMessage() for r in caplog.records if r.name == "megatron_railwave.ops"]
    assert len(messages) == 1 and "built without CUDA kernels" in messages[0]


def test_forced_reference(monkeypatch):
    old = ops.set_forced_reference(True)
    try:
        assert not ops.compiled_for(torch.device("cpu"))
        assert ops.load_error() == "RAILWAVE_OPS=reference"
    finally:
        ops.set_forced_reference(old)


_SUBPROCESS = """
import sys, logging, torch
sys.modules["megatron_railwave._C"] = None  # the import now raises ImportError, as if never built
logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
from megatron_railwave import ops
out = ops.segment_sum(torch.ones(3, 2), torch.tensor([0, 0, 1]), 2)
ops.segment_sum(torch.ones(3, 2), torch.tensor([0, 0, 1]), 2)
print(out.tolist())
"""


def test_missing_module_in_a_fresh_process_logs_once():
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAILWAVE_OPS": "auto"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[2.0, 2.0], [1.0, 1.0]]"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("megatron_railwave.ops|")]
    assert len(lines) == 1, proc.stderr
    assert "megatron_railwave._C did not load" in lines[0] and "make ext" in lines[0]
