"""Calibration and validation with a deterministic fake backend; the calibrate/validate CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from megatron_railwave.cli import main
from megatron_railwave.lab import calibration
from megatron_railwave.lab.calibration import (
    ALL_PATHS,
    ReplayRequest,
    calibrate,
    calibration_requests,
    keep_anchor,
    make_backend,
    profile_request,
    request_plan,
    summarize,
    validate,
    validation_requests,
)
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions
from megatron_railwave.selector import AnchorSelector
from megatron_railwave.selector.anchors import PathLatency, load_anchors
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=4, gpus_per_node=2, name="tiny_4x2")
SETTINGS = {
    "workload": "synthetic",
    "families": [0, 1, 2, 3],
    "payload_scales": [1.0, 4.0],
    "tokens": 96,
    "num_experts": 16,
    "topk": 4,
}
RECORD_BYTES = 4096 * 2


class FakeBackend:
    """Deterministic analytic latency of a plan (seconds).

    Per wave: the busier of the busiest sender port and the busiest receiver port, where a
    receiver port fed by k senders at once carries (1 + alpha (k - 1)) x its bytes (incast); plus a
    fixed overhead per wave, plus the NVLink time of relayed records. ``noise`` > 0 multiplies each
    sample by 1 + noise * |z| (seeded), to make measurements unrepeatable.
    """

    name = "fake"

    def __init__(
        self,
        topo: RailTopology,
        *,
        alpha: float = 0.5,
        wave_s: float = 2e-4,
        noise: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.topo, self.alpha, self.wave_s, self.noise = topo, alpha, wave_s, noise
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[str, str, int]] = []

    def latency(self, request: ReplayRequest, path: Route) -> float:
        plan = request_plan(request, self.topo, path)
        n = self.topo.num_nodes
        load = plan.rail_load_NRN().to(torch.float64) * request.record_bytes
        load = load * (1 - torch.eye(n, dtype=torch.float64)).unsqueeze(1)  # [s, r, d], remote only
        total = 0.0
        for w in range(plan.num_waves):
            lw = load * (plan.pair_wave_NN == w).to(torch.float64).unsqueeze(1)
            senders = (lw > 0).sum(0).to(torch.float64)
            rx = (lw.sum(0) * (1 + self.alpha * (senders - 1).clamp(min=0))).max().item()
            total += max(lw.sum(-1).max().item(), rx) / self.topo.rail_bytes_per_s + self.wave_s
        relay = (
            plan.relayed_records()
            * request.record_bytes
            / self.topo.world_size
            / self.topo.nvlink_bytes_per_s
        )
        return total + relay

    def measure(self, request: ReplayRequest, path: Route, repeats: int) -> list[float]:
        self.calls.append((request.name, str(path), repeats))
        base = self.latency(request, path)
        return [
            base * (1 + self.noise * abs(float(self.rng.standard_normal()))) for _ in range(repeats)
        ]


@pytest.fixture(scope="module")
def requests() -> list[ReplayRequest]:
    return calibration_requests(TOPO, SETTINGS, record_bytes=RECORD_BYTES)


@pytest.fixture(scope="module")
def calibrated(requests):
    return calibrate(
        FakeBackend(TOPO),
        requests,
        TOPO,
        hidden_size=4096,
        dtype="bf16",
        warmups=1,
        repeats=3,
        settings={"requests": SETTINGS},
        progress=False,
    )


def test_profile_request_warms_up_then_interleaves_rotating_rounds(requests):
    backend = FakeBackend(TOPO)
    samples = profile_request(backend, requests[0], warmups=2, repeats=3)
    order = [(p, r) for _, p, r in backend.calls]
    assert order[:4] == [
        ("native", 2),
        ("rail", 2),
        ("perm", 2),
        ("joint", 2),
    ]  # warm-ups, discarded
    assert [p for p, _ in order[4:]] == [
        "native",
        "rail",
        "perm",
        "joint",
        "rail",
        "perm",
        "joint",
        "native",
        "perm",
        "joint",
        "native",
        "rail",
    ]
    assert {p: len(v) for p, v in samples.items()} == {p: 3 for p in ALL_PATHS}


def test_summarize_uses_linear_percentiles():
    # 1..10: p10 = 1 + 0.9 = 1.9, median 5.5, p90 = 1 + 8.1 = 9.1.
    lat = summarize([float(v) for v in range(10, 0, -1)])
    assert (lat.p10, lat.median, lat.p90, lat.samples) == pytest.approx((1.9, 5.5, 9.1, 10))


def _lat(med: float, lo: float, hi: float) -> PathLatency:
    return PathLatency(median=med, p10=lo, p90=hi, samples=10)


@pytest.mark.parametrize(
    ("rail", "joint", "kept", "reason"),
    [
        (_lat(9.0, 8.9, 9.1), _lat(10.0, 9.9, 10.1), True, "kept"),  # 1 - 9.1 / 9.9 = 8.1%
        (_lat(9.0, 9.0, 9.41), _lat(10.0, 9.9, 10.1), False, "gain"),  # 1 - 9.41 / 9.9 = 4.9%
        (
            _lat(5.0, 4.0, 8.0),
            _lat(10.0, 9.9, 10.1),
            False,
            "not repeatable",
        ),  # RAIL's p90/p10 = 2.0
        (
            _lat(5.0, 4.9, 5.1),
            _lat(10.0, 6.0, 12.0),
            False,
            "not repeatable",
        ),  # JOINT's p90/p10 = 2.0
        (_lat(11.0, 10.9, 11.1), _lat(10.0, 9.9, 10.1), False, "JOINT is fastest"),
    ],
)
def test_keep_anchor_rule(rail, joint, kept, reason):
    slow = _lat(20.0, 19.9, 20.1)
    latency = {Route.NATIVE: slow, Route.RAIL: rail, Route.PERM: slow, Route.JOINT: joint}
    best, got_kept, gain, why = keep_anchor(latency)
    assert got_kept == kept and reason in why
    if kept:
        assert best == Route.RAIL and gain == pytest.approx(1 - rail.p90 / joint.p10)


@pytest.mark.parametrize("joint_s", [1e-4, 3.3e-4, 0.0123, 0.1, 0.7, 10.0])
def test_keep_anchor_threshold_is_exactly_five_percent(joint_s):
    # The rule is "beats JOINT by >= 5%": a path at exactly 0.95 x JOINT is kept (whatever the
    # float rounding of 0.95 x t), one 0.1% short of it is dropped, with the default min_gain.
    latency = {p: _lat(2 * joint_s, 2 * joint_s, 2 * joint_s) for p in ALL_PATHS}
    latency[Route.JOINT] = _lat(joint_s, joint_s, joint_s)
    for best_s in (joint_s * 0.95, joint_s - 0.05 * joint_s, joint_s * (1 - 0.05)):
        latency[Route.RAIL] = _lat(best_s, best_s, best_s)
        best, kept, gain, why = keep_anchor(latency)
        assert (best, kept, why) == (Route.RAIL, True, "kept"), (joint_s, best_s, gain)
    latency[Route.RAIL] = _lat(joint_s * 0.951, joint_s * 0.951, joint_s * 0.951)  # 4.9% faster
    best, kept, gain, why = keep_anchor(latency)
    assert best == Route.RAIL and not kept and "< 5%" in why and gain == pytest.approx(0.049)


def test_calibrate_keeps_only_winners_over_joint(calibrated, requests):
    rows, aset = calibrated.rows, calibrated.anchor_set
    assert len(rows) == len(requests)
    kept = [r for r in rows if r.kept]
    assert kept, "the fake model makes RAIL win at small payloads with skewed rails"
    assert [a.name for a in aset.anchors] == [r.request for r in kept]
    for a in aset.anchors:
        assert a.path != Route.JOINT
        lat = a.latency_s
        assert set(lat) == set(ALL_PATHS)
        assert lat[a.path].p90 <= 0.95 * lat[Route.JOINT].p10
    for r in rows:
        if not r.kept:
            assert r.reason  # every dropped request says why
    ctx = aset.context
    assert (ctx.backend, ctx.hidden_size, ctx.dtype) == ("fake", 4096, "bf16")
    assert ctx.topology == TOPO.to_dict() and ctx.settings["requests"] == SETTINGS


def test_calibrate_drops_unrepeatable_measurements(requests):
    noisy = FakeBackend(TOPO, noise=1.0, seed=1)
    result = calibrate(
        noisy,
        requests[:4],
        TOPO,
        hidden_size=4096,
        dtype="bf16",
        warmups=0,
        repeats=6,
        progress=False,
    )
    assert result.anchor_set.anchors == ()
    assert any("not repeatable" in r.reason for r in result.rows)


def test_validate_on_calibration_points_reuses_their_anchors(calibrated, requests):
    sel = AnchorSelector(calibrated.anchor_set)
    result = validate(FakeBackend(TOPO), sel, requests, TOPO, warmups=0, repeats=1, progress=False)
    by_name = {r.request: r for r in result.rows}
    for a in calibrated.anchor_set.anchors:
        row = by_name[a.name]
        assert (row.selected, row.anchor) == (a.path, a.name)
        assert row.ratio_to_best == pytest.approx(1.0) and row.gain_vs_joint > 0.05
    s = result.summary()
    assert s["num_not_joint"] == len(calibrated.anchor_set.anchors)
    assert s["num_not_joint"] + s["num_fallback_joint"] == len(requests)
    assert s["worst_ratio_to_best"] >= 1.0


def test_validation_requests_are_held_out_families(requests):
    unseen = validation_requests(TOPO, SETTINGS, count=3, seed=50, record_bytes=RECORD_BYTES)
    assert {r.meta["family"] for r in unseen} == {50, 51, 52}
    assert len(unseen) == 3 * len(SETTINGS["payload_scales"])
    assert not {r.name for r in unseen} & {r.name for r in requests}
    again = validation_requests(TOPO, SETTINGS, count=3, seed=50, record_bytes=RECORD_BYTES)
    assert all(torch.equal(a.records_NGN, b.records_NGN) for a, b in zip(unseen, again))
    # Families are ordered as consecutive layers of one sequence per (T, arrangement, scale).
    assert [(r.meta["sequence"], r.meta["position"]) for r in unseen] == sorted(
        (r.meta["sequence"], r.meta["position"]) for r in unseen
    )
    with pytest.raises(ValueError, match=r"held-out routing families \[2, 3\] were calibrated"):
        validation_requests(TOPO, SETTINGS, count=3, seed=2, record_bytes=RECORD_BYTES)


GLM_SETTINGS = {
    "workload": "glm",
    "seed": 0,
    "layers": [1, 3, 5],
    "payload_scales": [1.0],
    "tokens": [32, 64],
    "arrangements": ["none", "ring"],
}


def test_held_out_glm_settings_use_another_seed_and_other_layers():
    held = calibration.held_out_settings(GLM_SETTINGS, seed=7)
    assert (
        held["seed"] == 7
        and held["tokens"] == [32, 64]
        and held["arrangements"] == ["none", "ring"]
    )
    assert held["layers"] == [2, 4] + list(range(6, 46))  # every layer calibration did not use
    assert calibration.held_out_settings(GLM_SETTINGS, seed=7, count=2)["layers"] == [2, 4]
    with pytest.raises(ValueError, match=r"another GLM seed than calibration's \[0\]"):
        calibration.held_out_settings(GLM_SETTINGS, seed=0)
    with pytest.raises(ValueError, match=r"held-out layers \[3\] were calibrated"):
        calibration.held_out_settings(GLM_SETTINGS, seed=7, layers=[2, 3])
    with pytest.raises(
        ValueError, match=r"another GLM seed than calibration's \[0, 7\] \(shared: \[7\]\)"
    ):
        calibration.held_out_settings({**GLM_SETTINGS, "extra_seeds": [7]}, seed=7)
    assert "extra_seeds" not in calibration.held_out_settings(
        {**GLM_SETTINGS, "extra_seeds": [3]}, seed=7
    )
    with pytest.raises(ValueError, match="calibration used every GLM-4.5-Air MoE layer"):
        calibration.held_out_settings({**GLM_SETTINGS, "layers": None}, seed=7)


def test_glm_validation_requests_share_no_seed_or_layer_with_calibration():
    cal = calibration_requests(TOPO, GLM_SETTINGS, record_bytes=RECORD_BYTES)
    val = validation_requests(TOPO, GLM_SETTINGS, seed=9, layers=[2, 4], record_bytes=RECORD_BYTES)
    assert len(cal) == 3 * 2 * 2 and len(val) == 2 * 2 * 2
    assert {(r.meta["seed"], r.meta["layer"]) for r in cal}.isdisjoint(
        {(r.meta["seed"], r.meta["layer"]) for r in val}
    )
    assert {r.meta["tokens"] for r in val} == {32, 64}
    # One sequence per (T, arrangement), layers in order inside it.
    seqs = {}
    for r in val:
        seqs.setdefault(r.meta["sequence"], []).append(r.meta["layer"])
    assert len(seqs) == 4 and all(layers == [2, 4] for layers in seqs.values())


def _row(name: str, selected: Route, times: dict[Route, float], *, seq: str = "s", pos: int = 0):
    median = {p: times.get(p, 1.0) for p in ALL_PATHS}
    best = min(ALL_PATHS, key=lambda p: (median[p], p != Route.JOINT))
    return calibration.ValidationRow(
        request=name,
        coords=(0.0, 0.0, 0.0),
        selected=selected,
        anchor=None,
        median_s=median,
        best=best,
        sequence=seq,
        position=pos,
    )


def test_validation_goal_one_allows_exactly_three_percent():
    at_limit = _row(
        "a", Route.JOINT, {Route.JOINT: 0.103, Route.RAIL: 0.1}
    )  # 1.03x the best: within
    # 0.003843 x 1.03 / 0.003843 rounds to 1.0300000000000002: still exactly 3%, still within.
    rounded = _row("r", Route.JOINT, {Route.JOINT: 0.003843 * 1.03, Route.RAIL: 0.003843}, pos=5)
    result = calibration.ValidationResult(rows=(at_limit, rounded))
    goals = result.summary()["goals"]
    assert goals["within_tolerance_of_best_on_every_request"]
    over = _row("b", Route.JOINT, {Route.JOINT: 0.1031, Route.RAIL: 0.1}, pos=1)  # 1.031x: over
    s = calibration.ValidationResult(rows=(at_limit, over)).summary()
    assert not s["goals"]["within_tolerance_of_best_on_every_request"] and not s["goals"]["all_met"]
    assert s["num_over_tolerance"] == 1 and s["over_tolerance_requests"] == ["b"]
    assert s["worst_request"] == "b" and s["worst_ratio_to_best"] == pytest.approx(1.031)


def test_validation_goal_two_needs_a_total_strictly_below_always_joint():
    same = _row("a", Route.JOINT, {Route.JOINT: 0.1})
    s = calibration.ValidationResult(rows=(same,)).summary()
    assert not s["goals"]["total_beats_always_joint"]  # equal totals do not beat JOINT
    faster = _row("b", Route.RAIL, {Route.JOINT: 0.1, Route.RAIL: 0.09}, pos=1)
    slower = _row("c", Route.NATIVE, {Route.JOINT: 0.1, Route.NATIVE: 0.102}, pos=2)
    s = calibration.ValidationResult(rows=(same, faster, slower)).summary()
    assert s["total_selected_s"] == pytest.approx(0.1 + 0.09 + 0.102)
    assert s["total_fixed_s"]["joint"] == pytest.approx(0.3)
    assert s["goals"] == {
        "within_tolerance_of_best_on_every_request": True,
        "total_beats_always_joint": True,
        "all_met": True,
    }
    assert s["selected_vs_joint_policy"] == pytest.approx(0.292 / 0.3)


def test_decision_cost_is_charged_per_layer_against_always_joint():
    # JOINT 0.3 s in all; the selection saves 8 ms (b) and loses 2 ms (c); the best per request
    # saves 10 ms (b: RAIL, c: JOINT) -> at most 10 / 3 ms per layer for any decision.
    rows = (
        _row("a", Route.JOINT, {Route.JOINT: 0.1}),
        _row("b", Route.RAIL, {Route.JOINT: 0.1, Route.RAIL: 0.09}, pos=1),
        _row("c", Route.NATIVE, {Route.JOINT: 0.1, Route.NATIVE: 0.102}, pos=2),
    )
    result = calibration.ValidationResult(rows=rows)
    cheap = result.with_decision_cost(1e-3)
    assert cheap["selected_gain_s_per_layer"] == pytest.approx(0.008 / 3)
    assert cheap["best_gain_s_per_layer"] == pytest.approx(0.010 / 3)
    assert cheap["total_selected_with_decisions_s"] == pytest.approx(0.292 + 0.003)
    assert cheap["selected_with_decisions_vs_joint_policy"] == pytest.approx(0.295 / 0.3)
    assert cheap["total_with_decisions_beats_always_joint"] and cheap["a_decision_could_pay"]
    # 3 ms per layer: more than the selection saves (beats nothing) and than the best could (0.0033
    # s: could pay).
    costly = result.with_decision_cost(3e-3)
    assert not costly["total_with_decisions_beats_always_joint"] and costly["a_decision_could_pay"]
    assert not result.with_decision_cost(4e-3)["a_decision_could_pay"]
    assert result.summary()["goals"]["all_met"]  # the flow-model goals do not read the host timing
    with pytest.raises(ValueError, match="decision_s must be"):
        result.with_decision_cost(-1.0)
    # In training one decision's path runs the forward and the backward: twice the saving for one
    # decision, so 3 ms now pays (0.584 + 0.009 < 0.6) and 4 ms could (best: 6.7 ms per decision).
    training = result.with_decision_cost(3e-3, exchanges_per_decision=2)
    assert training["selected_gain_s_per_layer"] == pytest.approx(0.016 / 3)
    assert training["total_selected_with_decisions_s"] == pytest.approx(0.584 + 0.009)
    assert training["selected_with_decisions_vs_joint_policy"] == pytest.approx(0.593 / 0.6)
    assert training["total_with_decisions_beats_always_joint"] and training["a_decision_could_pay"]
    assert result.with_decision_cost(4e-3, exchanges_per_decision=2)["a_decision_could_pay"]
    by_pass = result.decision_cost_by_pass(3e-3)
    assert {
        name: p["exchanges_per_decision"] for name, p in by_pass.items()
    } == calibration.PASS_EXCHANGES
    assert (
        by_pass["forward only"] == costly and by_pass["training"] == training
    )  # every row all pairs
    # Only the requests sent all node pairs at once count per pass: with b in windows, the
    # selection saves nothing on a and loses 2 ms on c.
    windowed = calibration.ValidationResult(
        rows=(rows[0], dataclasses.replace(rows[1], windows=3), rows[2])
    )
    assert windowed.all_pairs().rows == (rows[0], rows[2])
    by_pass = windowed.decision_cost_by_pass(0.0)
    assert by_pass["training"]["num_requests"] == 2
    assert by_pass["training"]["selected_gain_s_per_layer"] == pytest.approx(-0.004 / 2)
    assert not by_pass["training with recompute"]["total_with_decisions_beats_always_joint"]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="exchanges_per_decision must be"):
            result.with_decision_cost(1e-3, exchanges_per_decision=bad)


def test_path_changes_count_consecutive_layers_per_sequence():
    # Sequence x: layers 1..4 select rail, joint, joint, rail -> 2 changes (given out of order);
    # sequence y: one layer -> 0. A change across sequences does not count.
    rows = (
        _row("x3", Route.JOINT, {}, seq="x", pos=3),
        _row("x1", Route.RAIL, {}, seq="x", pos=1),
        _row("x2", Route.JOINT, {}, seq="x", pos=2),
        _row("x4", Route.RAIL, {}, seq="x", pos=4),
        _row("y1", Route.NATIVE, {}, seq="y", pos=1),
    )
    assert calibration.count_path_changes(rows) == {"x": 2, "y": 0}
    s = calibration.ValidationResult(rows=rows).summary()
    assert s["num_path_changes"] == 2 and s["num_sequences"] == 2


def test_requests_under_arrangements_carry_their_windows():
    settings = {
        **SETTINGS,
        "families": [0],
        "payload_scales": [1.0],
        "arrangements": ["none", "ring", "extreme"],
    }
    none, ring, extreme = calibration_requests(TOPO, settings, record_bytes=RECORD_BYTES)
    assert [r.meta["arrangement"] for r in (none, ring, extreme)] == ["none", "ring", "extreme"]
    assert none.windows is None and ring.windows.num_waves == extreme.windows.num_waves == 3
    # Same per-GPU remote volume (arrangements only relabel destination nodes) ...
    b = [calibration.request_stats(r, TOPO).B_mean_bytes for r in (none, ring, extreme)]
    assert b[0] == b[1] == b[2]
    # ... but receivers see 1 sender per window in RING, up to N - 1 = 3 in EXTREME.
    kappa = [calibration.request_stats(r, TOPO).kappa for r in (ring, extreme)]
    assert kappa[0] == pytest.approx(1.0) and kappa[1] > 2.0
    # NATIVE keeps the arrangement's windows, PERM reorders into one-to-one waves.
    assert request_plan(extreme, TOPO, Route.NATIVE).schedule == extreme.windows
    assert request_plan(extreme, TOPO, Route.PERM).schedule.max_fanin() == 1


def test_make_backend_netmodel_times_each_path_with_the_flow_model(requests):
    # The backend's samples are the flow model's time of the plan the request names, per path,
    # repeated (deterministic): not a placeholder, and not the same number for every path.
    from megatron_railwave.lab.netmodel import simulate_plan

    backend = make_backend("netmodel", TOPO)
    assert backend.name == "netmodel"
    request = requests[0]
    times = {}
    for path in ALL_PATHS:
        expected = simulate_plan(
            request_plan(request, TOPO, path),
            record_bytes=request.record_bytes,
            demand=request.demand,
        )
        got = backend.measure(request, path, 3)
        assert got == [pytest.approx(expected, rel=1e-12)] * 3, path
        times[path] = got[0]
    assert expected > 0 and len(set(times.values())) > 1


def test_make_backend_unknown_name_lists_the_backends():
    with pytest.raises(
        ValueError, match=r"--backend 'testbed' is unknown; choose one of \['netmodel'\]"
    ):
        make_backend("testbed", TOPO)


def test_profile_request_rejects_bad_samples(requests):
    class Broken(FakeBackend):
        def measure(self, request, path, repeats):
            return [float("nan")] * repeats

    with pytest.raises(ValueError, match="expected one finite time"):
        profile_request(Broken(TOPO), requests[0], warmups=0, repeats=1)


# ---------------------------------------------------------------------- CLI
def test_calibrate_and_validate_cli_with_fake_backend(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "make_backend", lambda name, topo, **kw: FakeBackend(topo))
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("name: tiny_4x2\nnum_nodes: 4\ngpus_per_node: 2\n")
    out, cal_json = tmp_path / "anchors.yaml", tmp_path / "cal.json"
    assert (
        main(
            [
                "calibrate",
                "--backend",
                "netmodel",
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(out),
                "--families",
                "3",
                "--arrangements",
                "none,extreme",
                "--payload-scales",
                "1,4",
                "--tokens",
                "96",
                "--warmups",
                "1",
                "--repeats",
                "2",
                "--no-progress",
                "--json",
                str(cal_json),
            ]
        )
        == 0
    )
    aset = load_anchors(out, RailTopology(num_nodes=4, gpus_per_node=2))
    cal = json.loads(cal_json.read_text())
    assert len(cal["requests"]) == 12 and len(cal["anchors"]["anchors"]) == len(aset.anchors)
    assert "kept" in capsys.readouterr().out

    val_json = tmp_path / "val.json"
    assert (
        main(
            [
                "validate",
                "--anchors",
                str(out),
                "--backend",
                "netmodel",
                "--requests",
                "2",
                "--seed",
                "30",
                "--warmups",
                "0",
                "--repeats",
                "1",
                "--no-progress",
                "--bench",
                "--json",
                str(val_json),
            ]
        )
        == 0
    )
    data = json.loads(val_json.read_text())
    # 2 held-out families x 2 arrangements x 2 scales, never a calibrated family.
    assert data["held_out"]["families"] == [30, 31]
    assert data["summary"]["num_requests"] == 8 and len(data["requests"]) == 8
    assert {
        "selected",
        "selected_s",
        "joint_s",
        "best_path",
        "best_s",
        "ratio_to_best",
        "within_goal",
    } <= set(data["requests"][0])
    assert set(data["summary"]["goals"]) == {
        "within_tolerance_of_best_on_every_request",
        "total_beats_always_joint",
        "all_met",
    }
    assert data["bench"]["us_per_decision"] > 0 and data["bench"]["descriptors_in_decision"]
    paid = data["decision_cost"]
    assert paid["decision_s_per_layer"] == pytest.approx(data["bench"]["us_per_decision"] * 1e-6)
    assert paid["total_selected_with_decisions_s"] > data["summary"]["total_selected_s"]
    by_pass = data["decision_cost_by_pass"]
    all_pairs = [r for r in data["requests"] if r["windows"] == 1]
    assert (
        0 < len(all_pairs) < len(data["requests"])
    )  # arrangements in windows are not the dispatcher's input
    assert by_pass["forward only"]["num_requests"] == len(all_pairs)
    assert by_pass["training"]["exchanges_per_decision"] == 2
    assert by_pass["training"]["selected_gain_s_per_layer"] == pytest.approx(
        2 * sum(r["joint_s"] - r["selected_s"] for r in all_pairs) / len(all_pairs)
    )
    printed = capsys.readouterr().out
    assert "selector decision cost" in printed and "goal 1" in printed and "goal 2" in printed
    assert "with the decision cost" in printed
    met = data["summary"]["goals"]["all_met"]
    status = main(
        [
            "validate",
            "--anchors",
            str(out),
            "--backend",
            "netmodel",
            "--requests",
            "2",
            "--seed",
            "30",
            "--warmups",
            "0",
            "--repeats",
            "1",
            "--no-progress",
            "--require-goals",
        ]
    )
    assert status == (0 if met else 1)
    with pytest.raises(SystemExit) as exc:  # held-out families must not be calibrated ones
        main(
            [
                "validate",
                "--anchors",
                str(out),
                "--backend",
                "netmodel",
                "--seed",
                "1",
                "--no-progress",
            ]
        )
    assert exc.value.code == 2
    capsys.readouterr()
    other = (
        tmp_path / "other_fabric.yaml"
    )  # the file's model with another alpha: a what-if, said so
    other.write_text("model:\n  alpha: 3.5\n")
    main(
        [
            "validate",
            "--anchors",
            str(out),
            "--backend",
            "netmodel",
            "--requests",
            "1",
            "--seed",
            "30",
            "--warmups",
            "0",
            "--repeats",
            "1",
            "--no-progress",
            "--model",
            str(other),
        ]
    )
    note = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("note: --model differs")
    ]
    assert len(note) == 1 and "alpha 0.0 -> 3.5" in note[0]  # NetModelConfig() is max-min (alpha 0)


def test_validate_cli_errors(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--anchors", str(tmp_path / "nope.yaml"), "--bench"])
    assert exc.value.code != 0
    with pytest.raises(
        SystemExit
    ) as exc:  # argparse: not a choice (the placeholder backends are gone)
        main(
            [
                "calibrate",
                "--backend",
                "testbed",
                "--cluster",
                "h800_4x8",
                "--write-anchors",
                str(tmp_path / "a.yaml"),
            ]
        )
    assert exc.value.code == 2


def test_tune_selector_leaves_each_routing_out_and_picks_the_smallest_safe_thresholds():
    # Three routings whose requests all favour RAIL by 10% over JOINT (best by 10%: JOINT is
    # 1.11x the best, over the 3% goal). Each is an anchor; their rho coordinates are 0.10, 0.30
    # and 0.20. Left out, a request sees only the other two anchors, 0.1 or 0.2 away: with shape
    # distance 0.02 or 0.05 all three fall back to JOINT; 0.1 is the smallest that serves all.
    # Without leaving its own anchor out every setting would look perfect.
    from megatron_railwave.selector.anchors import Anchor, AnchorSet, CalibrationContext
    from megatron_railwave.traffic import TrafficStats

    ref, rho_s, kappa_s = AnchorSet.scales_for(TOPO)
    lat = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
    lat[Route.RAIL] = _lat(0.9, 0.9, 0.9)
    rows, anchors = [], []
    for group, y in (("g1", 0.10), ("g2", 0.30), ("g3", 0.20)):
        st = TrafficStats(
            B_mean_bytes=ref,
            B_max_bytes=ref,
            rho_g=1 + rho_s * y,
            kappa=1 + kappa_s * 0.5,
            coords=(0.0, y, 0.5),
            records_total=1,
            remote_records=1,
        )
        rows.append(
            calibration.CalibrationRow(
                request=group,
                stats=st,
                coords=st.coords,
                latency=lat,
                best=Route.RAIL,
                kept=True,
                gain=0.1,
                reason="kept",
                group=group,
            )
        )
        anchors.append(
            Anchor(
                name=group,
                coords=st.coords,
                B_mean_bytes=ref,
                rho_g=st.rho_g,
                kappa=st.kappa,
                path=Route.RAIL,
                latency_s=lat,
            )
        )
    ctx = CalibrationContext(
        topology=TOPO.to_dict(), hidden_size=1, dtype="bf16", backend="fake", date="x"
    )
    result = calibration.CalibrationResult(
        anchor_set=AnchorSet(anchors=tuple(anchors), scales=(ref, rho_s, kappa_s), context=ctx),
        rows=tuple(rows),
    )
    tuned = calibration.tune_selector(
        result,
        grid={"payload_ratio": (1.25,), "shape_distance": (0.02, 0.05, 0.1, 0.2)},
        split_fallback=False,
    )
    no_anchors, *scores = tuned["scores"]
    scores = [sc for sc in scores if sc["hold_rule"]]
    assert (
        no_anchors["shape_distance"] is None and no_anchors["over_tolerance"] == 3
    )  # JOINT 1.11x the best
    over = {sc["shape_distance"]: sc["over_tolerance"] for sc in scores}
    assert over == {0.02: 3, 0.05: 3, 0.1: 0, 0.2: 0}
    assert (tuned["payload_ratio"], tuned["shape_distance"]) == (
        1.25,
        0.1,
    )  # 0.2 ties: the smaller wins
    assert tuned["use_anchors"] is True


def _twin_layer_result(seeds: dict[str, float]):
    """Two layers per seed at one rho coordinate per seed; every request favours RAIL by 10%
    (JOINT 1.11x the best) and is an anchor."""
    from megatron_railwave.selector.anchors import Anchor, AnchorSet, CalibrationContext
    from megatron_railwave.traffic import TrafficStats

    ref, rho_s, kappa_s = AnchorSet.scales_for(TOPO)
    lat = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
    lat[Route.RAIL] = _lat(0.9, 0.9, 0.9)
    rows, anchors = [], []
    for seed, y in seeds.items():
        for layer in (1, 3):
            name = f"{seed}-l{layer}"
            st = TrafficStats(
                B_mean_bytes=ref,
                B_max_bytes=ref,
                rho_g=1 + rho_s * y,
                kappa=1 + kappa_s * 0.5,
                coords=(0.0, y, 0.5),
                records_total=1,
                remote_records=1,
            )
            rows.append(
                calibration.CalibrationRow(
                    request=name,
                    stats=st,
                    coords=st.coords,
                    latency=lat,
                    best=Route.RAIL,
                    kept=True,
                    gain=0.1,
                    reason="kept",
                    group=name,
                    seed=seed,
                )
            )
            anchors.append(
                Anchor(
                    name=name,
                    coords=st.coords,
                    B_mean_bytes=ref,
                    rho_g=st.rho_g,
                    kappa=st.kappa,
                    path=Route.RAIL,
                    latency_s=lat,
                )
            )
    ctx = CalibrationContext(
        topology=TOPO.to_dict(), hidden_size=1, dtype="bf16", backend="fake", date="x"
    )
    return calibration.CalibrationResult(
        anchor_set=AnchorSet(anchors=tuple(anchors), scales=(ref, rho_s, kappa_s), context=ctx),
        rows=tuple(rows),
    )


def test_tune_selector_leaves_out_whole_seeds_when_calibration_spans_several():
    # Seeds s1 (rho 0.10) and s2 (rho 0.20), two layers each at their seed's point. Left out one
    # layer at a time, each request still has its twin layer's anchor on its own point and every
    # threshold looks safe; left out one seed at a time (what validation holds out), a request
    # sees only the other seed's anchors 0.1 away: 0.02 and 0.05 fall back to JOINT (4 requests
    # over 1.03x), 0.1 serves all.
    grid = {"payload_ratio": (1.25,), "shape_distance": (0.02, 0.05, 0.1, 0.2)}
    tuned = calibration.tune_selector(
        _twin_layer_result({"glm1": 0.10, "glm2": 0.20}), grid=grid, split_fallback=False
    )
    assert tuned["left_out"] == "seed"
    assert (
        tuned["method"]
        == "leave-one-seed-out on the calibration requests, anchors that hold across seeds"
    )
    assert {
        sc["shape_distance"]: sc["over_tolerance"] for sc in tuned["scores"][1:] if sc["hold_rule"]
    } == {0.02: 4, 0.05: 4, 0.1: 0, 0.2: 0}
    assert tuned["shape_distance"] == 0.1 and tuned["use_anchors"] is True
    # One seed only: leaving it out would leave no anchor, so routings are left out instead.
    one = calibration.tune_selector(
        _twin_layer_result({"glm1": 0.10}), grid=grid, split_fallback=False
    )
    assert one["left_out"] == "routing" and one["shape_distance"] == 0.02
    assert {sc["over_tolerance"] for sc in one["scores"][1:]} == {
        0
    }  # with and without the hold rule
    assert (
        one["scores"][0]["over_tolerance"] == 2 and one["use_anchors"] is True
    )  # always-JOINT misses both


def test_tune_selector_keeps_no_anchors_when_none_beat_always_joint():
    # Two seeds whose layers favour RAIL by 10% are anchors; with RAIL faster the anchors earn
    # their place (always-JOINT misses all 4 requests, shape distance 0.1 none).
    res = _twin_layer_result({"glm1": 0.10, "glm2": 0.20})
    grid = {"payload_ratio": (1.25,), "shape_distance": (0.02, 0.05, 0.1, 0.2)}
    assert calibration.tune_selector(res, grid=grid, split_fallback=False)["use_anchors"] is True
    from megatron_railwave.selector.anchors import AnchorSet

    # The same anchors, but every request is now faster on JOINT (RAIL 10% slower): anchors
    # chosen from the other seed always hurt, so the tuning keeps none.
    lat = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
    lat[Route.RAIL] = _lat(1.1, 1.1, 1.1)
    rows = tuple(dataclasses.replace(r, latency=lat, best=Route.JOINT) for r in res.rows)
    worse = calibration.CalibrationResult(anchor_set=res.anchor_set, rows=rows)
    tuned = calibration.tune_selector(worse, grid=grid, split_fallback=False)
    assert tuned["use_anchors"] is False and tuned["scores"][0]["over_tolerance"] == 0
    assert "no anchors are kept" in tuned["method"]
    # Equal scores also keep none: anchors must be strictly better than always-JOINT.
    flat = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
    tie = calibration.CalibrationResult(
        anchor_set=res.anchor_set,
        rows=tuple(dataclasses.replace(r, latency=flat) for r in res.rows),
    )
    assert calibration.tune_selector(tie, grid=grid, split_fallback=False)["use_anchors"] is False
    # An empty anchor set never "uses" anchors.
    empty = calibration.CalibrationResult(
        anchor_set=AnchorSet(
            anchors=(), scales=res.anchor_set.scales, context=res.anchor_set.context
        ),
        rows=res.rows,
    )
    assert calibration.tune_selector(empty, grid=grid, split_fallback=False)["use_anchors"] is False


def test_calibration_rows_name_their_generator_seed():
    glm = calibration_requests(
        TOPO, {**GLM_SETTINGS, "extra_seeds": [5]}, record_bytes=RECORD_BYTES
    )
    assert {calibration.request_seed(r) for r in glm} == {"glm0", "glm5"}
    assert len({calibration.request_group(r) for r in glm}) == 2 * len(GLM_SETTINGS["layers"])
    syn = calibration_requests(TOPO, SETTINGS, record_bytes=RECORD_BYTES)
    assert {calibration.request_seed(r) for r in syn} == {
        "synthetic-f0",
        "synthetic-f1",
        "synthetic-f2",
        "synthetic-f3",
    }


def test_netmodel_backend_runs_rail_chunks_only_with_the_request_masks(requests):
    backend = make_backend("netmodel", TOPO, options=PlanOptions(chunks=2))
    request = requests[0]
    assert request.demand is not None  # the workloads' requests carry their target masks
    assert backend.measure(request, Route("joint"), 1)[0] > 0
    bare = dataclasses.replace(request, name="bare", demand=None)
    with pytest.raises(
        ValueError,
        match=r"request 'bare': a plan with 2 rail chunks per wave needs the request's "
        r"target masks",
    ):
        backend.measure(bare, Route("joint"), 1)


def test_calibrate_with_rail_chunks_times_the_chunked_joint_and_validate_reuses_it(tmp_path):
    # The anchors compare paths against JOINT with --chunks 2: the file records it, the JOINT
    # latencies are those of the 2-chunk plan (not whole waves), and validate times that JOINT too.
    from megatron_railwave.lab.netmodel import simulate_plan

    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("name: tiny_4x2\nnum_nodes: 4\ngpus_per_node: 2\n")
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    out, cal_json, val_json = tmp_path / "a.yaml", tmp_path / "cal.json", tmp_path / "val.json"
    common = ["--backend", "netmodel", "--warmups", "0", "--repeats", "1", "--no-progress"]
    assert (
        main(
            [
                "calibrate",
                *common,
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(out),
                "--families",
                "2",
                "--arrangements",
                "none",
                "--tokens",
                "64",
                "--hidden",
                "64",
                "--chunks",
                "2",
                "--json",
                str(cal_json),
            ]
        )
        == 0
    )
    aset = load_anchors(out, topo)
    assert aset.chunks == 2
    settings = aset.context.settings["requests"]
    reqs = calibration_requests(topo, settings, record_bytes=64 * 2)
    rows = {r["request"]: r for r in json.loads(cal_json.read_text())["requests"]}

    def joint_s(req, chunks):
        plan = calibration.request_plan(req, topo, Route.JOINT, PlanOptions(chunks=chunks))
        return simulate_plan(plan, record_bytes=req.record_bytes, demand=req.demand)

    for req in reqs:
        got = rows[req.name]["latency_s"]["joint"]["median"]
        assert got == pytest.approx(joint_s(req, 2), rel=1e-12) and got != pytest.approx(
            joint_s(req, 1), rel=1e-6
        )
    assert (
        main(
            [
                "validate",
                "--anchors",
                str(out),
                *common,
                "--requests",
                "1",
                "--seed",
                "40",
                "--json",
                str(val_json),
            ]
        )
        == 0
    )
    val = json.loads(val_json.read_text())["requests"]
    held = calibration.validation_requests(topo, settings, seed=40, count=1, record_bytes=64 * 2)
    assert [r["request"] for r in val] == [r.name for r in held]
    for row, req in zip(val, held):
        assert row["joint_s"] == pytest.approx(joint_s(req, 2), rel=1e-12)
    with pytest.raises(SystemExit) as exc:  # outside 1..64: a clear error before any work
        main(
            [
                "calibrate",
                *common,
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(tmp_path / "b.yaml"),
                "--chunks",
                "0",
            ]
        )
    assert exc.value.code == 2


def test_calibrate_retune_rebuilds_the_same_file_from_the_json_without_measuring(
    tmp_path, monkeypatch
):
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("name: tiny_4x2\nnum_nodes: 4\ngpus_per_node: 2\n")
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    out, cal_json = tmp_path / "a.yaml", tmp_path / "cal.json"
    assert (
        main(
            [
                "calibrate",
                "--backend",
                "netmodel",
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(out),
                "--families",
                "3",
                "--arrangements",
                "none",
                "--tokens",
                "32,64",
                "--hidden",
                "64",
                "--warmups",
                "0",
                "--repeats",
                "1",
                "--no-progress",
                "--json",
                str(cal_json),
            ]
        )
        == 0
    )

    def no_backend(*args, **kwargs):
        raise AssertionError("--retune must not measure")

    monkeypatch.setattr(calibration, "make_backend", no_backend)
    again, again_json = tmp_path / "b.yaml", tmp_path / "b.json"
    assert (
        main(
            [
                "calibrate",
                "--retune",
                str(cal_json),
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(again),
                "--json",
                str(again_json),
            ]
        )
        == 0
    )
    first, second = load_anchors(out, topo), load_anchors(again, topo)
    assert second.anchors == first.anchors and second.scales == first.scales
    assert second.context.settings == first.context.settings
    assert (
        json.loads(again_json.read_text())["requests"]
        == json.loads(cal_json.read_text())["requests"]
    )
    # A file of other path-model features (another version's): its rows' features and its model
    # are dropped, not refused, and with_features computes this version's again, bitwise.
    stale = json.loads(cal_json.read_text())
    stale["features"] = ["const", "x"]
    for row in stale["requests"]:
        row["features"] = [1.0, 0.0]
    stale["anchors"]["context"]["settings"].setdefault("selector", {})["model"] = {
        "features": ["const", "x"]
    }
    dropped = calibration.result_from_json(stale, topo=topo)
    assert all(r.features is None for r in dropped.rows)
    assert [
        list(r.features) for r in calibration.with_features(dropped, topo, progress=False).rows
    ] == [r["features"] for r in json.loads(cal_json.read_text())["requests"]]
    # The rows' keep decisions rebuild the anchors even where a file dropped them.
    data = json.loads(cal_json.read_text())
    data["anchors"]["anchors"] = []
    result = calibration.result_from_json(data, topo=topo)
    assert [a.name for a in result.anchor_set.anchors] == [
        r["request"] for r in data["requests"] if r["kept"]
    ]
    with pytest.raises(ValueError, match=r"field 'requests\[0\]' is malformed"):
        calibration.result_from_json({**data, "requests": [{"request": "x"}]})
    with pytest.raises(ValueError, match=r"expected the JSON of `railwave calibrate --json`"):
        calibration.result_from_json({"requests": []})


def test_tune_selector_drops_anchors_that_do_not_hold_on_other_seeds():
    # Seeds glm1 (rho 0.10) and glm2 (rho 0.20): RAIL 10% faster, all four layers anchors. Seed
    # glm3 at rho 0.15 is between them, but there RAIL is 10% *slower* than JOINT. With shape
    # distance 0.1 every anchor would serve glm3's layers, where its path is off the best: none
    # holds. Left out, glm3 does not count against them (its rows are what is predicted), so they
    # serve it badly; glm1 or glm2 left out lose the other seed's anchors (they fail on glm3) and
    # fall back to JOINT. With 0.02 they hold (nobody else is near) but serve no other seed.
    # "No anchors" is at least as good as every setting: the file keeps none.
    res = _twin_layer_result({"glm1": 0.10, "glm2": 0.20})
    from megatron_railwave.selector.anchors import AnchorSet
    from megatron_railwave.traffic import TrafficStats

    ref, rho_s, kappa_s = AnchorSet.scales_for(TOPO)
    slow_rail = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
    slow_rail[Route.RAIL] = _lat(1.1, 1.1, 1.1)
    extra = []
    for layer in (1, 3):
        st = TrafficStats(
            B_mean_bytes=ref,
            B_max_bytes=ref,
            rho_g=1 + rho_s * 0.15,
            kappa=1 + kappa_s * 0.5,
            coords=(0.0, 0.15, 0.5),
            records_total=1,
            remote_records=1,
        )
        extra.append(
            calibration.CalibrationRow(
                request=f"glm3-l{layer}",
                stats=st,
                coords=st.coords,
                latency=slow_rail,
                best=Route.JOINT,
                kept=False,
                gain=0.0,
                reason="JOINT is fastest",
                group=f"glm3-l{layer}",
                seed="glm3",
            )
        )
    mixed = calibration.CalibrationResult(anchor_set=res.anchor_set, rows=res.rows + tuple(extra))
    grid = {"payload_ratio": (1.25,), "shape_distance": (0.02, 0.1)}
    tuned = calibration.tune_selector(mixed, grid=grid, split_fallback=False)
    with_rule = [sc for sc in tuned["scores"][1:] if sc["hold_rule"]]
    assert {sc["shape_distance"]: sc["anchors_held"] for sc in with_rule} == {0.02: 4, 0.1: 0}
    # 0.02: glm1 / glm2 fall back to JOINT (4 over); 0.1: those 4 plus glm3's 2 on RAIL.
    assert {sc["shape_distance"]: sc["over_tolerance"] for sc in with_rule} == {0.02: 4, 0.1: 6}
    assert tuned["scores"][0]["over_tolerance"] == 4  # always-JOINT
    # Without the rule, 0.1 lets glm1 and glm2 serve each other and sends glm3 to RAIL: 2 over,
    # fewer than always-JOINT's 4, so the tuning keeps every anchor there (the rule is scored,
    # not imposed).
    assert (
        tuned["use_anchors"] is True
        and tuned["hold_rule"] is False
        and tuned["shape_distance"] == 0.1
    )
    assert len(tuned["held"]) == 4
    # With four glm3 layers, keeping the anchors loses as much as it gains (4 over either way, the
    # same total): anchors must be strictly better, so none is kept.
    more = calibration.CalibrationResult(
        anchor_set=res.anchor_set,
        rows=res.rows
        + tuple(extra)
        + tuple(
            dataclasses.replace(r, request=r.request + "b", group=r.group + "b") for r in extra
        ),
    )
    worse = calibration.tune_selector(more, grid=grid, split_fallback=False)
    assert worse["use_anchors"] is False and worse["held"] == []
    # Without glm3, the anchors hold at 0.1 and serve each other's seed: all kept.
    plain = calibration.tune_selector(res, grid=grid, split_fallback=False)
    assert (
        plain["use_anchors"] is True and plain["shape_distance"] == 0.1 and len(plain["held"]) == 4
    )


def test_calibrate_retune_merges_runs_at_other_token_counts(tmp_path):
    # Two runs at T = 32 and T = 64, merged by --retune, give the file one run at 32,64 gives
    # (same rows, anchors, thresholds; tokens the union); a run with other chunks is refused.
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("name: tiny_4x2\nnum_nodes: 4\ngpus_per_node: 2\n")
    topo = RailTopology(num_nodes=4, gpus_per_node=2)

    def run(name, tokens, chunks="2"):
        assert (
            main(
                [
                    "calibrate",
                    "--backend",
                    "netmodel",
                    "--cluster",
                    str(cluster),
                    "--families",
                    "3",
                    "--arrangements",
                    "none,extreme",
                    "--tokens",
                    tokens,
                    "--hidden",
                    "64",
                    "--chunks",
                    chunks,
                    "--warmups",
                    "0",
                    "--repeats",
                    "1",
                    "--no-progress",
                    "--write-anchors",
                    str(tmp_path / f"{name}.yaml"),
                    "--json",
                    str(tmp_path / f"{name}.json"),
                ]
            )
            == 0
        )
        return str(tmp_path / f"{name}.json")

    both, low, high, other = (
        run("both", "32,64"),
        run("low", "32"),
        run("high", "64"),
        run("other", "64", "1"),
    )
    merged = tmp_path / "merged.yaml"
    assert (
        main(
            [
                "calibrate",
                "--retune",
                f"{low},{high}",
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(merged),
                "--json",
                str(tmp_path / "merged.json"),
            ]
        )
        == 0
    )
    got, want = load_anchors(merged, topo), load_anchors(tmp_path / "both.yaml", topo)
    assert got.anchors == want.anchors
    assert got.context.settings["requests"] == want.context.settings["requests"]
    assert got.context.settings["selector"] == want.context.settings["selector"]
    assert (
        json.loads((tmp_path / "merged.json").read_text())["requests"]
        == json.loads(open(both).read())["requests"]
    )
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "calibrate",
                "--retune",
                f"{low},{other}",
                "--cluster",
                str(cluster),
                "--write-anchors",
                str(merged),
            ]
        )
    assert exc.value.code == 2
    results = [calibration.result_from_json(json.loads(open(f).read())) for f in (low, other)]
    with pytest.raises(ValueError, match=r"field 'context.settings.chunks' is 1 there and 2 here"):
        calibration.merge_results(results, ["low", "other"])
    with pytest.raises(ValueError, match=r"share requests"):
        calibration.merge_results(results[:1] * 2, ["low", "low"])


def test_tune_selector_splits_the_fallback_at_the_payload_where_rail_stops_winning(tmp_path):
    # Two seeds, two layers each, at payload coordinates -3 and -1 (all pairs at once): RAIL is
    # 10% faster than JOINT at -3 and 10% slower at -1, whatever the shape. No anchor is kept (the
    # keep rule is not asked here), so only the split can serve -3: the cut lands just above -3.
    from megatron_railwave.selector.anchors import AnchorSet, CalibrationContext, save_anchors
    from megatron_railwave.traffic import TrafficStats

    ref, rho_s, kappa_s = AnchorSet.scales_for(TOPO)
    rows = []
    for seed, y in (("glm1", 0.1), ("glm2", 0.4)):
        for x, rail in ((-3.0, 0.9), (-1.0, 1.1)):
            lat = {p: _lat(1.0, 1.0, 1.0) for p in ALL_PATHS}
            lat[Route.RAIL] = _lat(rail, rail, rail)
            b = ref * 2**x
            st = TrafficStats(
                B_mean_bytes=b,
                B_max_bytes=b,
                rho_g=1 + rho_s * y,
                kappa=1.0,
                coords=(x, y, 0.0),
                records_total=1,
                remote_records=1,
            )
            rows.append(
                calibration.CalibrationRow(
                    request=f"{seed}-x{x}",
                    stats=st,
                    coords=st.coords,
                    latency=lat,
                    best=Route.RAIL if rail < 1 else Route.JOINT,
                    kept=False,
                    gain=0.0,
                    reason="-",
                    group=f"{seed}-x{x}",
                    seed=seed,
                )
            )
    ctx = CalibrationContext(
        topology=TOPO.to_dict(), hidden_size=1, dtype="bf16", backend="fake", date="x"
    )
    result = calibration.CalibrationResult(
        anchor_set=AnchorSet(anchors=(), scales=(ref, rho_s, kappa_s), context=ctx),
        rows=tuple(rows),
    )
    grid = {"payload_ratio": (1.25,), "shape_distance": (0.1,)}
    assert (
        calibration.tune_selector(result, grid=grid, split_fallback=False)["fallback_below"] is None
    )
    tuned = calibration.tune_selector(result, grid=grid)
    below = tuned["fallback_below"]
    assert tuned["use_anchors"] is False and below["path"] == "rail"
    assert below["payload_bytes"] == pytest.approx(ref * 2 ** (-3.0 + 0.005))
    assert tuned["scores"][0]["over_tolerance"] == 0  # always-JOINT would miss the two at -3
    # The file records it, the runtime selector applies it: RAIL below the cut (all pairs), JOINT
    # above it, and JOINT on an input with as many windows as JOINT has waves (no fewer phases).
    from megatron_railwave.lab.calibration import with_selector_settings

    path = save_anchors(with_selector_settings(result.anchor_set, tuned), tmp_path / "a.yaml")
    aset = load_anchors(path, TOPO)
    assert aset.fallback_below == (pytest.approx(below["payload_bytes"]), Route.RAIL)
    sel = AnchorSelector(aset, fallback_below=aset.fallback_below)
    assert sel.select(rows[0].stats) == Route.RAIL and sel.select(rows[1].stats) == Route.JOINT
    assert sel.explain(rows[0].stats, input_windows=TOPO.num_nodes - 1).path == Route.JOINT
    with pytest.raises(ValueError, match=r"fallback_below must be \(bytes > 0, native or rail\)"):
        AnchorSelector(aset, fallback_below=(1.0, "joint"))
