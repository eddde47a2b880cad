"""Incast calibration: scaling, the fit on a small GLM replay, and the written config."""

import pytest
import yaml

from megatron_railwave.netmodel import NetModelConfig, load_netmodel_config
from megatron_railwave.netmodel.calibrate import PAPER_INCAST, calibrate_incast, write_config
from megatron_railwave.topology import RailTopology

H800 = RailTopology(num_nodes=4, gpus_per_node=8, rail_gbps=400.0, nvlink_gBps=155.0, name="h800_4x8")


@pytest.fixture(scope="module")
def small_fit():
    # Two layers, few tokens: the payload scale brings the RING sum to the paper's 1.801 s.
    return calibrate_incast(H800, tokens=128, layers=(1, 2), tol=1e-2, log=None)


@pytest.mark.xfail(strict=True, reason=(
    "issue 13: with the fitted GLM workload (source-rail skew from token counts) max-min alone gives "
    "EXTREME / RING ~1.1, and no alpha within the bounds reaches the paper's +67.1% with the saturating "
    "law either (docs/netmodel.md); open in issue 13 until the workload or the model can express it"))
def test_calibrate_incast_hits_the_paper_ratio(small_fit):
    target = PAPER_INCAST["high_s"] / PAPER_INCAST["low_s"]
    assert small_fit.target_ratio == pytest.approx(1.6707, abs=1e-4)
    assert small_fit.ratio_at_zero < target  # max-min alone: concentration costs less than measured
    assert small_fit.fitted_ratio == pytest.approx(target, rel=1e-2)
    assert small_fit.low_s == pytest.approx(PAPER_INCAST["low_s"], rel=1e-2)
    assert 0 < small_fit.model.alpha < 4
    ratios = [r for _, r in small_fit.curve]
    assert ratios == sorted(ratios)  # more alpha, more slowdown of the concentrated windows


def test_write_config_round_trips(small_fit, tmp_path):
    out = tmp_path / "m.yaml"
    write_config(str(out), small_fit, cluster="h800_4x8")
    assert load_netmodel_config(out) == small_fit.model
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["experiment"]["high_s"] == 3.009
    assert {"payload_scale", "implied_tokens", "ratio_at_zero", "fitted_ratio"} <= set(data["calibration"])


def test_calibrated_config_is_the_default():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / "netmodel" / "h800_4x8.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["model"]["alpha"] == NetModelConfig().alpha
    assert abs(data["calibration"]["fitted_ratio"] - data["calibration"]["target_ratio"]) < 2e-3
