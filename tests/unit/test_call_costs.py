"""``bench.call_costs``: the per-phase fit and the reduction worked by hand, the virtual-cluster
measurement on a tiny cluster (smoke), and the gloo run end to end (slow).

No timing asserts: the tool prints numbers and writes JSON.
"""

from __future__ import annotations

import json

import pytest

from megatron_railwave.cli import main
from megatron_railwave.lab.bench.call_costs import (
    CallCostSpec,
    fit_per_phase,
    reduce_call_costs,
    virtual_call_costs,
)
from megatron_railwave.names import PAPER_ROUTES

PATHS = tuple(map(str, PAPER_ROUTES))  # call costs are fitted on the paper's four paths


def test_fit_per_phase_recovers_a_line_and_refuses_a_slope_without_spread():
    # move = 100 us + 25 us x phases exactly: slope 25, intercept 100, r2 1.
    phases = {"native": 8, "rail": 10, "perm": 16, "joint": 20}
    fit = fit_per_phase(phases, {p: 100 + 25 * n for p, n in phases.items()})
    assert fit == pytest.approx({"per_phase_us": 25.0, "fixed_us": 100.0, "r2": 1.0})
    flat = fit_per_phase(
        {p: 8 for p in PATHS}, {"native": 1.0, "rail": 2.0, "perm": 3.0, "joint": 6.0}
    )
    assert flat == {"per_phase_us": 0.0, "fixed_us": 3.0, "r2": 0.0}


def _rank(scale: float, phases: dict[str, int]) -> dict:
    names = ["count_exchange", "empty_phase_rail", "empty_phase_node", "node_barrier"]
    names += [f"{p}.{s}" for p in PATHS for s in ("plan", "prepare", "dispatch", "combine")]
    samples = {n: [scale * (i + 1), scale * (3 - i)] for i, n in enumerate(names[:1])}
    samples.update({n: [scale, 2 * scale] for n in names[1:]})
    samples["rail.plan"] = [5 * scale, 5 * scale]
    return {"samples_us": samples, "phases": phases}


def test_reduce_keeps_the_slowest_rank_per_sample():
    # count_exchange: rank 0 [1, 3], rank 1 [10, 30] -> slowest per sample [10, 30], median 20.
    # rail.plan 5 x scale vs native.plan [1, 2] x scale -> quota step 50 - 15 = 35 on rank 1's
    # scale.
    phases = {"native": 8, "rail": 10, "perm": 14, "joint": 16}
    out = reduce_call_costs([_rank(1.0, phases), _rank(10.0, {**phases, "joint": 18})])
    assert out["steps"]["count_exchange"]["median_us"] == pytest.approx(20.0)
    assert out["steps"]["count_exchange"]["samples"] == 2
    assert out["phases_per_call"]["joint"] == 18  # the rank that posts most
    assert out["move_us"]["native"] == pytest.approx(
        30.0
    )  # per sample (10 + 10, 20 + 20) -> median 30
    assert out["railbalance_us"]["quota_rail_minus_native"] == pytest.approx(50.0 - 15.0)
    assert set(out["per_phase_fit"]) == {"per_phase_us", "fixed_us", "r2"}


def test_virtual_call_costs_smoke():
    spec = CallCostSpec(
        num_nodes=2, gpus_per_node=1, tokens=8, hidden=4, experts=4, topk=2, warmups=0, samples=1
    )
    out = virtual_call_costs(spec)
    assert out["count_exchange_us_per_rank"] > 0
    assert set(out["paths"]) == set(PATHS)
    for p in PATHS:
        assert out["paths"][p]["phases_per_rank"] >= 1 and out["paths"][p]["move_us_per_rank"] > 0
        assert out["paths"][p]["plan_us"] > 0
    assert (
        out["quota_rail_minus_native_us"]
        == out["paths"]["rail"]["plan_us"] - out["paths"]["native"]["plan_us"]
    )


def test_call_cost_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="num_nodes must be >= 2"):
        CallCostSpec(num_nodes=1)
    with pytest.raises(ValueError, match="not a multiple of W = 8"):
        CallCostSpec(experts=12)


@pytest.mark.slow
def test_call_costs_cli_on_gloo(tmp_path):
    out = tmp_path / "cc.json"
    assert (
        main(
            [
                "call-costs",
                "--nodes",
                "2",
                "--gpus-per-node",
                "1",
                "--experts",
                "4",
                "--topk",
                "2",
                "--tokens",
                "8",
                "--hidden",
                "4",
                "--warmups",
                "0",
                "--samples",
                "2",
                "--no-virtual",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["schema"] == "railwave.call_costs/1"
    steps = data["gloo"]["steps"]
    assert {
        "count_exchange",
        "empty_phase_rail",
        "empty_phase_node",
        "node_barrier",
        "timing_reduce_post",
        "timing_reduce_read",
        "joint.dispatch",
    } <= set(steps)
    assert all(s["median_us"] > 0 for s in steps.values())
    assert all(n >= 1 for n in data["gloo"]["phases_per_call"].values())
