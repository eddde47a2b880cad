"""Calibration and validation with a deterministic fake backend; the calibrate/validate CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_railwave import calibration
from megatron_railwave.anchors import PathLatency, load_anchors
from megatron_railwave.calibration import (
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
from megatron_railwave.cli import main
from megatron_railwave.planner import Path
from megatron_railwave.selector import AnchorSelector
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=4, gpus_per_node=2, name="tiny_4x2")
SETTINGS = {"workload": "synthetic", "families": [0, 1, 2, 3], "payload_scales": [1.0, 4.0], "tokens": 96,
            "num_experts": 16, "topk": 4}
RECORD_BYTES = 4096 * 2


class FakeBackend:
    """Deterministic analytic latency of a plan (seconds).

    Per wave: the busier of the busiest sender port and the busiest receiver port, where a
    receiver port fed by k senders at once carries (1 + alpha (k - 1)) x its bytes (incast); plus a
    fixed overhead per wave, plus the NVLink time of relayed records. ``noise`` > 0 multiplies each
    sample by 1 + noise * |z| (seeded), to make measurements unrepeatable.
    """

    name = "fake"

    def __init__(self, topo: RailTopology, *, alpha: float = 0.5, wave_s: float = 2e-4, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.topo, self.alpha, self.wave_s, self.noise = topo, alpha, wave_s, noise
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[str, str, int]] = []

    def latency(self, request: ReplayRequest, path: Path) -> float:
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
        relay = plan.relayed_records() * request.record_bytes / self.topo.world_size / self.topo.nvlink_bytes_per_s
        return total + relay

    def measure(self, request: ReplayRequest, path: Path, repeats: int) -> list[float]:
        self.calls.append((request.name, str(path), repeats))
        base = self.latency(request, path)
        return [base * (1 + self.noise * abs(float(self.rng.standard_normal()))) for _ in range(repeats)]


@pytest.fixture(scope="module")
def requests() -> list[ReplayRequest]:
    return calibration_requests(TOPO, SETTINGS, record_bytes=RECORD_BYTES)


@pytest.fixture(scope="module")
def calibrated(requests):
    return calibrate(FakeBackend(TOPO), requests, TOPO, hidden_size=4096, dtype="bf16", warmups=1, repeats=3,
                     settings={"requests": SETTINGS}, progress=False)


def test_profile_request_warms_up_then_interleaves_rotating_rounds(requests):
    backend = FakeBackend(TOPO)
    samples = profile_request(backend, requests[0], warmups=2, repeats=3)
    order = [(p, r) for _, p, r in backend.calls]
    assert order[:4] == [("native", 2), ("rail", 2), ("perm", 2), ("joint", 2)]  # warm-ups, discarded
    assert [p for p, _ in order[4:]] == ["native", "rail", "perm", "joint",
                                         "rail", "perm", "joint", "native",
                                         "perm", "joint", "native", "rail"]
    assert {p: len(v) for p, v in samples.items()} == {p: 3 for p in ALL_PATHS}


def test_summarize_uses_linear_percentiles():
    # 1..10: p10 = 1 + 0.9 = 1.9, median 5.5, p90 = 1 + 8.1 = 9.1.
    lat = summarize([float(v) for v in range(10, 0, -1)])
    assert (lat.p10, lat.median, lat.p90, lat.samples) == pytest.approx((1.9, 5.5, 9.1, 10))


def _lat(med: float, lo: float, hi: float) -> PathLatency:
    return PathLatency(median=med, p10=lo, p90=hi, samples=10)


@pytest.mark.parametrize(("rail", "joint", "kept", "reason"), [
    (_lat(9.0, 8.9, 9.1), _lat(10.0, 9.9, 10.1), True, "kept"),         # 1 - 9.1 / 9.9 = 8.1%
    (_lat(9.0, 9.0, 9.41), _lat(10.0, 9.9, 10.1), False, "gain"),       # 1 - 9.41 / 9.9 = 4.9%
    (_lat(5.0, 4.0, 8.0), _lat(10.0, 9.9, 10.1), False, "not repeatable"),  # RAIL's p90/p10 = 2.0
    (_lat(5.0, 4.9, 5.1), _lat(10.0, 6.0, 12.0), False, "not repeatable"),  # JOINT's p90/p10 = 2.0
    (_lat(11.0, 10.9, 11.1), _lat(10.0, 9.9, 10.1), False, "JOINT is fastest"),
])
def test_keep_anchor_rule(rail, joint, kept, reason):
    slow = _lat(20.0, 19.9, 20.1)
    latency = {Path.NATIVE: slow, Path.RAIL: rail, Path.PERM: slow, Path.JOINT: joint}
    best, got_kept, gain, why = keep_anchor(latency)
    assert got_kept == kept and reason in why
    if kept:
        assert best == Path.RAIL and gain == pytest.approx(1 - rail.p90 / joint.p10)


def test_keep_anchor_conservative_boundary_is_inclusive():
    latency = {p: _lat(20.0, 19.9, 20.1) for p in ALL_PATHS}
    latency[Path.JOINT] = _lat(10.0, 10.0, 10.0)
    latency[Path.PERM] = _lat(9.5, 9.5, 9.5)  # exactly 5% below JOINT's p10
    assert keep_anchor(latency, min_gain=0.05 - 1e-12)[1]


def test_calibrate_keeps_only_winners_over_joint(calibrated, requests):
    rows, aset = calibrated.rows, calibrated.anchor_set
    assert len(rows) == len(requests)
    kept = [r for r in rows if r.kept]
    assert kept, "the fake model makes RAIL win at small payloads with skewed rails"
    assert [a.name for a in aset.anchors] == [r.request for r in kept]
    for a in aset.anchors:
        assert a.path != Path.JOINT
        lat = a.latency_s
        assert set(lat) == set(ALL_PATHS)
        assert lat[a.path].p90 <= 0.95 * lat[Path.JOINT].p10
    for r in rows:
        if not r.kept:
            assert r.reason  # every dropped request says why
    ctx = aset.context
    assert (ctx.backend, ctx.hidden_size, ctx.dtype) == ("fake", 4096, "bf16")
    assert ctx.topology == TOPO.to_dict() and ctx.settings["requests"] == SETTINGS


def test_calibrate_drops_unrepeatable_measurements(requests):
    noisy = FakeBackend(TOPO, noise=1.0, seed=1)
    result = calibrate(noisy, requests[:4], TOPO, hidden_size=4096, dtype="bf16", warmups=0, repeats=6,
                       progress=False)
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
    assert s["num_switches"] == len(calibrated.anchor_set.anchors)
    assert s["num_switches"] + s["num_fallback_joint"] == len(requests)
    assert s["worst_ratio_to_best"] >= 1.0


def test_validation_requests_are_not_calibration_requests(requests):
    unseen = validation_requests(TOPO, SETTINGS, count=7, seed=5, record_bytes=RECORD_BYTES)
    assert len(unseen) == 7
    assert not {r.name for r in unseen} & {r.name for r in requests}
    again = validation_requests(TOPO, SETTINGS, count=7, seed=5, record_bytes=RECORD_BYTES)
    assert all(torch.equal(a.records_NGN, b.records_NGN) for a, b in zip(unseen, again))


def test_requests_under_arrangements_carry_their_windows():
    settings = {**SETTINGS, "families": [0], "payload_scales": [1.0], "arrangements": ["none", "ring", "extreme"]}
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
    assert request_plan(extreme, TOPO, Path.NATIVE).schedule == extreme.windows
    assert request_plan(extreme, TOPO, Path.PERM).schedule.max_fanin() == 1


def test_make_backend_netmodel_times_each_path_with_the_flow_model(requests):
    # The backend's samples are the flow model's time of the plan the request names, per path,
    # repeated (deterministic): not a placeholder, and not the same number for every path.
    from megatron_railwave.netmodel import simulate_plan

    backend = make_backend("netmodel", TOPO)
    assert backend.name == "netmodel"
    request = requests[0]
    times = {}
    for path in ALL_PATHS:
        expected = simulate_plan(request_plan(request, TOPO, path), record_bytes=request.record_bytes)
        got = backend.measure(request, path, 3)
        assert got == [pytest.approx(expected, rel=1e-12)] * 3, path
        times[path] = got[0]
    assert expected > 0 and len(set(times.values())) > 1


def test_make_backend_unknown_name_lists_the_backends():
    with pytest.raises(ValueError, match=r"--backend 'testbed' is unknown; choose one of \['netmodel'\]"):
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
    assert main(["calibrate", "--backend", "netmodel", "--cluster", str(cluster), "--out", str(out),
                 "--families", "3", "--arrangements", "none,extreme", "--payload-scales", "1,4", "--tokens", "96",
                 "--warmups", "1", "--repeats", "2", "--no-progress", "--json", str(cal_json)]) == 0
    aset = load_anchors(out, RailTopology(num_nodes=4, gpus_per_node=2))
    cal = json.loads(cal_json.read_text())
    assert len(cal["requests"]) == 12 and len(cal["anchors"]["anchors"]) == len(aset.anchors)
    assert "kept" in capsys.readouterr().out

    val_json = tmp_path / "val.json"
    assert main(["validate", "--anchors", str(out), "--backend", "netmodel", "--requests", "5", "--seed", "3",
                 "--warmups", "0", "--repeats", "1", "--no-progress", "--bench", "--json", str(val_json)]) == 0
    data = json.loads(val_json.read_text())
    assert data["summary"]["num_requests"] == 5 and len(data["requests"]) == 5
    assert {"selected", "selected_s", "joint_s", "best_path", "best_s", "ratio_to_best"} <= set(data["requests"][0])
    assert data["bench"]["us_per_decision"] > 0
    assert "selector decision cost" in capsys.readouterr().out


def test_validate_cli_errors(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--anchors", str(tmp_path / "nope.yaml"), "--bench"])
    assert exc.value.code != 0
    with pytest.raises(SystemExit) as exc:  # argparse: not a choice (the placeholder backends are gone)
        main(["calibrate", "--backend", "testbed", "--cluster", "h800_4x8", "--out", str(tmp_path / "a.yaml")])
    assert exc.value.code == 2
