"""Fit of the synthetic workload to the paper's published statistics: the defaults reproduce them,
the statistics mean what the bench prints, expected counts match drawn tokens, the fit moves
knobs."""

import json

import numpy as np
import pytest

from megatron_railwave.cli import main
from megatron_railwave.lab.netmodel import execute_plan
from megatron_railwave.lab.workloads import (
    PUBLISHED,
    GlmAirWorkload,
    arrange,
    collect_samples,
    compare_to_published,
    demand_from_topk_ids,
    expected_sample,
    fit_statistics,
    fit_workload,
    glm_air_layer_ids,
    sampled_sample,
    workload_statistics,
)
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import load_topology

H20 = load_topology("h20_4x8")

R2_TOLERANCE = 0.12
"""R^2 over the test's 135 step-layers has a sampling error of about 0.06 at 0.3 (2 SE here); the
10% goal is checked on 900 pairs by ``railwave workloads fit`` (docs/workloads.md)."""


@pytest.fixture(scope="module")
def default_stats():
    # Expected counts (no token draws): 3 steps x 45 layers for the layer statistics, and 100 steps
    # x 3 layers for the NIC shares, which change with the per-step token counts only. Seconds.
    return fit_statistics(H20, GlmAirWorkload(), steps=range(3))  # NIC shares: the fit's 100 steps


def test_default_knobs_reproduce_published_statistics(default_stats):
    rows = {r["statistic"]: r for r in compare_to_published(default_stats)}
    for name, pub in PUBLISHED.items():
        if not pub.fitted:
            continue
        if name.startswith("r2_"):
            assert abs(default_stats[name] - pub.value) < R2_TOLERANCE, (name, default_stats[name])
        else:
            assert rows[name]["within"], (name, default_stats[name], pub.value)
    # Not fitted: the source-rail skew comes from token counts, which hot experts do not explain.
    assert default_stats["r2_src"] < 0.05


def test_nic_shares_are_what_the_flow_model_reports():
    # The statistic is the bench's: adapter egress of NATIVE per node, sorted, mean over nodes.
    # MODERATE keeps each source's volume, so its NATIVE shares are those of the demand itself.
    work = GlmAirWorkload(num_tokens=96)
    ids = glm_air_layer_ids(H20, 6, work)
    demand, windows = arrange(demand_from_topk_ids(ids, H20, 128), "moderate", H20)
    plan = build_plan(demand, H20, "native", options=PlanOptions(windows=windows))
    model = execute_plan(plan, record_bytes=8192, demand=demand).nic_shares()
    ours = workload_statistics([sampled_sample(H20, 6, work)], H20)
    np.testing.assert_allclose([ours[f"nic_share_{i}"] for i in range(1, 5)], model, rtol=1e-9)
    rho = plan.stats(record_bytes=8192).rho_g
    assert ours["rho_g_p50"] == pytest.approx(rho)


def test_expected_counts_match_drawn_tokens():
    work = GlmAirWorkload(num_tokens=2048, layers=(3, 11, 29))
    exp = workload_statistics(collect_samples(H20, work, steps=(0,)), H20)
    drawn = workload_statistics(collect_samples(H20, work, steps=(0,), sample=sampled_sample), H20)
    for i in range(1, 5):
        assert drawn[f"nic_share_{i}"] == pytest.approx(exp[f"nic_share_{i}"], abs=0.01)
    assert drawn["expert_max_mean_p50"] == pytest.approx(exp["expert_max_mean_p50"], rel=0.05)
    assert drawn["dst_rail_share_p90"] == pytest.approx(exp["dst_rail_share_p90"], rel=0.05)
    one = expected_sample(H20, 3, work)
    assert one.load_E.sum() == pytest.approx(8 * work.tokens_per_rank(32).sum())


def test_fit_moves_a_knob_towards_the_published_shares():
    start = GlmAirWorkload(token_skew=0.4)
    fit = fit_workload(
        H20,
        start=start,
        steps=range(2),
        layers=(1, 20),
        nic_steps=range(8),
        knobs=("token_skew",),
        sweeps=1,
        tol=0.05,
    )
    assert fit.knobs["token_skew"] > 1.0
    assert fit.loss < 0.8 * fit.start_loss
    assert set(fit.to_dict()) >= {"knobs", "expected", "loss", "evaluations", "history"}
    with pytest.raises(ValueError, match=r"knobs \['num_tokens'\] cannot be fitted"):
        fit_workload(H20, knobs=("num_tokens",))


def test_workloads_fit_command_writes_json(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert (
        main(
            [
                "workloads",
                "fit",
                "--steps",
                "1",
                "--nic-steps",
                "2",
                "--sampled-steps",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    rows = data["report"]["expected"]["rows"]
    assert {r["statistic"] for r in rows} == set(PUBLISHED)
    assert data["report"]["knobs"]["token_skew"] == GlmAirWorkload().token_skew
    assert "nic_share_1" in capsys.readouterr().out
