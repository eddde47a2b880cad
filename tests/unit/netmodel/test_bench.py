"""``railwave bench`` on the network model: JSON keys, path relations, scale-out demand, errors."""

import json

import numpy as np
import pytest
import torch

from megatron_railwave.cli import main
from megatron_railwave.lab.bench.netmodel_bench import layer_demands, summarize_samples
from megatron_railwave.lab.workloads import (
    GlmAirWorkload,
    demand_from_topk_ids,
    glm_air_layer_ids,
    scaled_demand,
    sparse_demand_from_topk_ids,
)
from megatron_railwave.names import ROUTES
from megatron_railwave.topology import RailTopology


def test_bench_writes_percentiles_speedups_and_plot(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert (
        main(
            [
                "bench",
                "--backend",
                "netmodel",
                "--cluster",
                "h800_4x8",
                "--workload",
                "glm45-air",
                "--pattern",
                "ring,extreme",
                "--layers",
                "2",
                "--tokens",
                "128",
                "--plan-repeats",
                "1",
                "--json",
                str(out),
                "--plot",
                str(png),
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert png.stat().st_size > 0 and data["config"]["layers"] == [1, 2]
    # the DeepEP-like baseline + every route + the default peers
    assert len(data["samples"]) == 2 * 2 * (1 + len(ROUTES) + 4)
    ring, extreme = data["summary"]["ring"], data["summary"]["extreme"]
    v = ring["variants"]
    assert ring["baseline"] == "deepep"
    assert set(v) == {
        "deepep",
        "native",
        "rail",
        "perm",
        "joint",
        "flow",
        "flow-waves",
        "deepep-balanced",
        "deepep-direct",
        "megatron",
        "fast",
    }
    # The two path-independent bounds: one per input, the same for every variant on it (the
    # token-balanced baseline runs another input), the any-routing one never above the
    # per-record one, and no modelled time below either.
    for summary in (ring, extreme):
        for b in ("per_record", "any_routing"):
            same = {
                name: e[f"{b}_bound_p50_ms"]
                for name, e in summary["variants"].items()
                if name != "deepep-balanced"
            }
            assert len(set(same.values())) == 1, b
            for name, entry in summary["variants"].items():
                assert entry[f"comm_over_{b}_min"] >= 1 - 1e-3, (b, name)
                assert 0 < entry[f"{b}_fraction_p50"] <= 1 + 1e-3, (b, name)
                assert entry[f"{b}_resource"].startswith(("node NIC", "GPU")), (b, name)
        for name, entry in summary["variants"].items():
            assert entry["any_routing_bound_p50_ms"] <= entry["per_record_bound_p50_ms"] * (
                1 + 1e-12
            ), name
            assert entry["any_routing_fraction_p50"] <= entry["per_record_fraction_p50"] * (
                1 + 1e-12
            ), name
    assert v["joint"]["per_record_speedup_p50"] >= v["joint"]["speedup_p50"]
    assert v["joint"]["any_routing_speedup_p50"] >= v["joint"]["per_record_speedup_p50"]
    for s in data["samples"]:
        assert s["any_routing_bound_s"] <= s["per_record_bound_s"] * (1 + 1e-12)
    # Every modelled time sits at or above its bandwidth bound (engine tolerance 1e-3).
    for summary in (ring, extreme):
        for name, entry in summary["variants"].items():
            assert entry["bound_p50_ms"] > 0 and entry["comm_over_bound_min"] >= 1 - 1e-3, name
    assert all(s["bound_s"] > 0 for s in data["samples"])
    for key in (
        "megatron_over_joint_p50",
        "fast_over_joint_p50",
        "fast_plan_over_joint_plan_p50",
        "deepep_over_joint_p50",
        "deepep-balanced_over_joint_p50",
        "deepep-direct_over_joint_p50",
        "joint_over_best_single_p95",
        "joint_over_best_single_p99",
    ):
        assert key in extreme, key
    assert all(s["plan_s"] > 0 for s in data["samples"] if s["variant"] == "fast")
    for key in (
        "comm_p50_ms",
        "comm_p95_ms",
        "comm_p99_ms",
        "plan_p50_ms",
        "total_p50_ms",
        "speedup_p50",
        "speedup_min",
        "speedup_max",
        "nic_shares",
        "rail_speedup_p50",
    ):
        assert key in v["joint"], key
    assert v["deepep"]["speedup_p50"] == 1.0
    # Streamed forwarding is never slower than store and forward on the same plan.
    assert v["deepep"]["comm_p50_ms"] <= v["native"]["comm_p50_ms"] * (1 + 1e-3)
    # RING windows are the cyclic waves: PERM runs exactly NATIVE's plan timing, JOINT RAIL's.
    assert v["perm"]["comm_p50_ms"] == pytest.approx(v["native"]["comm_p50_ms"])
    assert v["joint"]["comm_p50_ms"] == pytest.approx(v["rail"]["comm_p50_ms"])
    assert v["joint"]["total_p50_ms"] > v["joint"]["comm_p50_ms"]  # planning is added
    # JOINT does not depend on the arrangement (same demand, its own waves); NATIVE does.
    assert extreme["variants"]["joint"]["comm_p50_ms"] == pytest.approx(
        v["joint"]["comm_p50_ms"], rel=1e-3
    )
    assert extreme["variants"]["native"]["comm_p50_ms"] > v["native"]["comm_p50_ms"]
    assert sum(v["rail"]["nic_shares"]) == pytest.approx(1.0)
    assert "joint_over_best_single" in extreme
    assert "JOINT over the better single mechanism" in capsys.readouterr().out


def test_bench_fanin_variants_on_more_nodes(tmp_path):
    out = tmp_path / "s.json"
    assert (
        main(
            [
                "bench",
                "--cluster",
                "h800_4x8",
                "--nodes",
                "8",
                "--pattern",
                "none",
                "--paths",
                "rail,joint",
                "--fanin",
                "1,3",
                "--layers",
                "1",
                "--tokens",
                "64",
                "--plan-repeats",
                "0",
                "--peers",
                "none",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["samples"]
    assert [(r["variant"], r["waves"]) for r in rows] == [
        ("deepep", 1),
        ("native", 1),
        ("rail", 1),
        ("joint", 7),
        ("joint/f3", 3),
    ]
    assert all(r["plan_s"] == 0.0 for r in rows)


def test_bench_streamed_variants_of_the_relaying_paths(tmp_path):
    """--streamed adds '<path>+streamed' for the relaying paths only; their plans stream."""
    out = tmp_path / "s.json"
    argv = ["bench", "--cluster", "h800_4x8", "--pattern", "none", "--paths", "native,joint"]
    argv += ["--layers", "1", "--tokens", "64", "--plan-repeats", "0", "--peers", "none"]
    assert main([*argv, "--streamed", "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())["samples"]
    assert [(r["variant"], r["streamed"]) for r in rows] == [
        ("deepep", False),
        ("native", False),
        ("joint", False),
        ("joint+streamed", True),
    ]
    assert rows[3]["waves"] == rows[2]["waves"] == 3


def test_sparse_demand_matches_dense():
    topo = RailTopology(num_nodes=4, gpus_per_node=8)
    ids = glm_air_layer_ids(topo, 5, GlmAirWorkload(num_tokens=96))
    dense = demand_from_topk_ids(ids, topo, 128)
    sparse = sparse_demand_from_topk_ids(ids, topo, 128, chunk=7)
    assert torch.equal(sparse.records_NGN(), dense.records_NGN())
    for d in range(4):
        assert torch.equal(sparse.masks_into(d), dense.masks_into(d))
    half = scaled_demand(sparse, 0.5)
    assert half.records_NGN().sum() <= dense.records_NGN().sum() // 2 + 4 * 32 * 256


def test_layer_demands_scales_experts_beyond_128_ranks():
    topo = RailTopology(num_nodes=32, gpus_per_node=8)  # 256 ranks: one expert per rank
    demand = layer_demands(topo, layer=1, step=0, tokens=8, seed=0)
    assert demand.records_NGN().shape == (32, 8, 32)
    assert int(demand.records_NGN().sum()) > 0


def test_summarize_samples_percentiles_by_hand():
    rows = []
    for i, (nat, joint) in enumerate([(4.0, 2.0), (6.0, 2.0), (8.0, 4.0)]):
        for variant, c in (("native", nat), ("joint", joint)):
            rows.append(
                {
                    "pattern": "ring",
                    "layer": i,
                    "step": 0,
                    "variant": variant,
                    "comm_s": c * 1e-3,
                    "plan_s": 1e-3,
                    "rail_s": c * 1e-3,
                    "nic_shares": [0.5, 0.5],
                }
            )
    s = summarize_samples(rows)["ring"]["variants"]
    assert s["native"]["comm_p50_ms"] == pytest.approx(6.0) and s["joint"][
        "comm_p50_ms"
    ] == pytest.approx(2.0)
    assert s["joint"]["speedup_p50"] == pytest.approx(3.0)
    assert (s["joint"]["speedup_min"], s["joint"]["speedup_max"]) == pytest.approx((2.0, 3.0))
    assert s["joint"]["total_p50_ms"] == pytest.approx(3.0)
    assert np.allclose(s["joint"]["nic_shares"], [0.5, 0.5])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--pattern", "zigzag"],
            r"argument --pattern: expected some of none,ring,moderate,extreme",
        ),
        (["--layers", "0"], r"argument --layers: expected positive integers"),
        (
            ["--layers", "46,47"],
            r"--layers: \[46, 47\] are not MoE layers of GLM-4.5-Air \(1..45\)",
        ),
        (["--nodes", "256", "--pattern", "ring"], r"--pattern ring needs the dense demand"),
        (["--steps", "0"], r"need --steps >= 1"),
        (
            ["--payload-scale", "-1"],
            r"argument --payload-scale: expected a positive number or 'paper', got '-1'",
        ),
        (
            ["--payload-scale", "papers"],
            r"argument --payload-scale: expected a positive number or 'paper'",
        ),
    ],
)
def test_bench_bad_input_gives_clear_error(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--cluster", "h800_4x8", "--no-progress", *argv])
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def test_bench_payload_scale_paper_is_the_workloads_constant():
    from megatron_railwave.commands._args import parse_payload_scale as _payload_scale
    from megatron_railwave.lab.workloads import PAPER_PAYLOAD_SCALE

    assert _payload_scale("paper") == _payload_scale("Paper") == PAPER_PAYLOAD_SCALE == 1.895
    assert _payload_scale("2.5") == 2.5
