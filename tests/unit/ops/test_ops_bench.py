"""railwave ops-bench: the --quick smoke run writes the JSON with every op; bad input exits 2."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_railwave.cli import main
from megatron_railwave.lab.bench.ops_bench import SCHEMA, OpsBenchSpec

OPS = [
    "records_from_routing",
    "assign_egress",
    "records_per_node_rail",
    "pack_rows",
    "unpack_rows",
    "unpack_rows_scatter",
    "segment_sum",
]


def test_ops_bench_quick_writes_every_op(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["ops-bench", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == SCHEMA and result["device"] == "cpu" and result["threads"] == 1
    assert [r["op"] for r in result["ops"]] == OPS
    for row in result["ops"]:
        assert row["ms"] > 0 and row["reference_ms"] > 0 and row["copy_ms"] > 0 and row["bytes"] > 0
        assert row["goal"]["what"] == "speedup vs reference >= 3"
    assert (
        result["sizes"]["records"] > 0 and result["sizes"]["copies"] >= result["sizes"]["records"]
    )
    assert "ops-bench on cpu" in capsys.readouterr().out
    assert torch.get_num_threads() >= 1  # restored


def test_ops_bench_bad_sizes_raise():
    with pytest.raises(ValueError, match="E=100 experts do not split over 4 x 8 GPUs"):
        OpsBenchSpec(num_experts=100)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_ops_bench_cuda_without_gpu_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ops-bench", "--quick", "--device", "cuda"])
    assert exc.value.code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_ops_bench_exits_1_when_an_op_differs_from_its_reference(tmp_path, monkeypatch, capsys):
    # A compiled op that writes wrong bytes: the bench must fail, not just time it.
    from megatron_railwave import ops

    real = ops.pack_rows

    def wrong_pack_rows(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + 1 if isinstance(out, torch.Tensor) else out

    monkeypatch.setattr(ops, "pack_rows", wrong_pack_rows)
    out = tmp_path / "ops.json"
    assert main(["ops-bench", "--quick", "--repeats", "1", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    by_op = {r["op"]: r["equal_to_reference"] for r in result["ops"]}
    assert by_op.pop("pack_rows") is False and all(by_op.values())
    assert result["all_equal_to_reference"] is False
    assert "outputs differ from the reference: pack_rows" in capsys.readouterr().out


def test_ops_bench_cuda_without_cuda_kernels_exits_1(monkeypatch, capsys):
    # A CUDA device but an extension built without CUDA kernels: timing the reference against
    # itself measures nothing, so the bench fails before timing anything.
    from megatron_railwave import ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "compiled_for", lambda device: device.type != "cuda")
    assert main(["ops-bench", "--quick", "--device", "cuda"]) == 1
    assert "no compiled CUDA kernels" in capsys.readouterr().out
