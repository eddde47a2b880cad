"""``testbed.model_compare``: the flow model on a study's plans, one parameter fitted on one case.

Letters: N nodes, G GPUs per node (= rails). A study result is built by hand (no testbed needed):
its measured P50s are the model's own unfitted predictions x 1.5, except one case.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from megatron_railwave.lab.testbed.experiment import StudyConfig
from megatron_railwave.lab.testbed.model_compare import compare_with_netmodel

_TB = {"nodes": 2, "gpus_per_node": 2, "rail_mbit": 10.0, "mtu": 4096}
_CFG = StudyConfig(
    patterns=("ring",), rails=("skewed",), paths=("native", "joint"), tokens=16, hidden=256
)


def _study(comm_s: dict[tuple[str, str], float]) -> dict:
    workloads: dict = {}
    for (name, path), t in comm_s.items():
        workloads.setdefault(name, {"paths": {}})["paths"][path] = {
            "comm_slowest_s": {"p50": t},
            "slowest_s": {"p50": t + 0.01},
        }
    return {"testbed": _TB, "config": asdict(_CFG), "workloads": workloads}


def test_fit_reproduces_its_case_and_predicts_the_rest():
    keys = [("ring-skewed", "native"), ("ring-skewed", "joint")]
    unfitted = compare_with_netmodel(_study({k: 1.0 for k in keys}), fit_on=None)
    assert unfitted["model"]["fitted_value"] is None
    model_s = {(r["workload"], r["path"]): r["model_s"] for r in unfitted["rows"]}
    measured = {k: 1.5 * v for k, v in model_s.items()}
    res = compare_with_netmodel(
        _study(measured), fit_on=keys[0], fit_param="wave_latency", wave_latency_s=0.0
    )
    rows = {(r["workload"], r["path"]): r for r in res["rows"]}
    assert res["model"]["fitted_on"] == list(keys[0])
    assert rows[keys[0]]["rel_error_comm"] == pytest.approx(0.0, abs=1e-6)
    assert res["model"]["fitted_value"] > 0  # a fixed cost per rail phase makes up the 50%
    # The other case is a prediction: the model is unchanged by its measurement.
    res2 = compare_with_netmodel(
        _study({**measured, keys[1]: 99.0}),
        fit_on=keys[0],
        fit_param="wave_latency",
        wave_latency_s=0.0,
    )
    assert {r["path"]: r["model_s"] for r in res2["rows"]} == {
        r["path"]: r["model_s"] for r in res["rows"]
    }
    assert res2["within_25pct_comm"] == 1 and res2["cases"] == 2

    # Per-rank phases by default (what the exchange does); 'global' is the earlier model.
    assert res["model"]["phase_sync"] == "rank"
    glob = compare_with_netmodel(_study(measured), fit_on=None, phase_sync="global")
    assert glob["model"]["phase_sync"] == "global" and len(glob["rows"]) == 2


def test_alpha_from_the_k_to_1_probe():
    # k = 2 senders take 2.5 x one sender's time: slowdown 1.25 over the max-min time (2 x one
    # sender's), and the incast law says slowdown - 1 = alpha x (k - k_free) = alpha.
    incast = [{"fan_in": 1, "median_s": 1.0}, {"fan_in": 2, "median_s": 2.5}]
    res = compare_with_netmodel(
        _study({("ring-skewed", "native"): 1.0, ("ring-skewed", "joint"): 1.0}),
        incast=incast,
        fit_on=None,
    )
    assert res["model"]["alpha"] == pytest.approx(0.25, rel=1e-6)


def test_recorded_routing_is_replayed_not_regenerated():
    # A study that recorded its routing: the model runs on those ids, whatever the generator
    # makes today. Recording the generator's own ids gives the same predictions as rebuilding;
    # recording other ids (every token to expert 0) gives other ones.
    from megatron_railwave.lab.testbed.experiment import build_workloads
    from megatron_railwave.topology import RailTopology

    keys = [("ring-skewed", "native"), ("ring-skewed", "joint")]
    study = _study({k: 1.0 for k in keys})
    rebuilt = compare_with_netmodel(study, fit_on=None)
    wl = build_workloads(RailTopology(num_nodes=2, gpus_per_node=2), _CFG)[0]
    study["workloads"]["ring-skewed"].update(
        topk_ids_WTK=wl["ids_WTK"].tolist(), windows=wl["windows"]
    )
    replayed = compare_with_netmodel(study, fit_on=None)
    assert [r["model_s"] for r in replayed["rows"]] == pytest.approx(
        [r["model_s"] for r in rebuilt["rows"]]
    )
    study["workloads"]["ring-skewed"]["topk_ids_WTK"] = np.zeros_like(wl["ids_WTK"]).tolist()
    other = compare_with_netmodel(study, fit_on=None)
    assert [r["model_s"] for r in other["rows"]] != pytest.approx(
        [r["model_s"] for r in rebuilt["rows"]]
    )
