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
