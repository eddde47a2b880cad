"""`railwave sensitivity` and `netmodel.sensitivity`: the grid's statistics by hand, the UltraEP
fit reproducing the paper's speedups, and a smoke run of the command (JSON keys, heatmap)."""

import json

import pytest

from megatron_railwave.cli import main
from megatron_railwave.lab.netmodel import NetModelConfig
from megatron_railwave.lab.netmodel.calibrate import ultraep_check
from megatron_railwave.lab.netmodel.sensitivity import fit_alpha_ultraep, summarize_grid
from megatron_railwave.topology import RailTopology


def test_summarize_grid_takes_ratios_of_layer_sums_then_seed_percentiles():
    # Seed 0: layers (baseline, joint) = (4, 2) and (2, 2): sums 6 / 4 = 1.5x. Seed 1: (3, 1),
    # (3, 1): 3.0x. Median of [1.5, 3.0] = 2.25; P10 = 1.5 + 0.1 * 1.5 = 1.65.
    rows = []
    for seed, layers in ((0, [(4.0, 2.0), (2.0, 2.0)]), (1, [(3.0, 1.0), (3.0, 1.0)])):
        for i, (b, j) in enumerate(layers):
            rows.append(
                {
                    "skew": 1.0,
                    "fabric": "max-min",
                    "pattern": "ring",
                    "seed": seed,
                    "layer": i,
                    "baseline_s": b,
                    "joint_s": j,
                    "rail_s": b,
                    "per_record_bound_s": 1.0,
                    "per_record_resource": "node NIC in node 1",
                    "any_routing_bound_s": 0.5,
                    "any_routing_resource": "GPU out (NVLink + NIC) (0, 0)" if i else "node",
                }
            )
    (entry,) = summarize_grid(rows)
    assert entry["seeds"] == 2 and entry["layers_per_seed"] == 2
    assert entry["joint_over_baseline"]["median"] == pytest.approx(2.25)
    assert entry["joint_over_baseline"]["p10"] == pytest.approx(1.65)
    assert entry["rail_over_baseline"]["median"] == pytest.approx(1.0)
    assert entry["per_record_over_baseline"]["per_seed"] == pytest.approx([3.0, 3.0])
    assert entry["any_routing_over_baseline"]["per_seed"] == pytest.approx([6.0, 6.0])
    # Fractions: per seed the bound's layer sum over the path's (JOINT 2 / 4 and 2 / 2; the
    # baseline 2 / 6 and 2 / 6; the any-routing bound half of those).
    assert entry["joint_per_record_fraction_median"] == pytest.approx((2 / 4 + 2 / 2) / 2)
    assert entry["joint_any_routing_fraction_median"] == pytest.approx((1 / 4 + 1 / 2) / 2)
    assert entry["baseline_per_record_fraction"]["per_seed"] == pytest.approx([2 / 6, 2 / 6])
    assert entry["rail_any_routing_fraction"]["per_seed"] == pytest.approx([1 / 6, 1 / 6])
    assert entry["per_record_resource"] == "node NIC in node 1"
    assert entry["any_routing_resource"] in ("node", "GPU out (NVLink + NIC) (0, 0)")


def test_ultraep_fit_reproduces_the_papers_speedup_per_payload():
    topo = RailTopology(num_nodes=4, gpus_per_node=8, rail_gbps=400.0, nvlink_gBps=155.0)
    base = NetModelConfig(alpha=0.0, delivery="streamed")
    fit = fit_alpha_ultraep(topo, base)
    assert min(fit.alpha_per_payload.values()) <= fit.alpha <= max(fit.alpha_per_payload.values())
    for mib, alpha in fit.alpha_per_payload.items():
        (row,) = ultraep_check(
            topo, NetModelConfig(alpha=alpha, delivery="streamed"), mib_per_gpu=(mib,)
        )
        assert row.dispatch_speedup == pytest.approx(fit.paper[mib], rel=5e-3)
    # Max-min: PERM gains nothing on UltraEP (the destination's ports carry the same bytes).
    assert ultraep_check(topo, base, mib_per_gpu=(28,))[0].dispatch_speedup < 1.05


def test_ultraep_fit_needs_four_by_eight():
    with pytest.raises(ValueError, match="4 x 8 cluster.*--alpha"):
        fit_alpha_ultraep(RailTopology(num_nodes=2, gpus_per_node=8), NetModelConfig())


def test_sensitivity_smoke_writes_grid_bound_and_heatmap(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert (
        main(
            [
                "sensitivity",
                "--cluster",
                "h800_4x8",
                "--nodes",
                "3",
                "--alpha",
                "1.0",
                "--skews",
                "0,1.46",
                "--pattern",
                "none",
                "--seeds",
                "1",
                "--layers",
                "8",
                "--tokens",
                "32",
                "--incast-layers",
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
    assert (
        png.stat().st_size > 0
        and data["ultraep_fit"] is None
        and data["config"]["fabrics"]["ultraep"] == 1.0
    )
    assert len(data["rows"]) == 2 * 1 * 1 * 2  # skews x seeds x layers x fabrics
    assert {(e["skew"], e["fabric"]) for e in data["summary"]} == {
        (s, f) for s in (0.0, 1.46) for f in ("max-min", "ultraep")
    }
    for row in data["rows"]:
        # No modelled time below either path-independent bound (the balanced peer: another
        # input), and the any-routing bound never above the per-record one.
        fastest = min(
            row["baseline_s"],
            row["rail_s"],
            row["joint_s"],
            row["deepep_direct_s"],
            row["megatron_s"],
        )
        assert fastest >= row["per_record_bound_s"] * (1 - 1e-3)
        assert 0 < row["any_routing_bound_s"] <= row["per_record_bound_s"] * (1 + 1e-12)
        assert row["any_routing_resource"].startswith(("node NIC", "GPU"))
        assert row["deepep_balanced_s"] > 0
    for e in data["summary"]:
        for path in ("baseline", "rail", "joint", "deepep_direct", "megatron"):
            assert (
                0
                < e[f"{path}_any_routing_fraction_median"]
                <= e[f"{path}_per_record_fraction_median"] * (1 + 1e-12)
                <= 1 + 1e-3
            ), path
        assert "deepep_balanced_per_record_fraction_median" not in e
    # With skew 0 the token-balanced input is the input itself: the same time as the baseline.
    (even,) = [e for e in data["summary"] if e["skew"] == 0.0 and e["fabric"] == "max-min"]
    assert even["deepep_balanced_over_baseline"]["median"] == pytest.approx(1.0, rel=0.05)
    # The incast prediction (its own layers: RING / EXTREME, skew 1.46) per fabric and seed.
    pred = data["incast_prediction"]
    assert set(pred) == {"max-min", "ultraep"} and pred["ultraep"]["layers"] == 1
    assert len(pred["max-min"]["per_seed"]) == 1 and pred["max-min"]["paper"] == pytest.approx(
        3.009 / 1.801
    )
    assert pred["ultraep"]["median"] >= pred["max-min"]["median"] * (
        1 - 1e-3
    )  # the penalty only slows NATIVE
    assert "speedup over DeepEP-like NATIVE" in capsys.readouterr().out


def test_sensitivity_rejects_unknown_layers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "sensitivity",
                "--cluster",
                "h800_4x8",
                "--layers",
                "99",
                "--alpha",
                "1",
                "--no-progress",
            ]
        )
    assert exc.value.code == 2
    assert "--layers: [99] are not MoE layers of GLM-4.5-Air" in capsys.readouterr().err
