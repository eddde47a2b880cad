"""``railwave bench-exchange``: a tiny 2 x 2 smoke run (JSON keys, correctness of every variant),
the skipped-baseline path, and the byte counting on a layout worked out by hand.

No timing asserts: the benchmark prints numbers and writes JSON.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from megatron_railwave.cli import main
from megatron_railwave.lab.bench import (
    alltoall_bytes,
    alltoall_entry_bytes,
    railwave_bytes,
    railwave_record_bytes,
)
from megatron_railwave.names import ROUTES
from megatron_railwave.planner import build_plan
from megatron_railwave.schedule import RecordWireFormat, compile_schedule
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

TINY = [
    "bench-exchange",
    "--nodes",
    "2",
    "--gpus-per-node",
    "2",
    "--tokens",
    "16",
    "--hidden",
    "16",
    "--experts",
    "8",
    "--topk",
    "3",
    "--warmups",
    "1",
    "--samples",
    "3",
    "--timeout",
    "300",
]
VARIANT_KEYS = {
    "median_ms",
    "p95_ms",
    "mean_ms",
    "min_ms",
    "samples_ms",
    "phases_ms",
    "max_abs_err",
    "over_alltoall",
}
BYTES_KEYS = {
    "inter_node_bytes",
    "inter_node_payload_bytes",
    "rail_send_bytes_NG",
    "rail_bytes_R",
    "rail_imbalance",
    "node_rail_imbalance",
    "node_local_bytes",
}


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_bench_exchange_tiny_run_writes_all_variants(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(TINY + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "railwave.bench_exchange/2"
    assert {
        "config",
        "topology",
        "variants",
        "bytes",
        "summary",
        "alltoall_skipped",
        "profile",
    } <= set(data)
    assert data["alltoall_skipped"] is None
    assert list(data["variants"]) == [*map(str, ROUTES), "alltoall"]
    for name, v in data["variants"].items():
        assert VARIANT_KEYS <= set(v), name
        assert len(v["samples_ms"]) == 3 and v["min_ms"] <= v["median_ms"] <= v["p95_ms"]
        assert v["max_abs_err"] < 1e-5, f"{name} output differs from x * sum(probs)"
        assert {"counts", "dispatch", "combine"} <= set(v["phases_ms"])
    assert data["variants"]["alltoall"]["over_alltoall"] == 1.0
    for path in list(map(str, ROUTES)):
        b = data["bytes"]["railwave"][path]
        assert BYTES_KEYS | {"inter_node_records", "relayed_records", "delivered_copies"} <= set(b)
        assert len(b["rail_send_bytes_NG"]) == 2 and len(b["rail_send_bytes_NG"][0]) == 2  # [N][G]
        assert sum(b["rail_bytes_R"]) == b["inter_node_bytes"]
    assert BYTES_KEYS | {"inter_node_entries", "node_local_entries"} <= set(
        data["bytes"]["alltoall"]
    )
    summary = data["summary"]
    # K = 3 of 8 experts, 4 per node: some tokens send two experts to one remote node.
    assert summary["inter_node_records_ratio"] > 1.0
    assert summary["native_over_alltoall"] == data["variants"]["native"]["over_alltoall"]
    assert (
        summary["native_goal"] is None and summary["native_within_goal"] is None
    )  # no goal at this size
    printed = capsys.readouterr().out
    assert (
        "NATIVE / alltoall median" in printed
        and "no goal stated at this size" in printed
        and "inter-node rows alltoall/railwave" in printed
    )


def test_bench_exchange_no_alltoall_skips_baseline(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = TINY[:-4] + ["--samples", "1", "--path", "native", "--no-alltoall", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert list(data["variants"]) == ["native"]
    assert data["alltoall_skipped"] == "--no-alltoall"
    assert data["variants"]["native"]["over_alltoall"] is None
    assert data["summary"]["native_over_alltoall"] is None
    assert "alltoall baseline skipped: --no-alltoall" in capsys.readouterr().out


def test_wire_bytes_dedup_worked_by_hand():
    # 2 nodes x 2 GPUs, 4 experts (expert e on rank e). Rank 0 has one token routed to experts 2
    # and 3, both on node 1; the other ranks have no tokens.
    #   alltoall: two entries (0 -> rank 2, 0 -> rank 3), both remote, on rank 0's rail 0.
    #   RailWave: one record (token, node 1) with mask 0b11 on rail 0 (NATIVE: the owner's rail);
    #   it arrives at GPU (1, 0), which keeps one copy and delivers one to GPU (1, 1) (node-local).
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    maps = [torch.zeros(1 if w == 0 else 0, 4, dtype=torch.bool) for w in range(4)]
    maps[0][0, 2:] = True
    demand = DemandCounts.from_routing_maps(maps, topo)
    wire = RecordWireFormat(
        hidden=4, payload_dtype=torch.bfloat16, probs_dtype=torch.float32, experts_per_node=2
    )
    rec = railwave_record_bytes(wire)
    # payload 4 x 2 B; probs 2 x 4 B; metadata 4 B x (2 columns + 1 routing word) = 28 B, padded
    # with one zero word to a 16-byte row (schedule.wire: 16-byte row copies)
    assert rec == {"payload": 8, "dispatch": 8 + 8 + 12 + 4, "combine": 8}
    rw = railwave_bytes(compile_schedule(build_plan(demand, topo, "native"), wire, demand=demand))
    assert rw["inter_node_records"] == 1 and rw["inter_node_bytes"] == 32 + 8
    assert rw["rail_send_bytes_NG"] == [[40, 0], [0, 0]] and rw["rail_bytes_R"] == [40, 0]
    assert rw["node_rail_imbalance"] == 2.0  # node 0: loads [1, 0], max / mean = 2
    assert (
        rw["relayed_records"] == 0 and rw["delivered_copies"] == 1 and rw["node_local_bytes"] == 40
    )
    a2a_rec = alltoall_entry_bytes(hidden=4, elem_bytes=2)
    a2a = alltoall_bytes(maps, topo, a2a_rec)
    assert a2a["inter_node_entries"] == 2 and a2a["inter_node_bytes"] == 2 * (12 + 8)
    assert a2a["rail_send_bytes_NG"] == [[40, 0], [0, 0]] and a2a["node_local_entries"] == 0


def test_native_goal_is_the_issue_bound_per_size():
    from megatron_railwave.lab.bench import BenchSpec, native_goal

    def spec(t, h):
        return BenchSpec(num_nodes=4, gpus_per_node=2, tokens=t, hidden=h, experts=32, topk=8)

    assert native_goal(spec(256, 512)) == 1.1  # the default size
    assert native_goal(spec(32, 64)) == 1.3  # small layers: fixed per-layer costs dominate
    assert native_goal(spec(128, 64)) is None


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_bench_exchange_shared_expert_tiny_run(tmp_path, capsys):
    """--shared-expert: every variant's overlapped output equals exchange + shared expert, and the
    hidden share is (exchange + shared - overlapped) / shared of the reported medians."""
    out = tmp_path / "shared.json"
    assert main(TINY + ["--shared-expert", "--shared-ffn", "32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "railwave.bench_shared_overlap/1"
    assert data["config"]["shared_ffn"] == 32 and data["shared_ms"] > 0
    assert list(data["variants"]) == [*map(str, ROUTES), "alltoall"]
    for name, v in data["variants"].items():
        assert v["max_abs_err"] < 1e-5, f"{name}: overlapped output != exchange + shared expert"
        assert v["hidden_ms"] == pytest.approx(
            v["exchange_ms"] + data["shared_ms"] - v["overlapped_ms"]
        )
        assert v["hidden_share"] == pytest.approx(v["hidden_ms"] / data["shared_ms"])
    assert "hidden share" in capsys.readouterr().out


def test_bench_exchange_shared_expert_refuses_backward(capsys):
    with pytest.raises(SystemExit) as exc:
        main(TINY + ["--shared-expert", "--backward"])
    assert exc.value.code == 2
    assert "--shared-expert times forward passes only" in capsys.readouterr().err
