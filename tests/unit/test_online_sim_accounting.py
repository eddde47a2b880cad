"""``lab.bench.online_sim.charged_totals``: the online selector's charged total and the per-epoch
hindsight oracle, on hand-made times."""

import numpy as np
import pytest

from megatron_railwave.lab.bench.online_sim import charged_totals


def _case():
    # S = 4 steps, L = 1 layer, P = 2 paths; epochs [0, 0, 1, 1]; path 0 best in epoch 0, 1 in 1.
    t_SLP = np.array([[[1.0, 3.0]], [[1.0, 3.0]], [[4.0, 2.0]], [[4.0, 2.0]]])
    epoch_S = np.array([0, 0, 1, 1])
    chosen_SL = np.array([[1], [0], [0], [1]])  # probe 1, run 0, probe 0, run 1
    probe_SL = np.array([[True], [False], [True], [False]])
    host_s_SL = np.full((4, 1), 1e-3)
    plan_s_XLP = np.array([[[0.01, 0.02]], [[0.03, 0.04]]])
    return t_SLP, chosen_SL, epoch_S, host_s_SL, probe_SL, plan_s_XLP


def test_charged_total_counts_host_and_probed_plans_only():
    t = charged_totals(*_case())
    online = 3.0 + 1.0 + 4.0 + 2.0
    assert t["host_s"] == pytest.approx(4e-3)
    # probes: step 0 path 1 at epoch 0 (0.02), step 2 path 0 at epoch 1 (0.03); runs not charged
    assert t["probe_planning_s"] == pytest.approx(0.05)
    assert t["online_charged"] == pytest.approx(online + 4e-3 + 0.05)


def test_epoch_oracle_is_best_fixed_path_per_epoch_and_not_above_per_layer_oracle():
    t_SLP, *rest = _case()
    t = charged_totals(t_SLP, *rest)
    assert t["oracle_per_epoch"] == pytest.approx(2.0 + 4.0)  # 2 x path 0, then 2 x path 1
    per_layer = t_SLP.sum(axis=0).min(axis=1).sum()  # either path over all steps: 10
    assert t["oracle_per_epoch"] <= per_layer and per_layer == pytest.approx(10.0)
    assert t["oracle_per_epoch"] <= t["online_charged"]


def test_planning_not_measured_counts_zero():
    t_SLP, chosen_SL, epoch_S, host_s_SL, probe_SL, _ = _case()
    t = charged_totals(t_SLP, chosen_SL, epoch_S, host_s_SL, probe_SL, None)
    assert t["probe_planning_s"] == 0.0
