"""The RAIL / JOINT path model: the estimate from the gathered counts (the same on every rank as
from the full demand; hand-worked cases), the fit, the file field, the selector and its place in
the tuning."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.exchange import (
    RankContext,
    VirtualCluster,
    gather_demand,
    virtual_rank_groups,
)
from megatron_railwave.lab import calibration
from megatron_railwave.lab.bench.virtual_exchange import VirtualSpec, make_virtual_inputs
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions
from megatron_railwave.selector import (
    FixedSelector,
    ModelSelector,
    needs_delivery,
    needs_descriptors,
    select_for_layer,
    selector_from_config,
)
from megatron_railwave.selector.anchors import (
    AnchorSet,
    CalibrationContext,
    PathLatency,
    load_anchors,
    save_anchors,
)
from megatron_railwave.selector.path_model import (
    FEATURE_NAMES,
    PathCosts,
    RailJointModel,
    fit_rail_joint,
    path_estimates,
    path_features,
)
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, TrafficStats

F = len(FEATURE_NAMES)


def _gathered(spec: VirtualSpec):
    inputs = make_virtual_inputs(spec)
    topo, w = spec.topology, spec.topology.world_size
    ctxs = [
        RankContext(
            topo=topo,
            groups=virtual_rank_groups(topo, r),
            num_experts=spec.experts,
            options=PlanOptions(),
        )
        for r in range(w)
    ]
    layers = VirtualCluster(world_size=w).run(
        [
            gather_demand(
                ctxs[r],
                inputs["hidden"][r],
                inputs["probs"][r],
                inputs["routing"][r],
                delivery_counts=True,
            )
            for r in range(w)
        ]
    )
    return layers, DemandCounts.from_routing_maps(inputs["routing"], topo)


@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=4, gpus_per_node=2),
        RailTopology(num_nodes=3, gpus_per_node=3, failed_rails=frozenset({(1, 2)})),
    ],
    ids=["4x2", "3x3-failed-rail"],
)
def test_features_from_the_count_exchange_equal_the_full_demand_s_on_every_rank(topo):
    spec = VirtualSpec(
        topology=topo, tokens=40, hidden=8, experts=2 * topo.world_size, topk=3, seed=11
    )
    layers, full = _gathered(spec)
    costs = PathCosts(chunks=2)
    want = path_features(full, topo, record_bytes=16, costs=costs)
    assert want.shape == (F,) and np.isfinite(want).all() and want[1] != 0
    for layer in layers:
        assert torch.equal(layer.demand.delivery_WNKG, full.class_copies_WNKG())
        got = path_features(layer.demand, topo, record_bytes=16, costs=costs)
        assert np.array_equal(got, want)  # bitwise: every rank decides the same


def test_node_view_without_delivery_counts_names_the_fix():
    spec = VirtualSpec(
        topology=RailTopology(num_nodes=2, gpus_per_node=2),
        tokens=8,
        hidden=8,
        experts=8,
        topk=2,
        seed=1,
    )
    inputs = make_virtual_inputs(spec)
    topo = spec.topology
    ctxs = [
        RankContext(
            topo=topo, groups=virtual_rank_groups(topo, r), num_experts=8, options=PlanOptions()
        )
        for r in range(4)
    ]
    layers = VirtualCluster(world_size=4).run(
        [
            gather_demand(ctxs[r], inputs["hidden"][r], inputs["probs"][r], inputs["routing"][r])
            for r in range(4)
        ]
    )
    assert layers[0].demand.delivery_WNKG is None
    with pytest.raises(ValueError, match="delivery_counts=True"):
        path_features(layers[0].demand, topo, record_bytes=16)


def _three_node_demand(name: str) -> DemandCounts:
    """3 nodes x 2 GPUs, 10 records from every rank to every other node, one target GPU each, no
    local records. "one": every copy into a node lands on its GPU 0. "split": the two source
    nodes of a node target different GPUs."""
    wnm = torch.zeros(6, 3, 4, dtype=torch.int64)
    for r in range(6):
        s = r // 2
        for d in range(3):
            if d != s:
                gpu = 0 if name == "one" else sorted(set(range(3)) - {d}).index(s)
                wnm[r, d, 1 << gpu] = 10
    return DemandCounts(records_WNM=wnm)


@pytest.mark.parametrize("chunks", [1, 2])
def test_estimate_hand_worked_delivery_stretch(chunks):
    # Every pair's 20 records sit 10 per GPU: no relay; no local round. Per rail RAIL sends 20
    # records (two pairs at once), each JOINT wave 10. Every owner keeps its 10 on its own rail,
    # so the copies from GPU 0's owner stay on their target and GPU 1's cross. "one": RAIL's round
    # puts 40 copies on GPU 0 (20 on the wire), each wave 20 (10). "split": RAIL's round gives
    # each GPU 20 (10), each wave still puts 20 (10) on one GPU: JOINT pays the delivery twice.
    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    costs = PathCosts(rail_phase_s=30e-6, layer_s=35e-6, chunks=chunks)
    b = 8
    rail = b / topo.rail_bytes_per_s  # seconds per record on a rail
    nvl = b / topo.nvlink_bytes_per_s

    def pipeline(phases, f=30e-6):
        r = d = 0.0
        for rail_s, delivery_s in phases:
            r += f + rail_s
            d = max(r, d) + delivery_s
        return d

    for name, rail_round in (("one", 20), ("split", 10)):
        est_rail, est_joint = path_estimates(
            _three_node_demand(name), topo, record_bytes=b, costs=costs
        )
        want_rail = 35e-6 + 2 * pipeline([(20 * rail, rail_round * nvl)])
        want_joint = 35e-6 + 2 * pipeline([(10 * rail / chunks, 10 * nvl / chunks)] * (2 * chunks))
        assert est_rail == pytest.approx(want_rail, rel=1e-12)
        assert est_joint == pytest.approx(want_joint, rel=1e-12)
        f = path_features(_three_node_demand(name), topo, record_bytes=b, costs=costs)
        assert f[0] == 1.0
        assert f[FEATURE_NAMES.index("log_estimate_v4")] == pytest.approx(
            np.log(want_rail / want_joint)
        )


def test_estimate_charges_the_relay_and_the_local_round_before_the_first_rail_phase():
    # 2 nodes x 2 GPUs. GPU (0, 0) owns 20 records for node 1 (target GPU 0 there) and 10 for its
    # own node (target GPU 1); GPU (0, 1) owns none. The pair's even share is 10 per rail: 10 are
    # relayed out of (0, 0) (its higher masks: all the same here) and arrive on (1, 1), whose 10
    # copies cross to (1, 0); the 10 kept ones arrive on their target. Its local round sends 10
    # copies to (0, 1), all on the wire: its out-port carries 10 + 10 before rail phase 0 may
    # start; in combine the relay back (10) comes after the last rail phase. Both paths pay both.
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    wnm = torch.zeros(4, 2, 4, dtype=torch.int64)
    wnm[0, 1, 0b01] = 20
    wnm[0, 0, 0b10] = 10
    costs = PathCosts(rail_phase_s=0.0, layer_s=0.0, chunks=1)
    b = 8
    nvl = b / topo.nvlink_bytes_per_s
    est_rail, est_joint = path_estimates(
        DemandCounts(records_WNM=wnm), topo, record_bytes=b, costs=costs
    )
    # One pair, one wave: RAIL and JOINT are the same here; rail 10 per rail, delivery 10.
    bandwidth = 2 * (10 * b / topo.rail_bytes_per_s + 10 * nvl)
    assert est_rail == est_joint == pytest.approx(20 * nvl + 10 * nvl + bandwidth, rel=1e-12)


@pytest.mark.parametrize("local_records", [12, 100])
def test_estimate_charges_combine_s_local_round_on_the_delivery_round_s_gpu_ports(local_records):
    # 2 nodes x 2 GPUs. Node 0 sends 10 records from each GPU to node 1, all for GPU (1, 1): no
    # relay, 10 per rail; the 10 arriving on (1, 0) cross to (1, 1). GPU (1, 0) has
    # `local_records` for its own node's GPU 1: all cross NVLink from (1, 0) to (1, 1), on the
    # same two ports as the round. Dispatch: the local round before rail phase 0, then rail 10,
    # then delivery 10. Combine: the round back starts with the local round back on both ports
    # and is slowed by three quarters of the overlap; then the rail back; the local round back
    # finishes alone.
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    wnm = torch.zeros(4, 2, 4, dtype=torch.int64)
    wnm[0, 1, 0b10] = 10
    wnm[1, 1, 0b10] = 10
    wnm[2, 1, 0b10] = local_records
    b = 8
    nvl, rail = b / topo.nvlink_bytes_per_s, b / topo.rail_bytes_per_s
    local = local_records
    est_rail, est_joint = path_estimates(
        DemandCounts(records_WNM=wnm),
        topo,
        record_bytes=b,
        costs=PathCosts(rail_phase_s=0.0, layer_s=0.0, chunks=1),
    )
    round_back = 10 + 0.75 * min(10, local)
    left = local - 0.75 * min(10, local)
    combine = max(round_back * nvl + 10 * rail, (round_back + left) * nvl)
    assert (
        est_rail
        == est_joint
        == pytest.approx(local * nvl + 10 * rail + 10 * nvl + combine, rel=1e-12)
    )
    if local_records == 100:  # the local round back outlasts the rail back
        assert combine == pytest.approx(110 * nvl)


def test_fit_recovers_linear_coefficients_per_input_kind():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, F))
    windows = np.where(np.arange(200) < 120, 1, 3)
    beta_one, beta_many = rng.normal(size=F), rng.normal(size=F)
    y = np.where(windows == 1, x @ beta_one, x @ beta_many)
    model = fit_rail_joint(x, windows, y)
    assert np.allclose(model.all_pairs, beta_one) and np.allclose(model.windowed, beta_many)
    assert model.log_ratio(x[0], input_windows=1) == pytest.approx(y[0])
    # Too few windowed requests: no windowed coefficients (those inputs run the fallback).
    few = fit_rail_joint(x[: 120 + F - 1], windows[: 120 + F - 1], y[: 120 + F - 1])
    assert few.windowed is None and few.log_ratio(x[0], input_windows=3) is None
    assert fit_rail_joint(x[120:], windows[120:], y[120:]) is None  # no all-pairs requests


@pytest.mark.parametrize("owner", [0, 1])
def test_estimate_spreads_over_healthy_rails_only(owner):
    # 2 nodes x 2 GPUs, rail 1 failed on node 1: the pair (0, 1) has one rail, GPU 0's. GPU
    # (0, owner) owns 20 records for node 1 (target GPU 0 there). On the healthy rail they need no
    # relay; on the failed one all 20 go to GPU 0 first (and come back in combine). Either way the
    # one rail carries 20 and they all arrive on (1, 0), their target: no delivery on NVLink.
    topo = RailTopology(num_nodes=2, gpus_per_node=2, failed_rails=frozenset({(1, 1)}))
    wnm = torch.zeros(4, 2, 4, dtype=torch.int64)
    wnm[owner, 1, 0b01] = 20
    b = 8
    nvl = b / topo.nvlink_bytes_per_s
    est_rail, est_joint = path_estimates(
        DemandCounts(records_WNM=wnm),
        topo,
        record_bytes=b,
        costs=PathCosts(rail_phase_s=0.0, layer_s=0.0, chunks=1),
    )
    relay = 20 * nvl if owner == 1 else 0.0
    assert (
        est_rail
        == est_joint
        == pytest.approx(2 * relay + 2 * 20 * b / topo.rail_bytes_per_s, rel=1e-12)
    )


def test_model_dict_round_trip_and_errors_name_the_field():
    model = RailJointModel(
        all_pairs=tuple(float(i) for i in range(F)),
        windowed=None,
        costs=PathCosts(rail_phase_s=1e-5, layer_s=2e-5, chunks=3),
    )
    assert RailJointModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="field 'costs'"):
        RailJointModel.from_dict({k: v for k, v in model.to_dict().items() if k != "costs"})
    with pytest.raises(ValueError, match=r"field 'costs'.*chunks"):
        RailJointModel.from_dict(
            {**model.to_dict(), "costs": {"rail_phase_s": 0.0, "layer_s": 0.0, "chunks": 0}}
        )
    with pytest.raises(ValueError, match="field 'features'"):
        RailJointModel.from_dict({**model.to_dict(), "features": ["x"]})
    with pytest.raises(ValueError, match="field 'all_pairs'"):
        RailJointModel.from_dict({**model.to_dict(), "all_pairs": [1.0] * (F - 1)})
    with pytest.raises(ValueError, match="field 'windowed'"):
        RailJointModel.from_dict({**model.to_dict(), "windowed": ["a"] * F})
    # The payload gates: optional (older files have none), numbers of bytes >= 0, one per input
    # kind.
    gated = dataclasses.replace(model, max_payload_bytes=12.5 * 2**20)
    assert (
        RailJointModel.from_dict(gated.to_dict()) == gated
        and "max_payload_bytes" not in model.to_dict()
    )
    assert gated.decides(12.5 * 2**20, input_windows=1) and not gated.decides(
        13 * 2**20, input_windows=1
    )
    assert gated.decides(1e12, input_windows=3)
    per_kind = dataclasses.replace(gated, max_payload_bytes_windowed=3.0 * 2**20)
    assert RailJointModel.from_dict(per_kind.to_dict()) == per_kind
    assert not per_kind.decides(4 * 2**20, input_windows=3) and per_kind.decides(
        4 * 2**20, input_windows=1
    )
    # A file from before the gates per kind (max_payload_bytes alone) gates every input kind with
    # it.
    old_file = {k: v for k, v in gated.to_dict().items() if k != "max_payload_bytes_windowed"}
    assert RailJointModel.from_dict(old_file).max_payload_bytes_windowed == 12.5 * 2**20
    for field in ("max_payload_bytes", "max_payload_bytes_windowed"):
        for bad in (-1.0, float("inf"), "12", True):
            with pytest.raises(ValueError, match=rf"field '{field}': RailJointModel\.{field} must"):
                RailJointModel.from_dict({**model.to_dict(), field: bad})
        with pytest.raises(ValueError, match=rf"RailJointModel\.{field} must"):
            dataclasses.replace(model, **{field: -2.0})
    # An older file with a bad gate: the error names its own field, not the one it would fill.
    with pytest.raises(
        ValueError, match=r"field 'max_payload_bytes': RailJointModel\.max_payload_bytes must"
    ):
        RailJointModel.from_dict({**old_file, "max_payload_bytes": -1.0})


def test_the_payload_gate_runs_joint_above_it_without_an_estimate(monkeypatch):
    import megatron_railwave.selector.policies as selector_module

    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    spec = VirtualSpec(topology=topo, tokens=40, hidden=8, experts=16, topk=3, seed=5)
    _, full = _gathered(spec)
    records_NGN = full.records_NGN()
    remote = int(records_NGN.sum() - torch.diagonal(records_NGN, dim1=0, dim2=2).sum())
    payload = remote * 16 / topo.world_size  # B_mean at 16 bytes per record
    assert demand_stats(full, topo, record_bytes=16).B_mean_bytes == pytest.approx(payload)
    rail_model = _sign_model(
        1.0 if path_features(full, topo, record_bytes=16)[1] < 0 else -1.0
    )  # predicts RAIL
    inside = ModelSelector(dataclasses.replace(rail_model, max_payload_bytes=payload), topo)
    assert (
        select_for_layer(inside, None, full, record_bytes=16) == Route.RAIL
    )  # at the gate: decided
    above = ModelSelector(dataclasses.replace(rail_model, max_payload_bytes=payload * 0.999), topo)

    def no_estimate(*args, **kwargs):
        raise AssertionError("the estimate ran above the payload gate")

    monkeypatch.setattr(selector_module, "path_features", no_estimate)
    assert select_for_layer(above, None, full, record_bytes=16) == Route.JOINT
    assert (
        above.explain_layer(demand_stats(full, topo, record_bytes=16), full, record_bytes=16).anchor
        == "gate"
    )
    # The gate of the input's kind: windowed inputs take max_payload_bytes_windowed.
    from megatron_railwave.planner import cyclic_schedule

    per_kind = ModelSelector(
        dataclasses.replace(
            rail_model,
            windowed=rail_model.all_pairs,
            max_payload_bytes=payload,
            max_payload_bytes_windowed=payload * 0.999,
        ),
        topo,
    )
    stats = demand_stats(full, topo, record_bytes=16)
    assert (
        per_kind.explain_layer(stats, full, record_bytes=16, windows=cyclic_schedule(4)).anchor
        == "gate"
    )
    assert (
        select_for_layer(per_kind, None, full, record_bytes=16, windows=cyclic_schedule(4))
        == Route.JOINT
    )


def test_payload_gate_is_a_margin_over_the_largest_payload_where_joint_misses():
    payload = np.array([1.0, 5.0, 3.0, 9.0, 2.0])
    slow = np.array([True, False, True, False, False])
    assert calibration.payload_gate(payload, slow) == pytest.approx(
        calibration.PAYLOAD_GATE_MARGIN * 3.0
    )
    assert calibration.payload_gate(payload, slow, margin=1.0) == 3.0
    assert calibration.payload_gate(payload, np.zeros(5, dtype=bool)) == 0.0  # JOINT everywhere


def _sign_model(sign: float) -> RailJointModel:
    """Predicts sign x log_estimate: RAIL where that is negative (sign 1)."""
    coef = [0.0] * F
    coef[FEATURE_NAMES.index("log_estimate_v4")] = sign
    return RailJointModel(all_pairs=tuple(coef), windowed=None)


def test_model_selector_follows_the_prediction_and_is_pure():
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    spec = VirtualSpec(topology=topo, tokens=40, hidden=8, experts=16, topk=3, seed=5)
    _, full = _gathered(spec)
    st = demand_stats(full, topo, record_bytes=16)
    d = path_features(full, topo, record_bytes=16)[FEATURE_NAMES.index("log_estimate_v4")]
    assert d != 0
    for sign in (1.0, -1.0):
        sel = ModelSelector(_sign_model(sign), topo)
        want = Route.RAIL if sign * d < 0 else Route.JOINT
        assert needs_delivery(sel)
        assert select_for_layer(sel, st, full, record_bytes=16) == want
        assert {sel.select_layer(st, full, record_bytes=16) for _ in range(3)} == {want}
    # No windowed coefficients: an arranged input runs the fallback; no remote payload too.
    from megatron_railwave.planner import cyclic_schedule

    sel = ModelSelector(_sign_model(1.0), topo)
    assert (
        sel.explain_layer(st, full, record_bytes=16, windows=cyclic_schedule(4)).path == Route.JOINT
    )
    # The model reads the counts, not the descriptors: none are needed (the dispatcher skips them).
    assert not needs_descriptors(sel) and not needs_descriptors(FixedSelector(Route.RAIL))
    assert select_for_layer(sel, None, full, record_bytes=16) == sel.select_layer(
        st, full, record_bytes=16
    )
    assert select_for_layer(FixedSelector(Route.RAIL), None, full, record_bytes=16) == Route.RAIL
    # Only local records (every node keeps its own): no remote payload, no prediction.
    node_of_rank = torch.arange(topo.world_size) // topo.gpus_per_node
    remote = node_of_rank[:, None] != torch.arange(topo.num_nodes)[None, :]
    local_only = full.records_WNM.masked_fill(remote[:, :, None], 0)
    local = DemandCounts(records_WNM=local_only)
    assert sel.explain_layer(st, local, record_bytes=16).anchor is None
    assert select_for_layer(sel, None, local, record_bytes=16) == Route.JOINT


def _model_rows(seeds: int = 4, per_seed: int = 30):
    """Rows whose RAIL / JOINT ratio is exp(0.5 x log_estimate - 0.2): RAIL faster below 0.4, a rule
    no single payload cut of the anchors finds, but the model learns from the other seeds."""
    rng = np.random.default_rng(3)
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    ref, rho_s, kappa_s = AnchorSet.scales_for(topo)
    rows = []
    for s in range(seeds):
        for i in range(per_seed):
            f = rng.normal(size=F)
            f[0] = 1.0
            ratio = float(np.exp(0.5 * f[1] - 0.2))
            lat = {
                p: PathLatency(median=1.0, p10=1.0, p90=1.0, samples=1)
                for p in calibration.ALL_PATHS
            }
            lat[Route.RAIL] = PathLatency(median=ratio, p10=ratio, p90=ratio, samples=1)
            lat[Route.NATIVE] = lat[Route.PERM] = PathLatency(
                median=9.0, p10=9.0, p90=9.0, samples=1
            )
            st = TrafficStats(
                B_mean_bytes=ref,
                B_max_bytes=ref,
                rho_g=1.0,
                kappa=1.0,
                coords=(0.0, 0.0, 0.0),
                records_total=1,
                remote_records=1,
            )
            rows.append(
                calibration.CalibrationRow(
                    request=f"glm{s}-l{i}",
                    stats=st,
                    coords=st.coords,
                    latency=lat,
                    best=Route.RAIL if ratio < 1 else Route.JOINT,
                    kept=False,
                    gain=0.0,
                    reason="joint wins",
                    group=f"glm{s}-l{i}",
                    seed=f"glm{s}",
                    features=tuple(float(v) for v in f),
                )
            )
    ctx = CalibrationContext(
        topology=topo.to_dict(), hidden_size=1, dtype="bf16", backend="fake", date="x"
    )
    return calibration.CalibrationResult(
        anchor_set=AnchorSet(anchors=(), scales=(ref, rho_s, kappa_s), context=ctx),
        rows=tuple(rows),
    ), topo


def test_tune_selector_records_the_model_when_it_beats_the_anchors(tmp_path):
    result, topo = _model_rows()
    tuned = calibration.tune_selector(result, split_fallback=False)
    model_score = tuned["model_score"]
    assert model_score["model"] is True and model_score["over_tolerance"] == 0
    assert tuned["scores"][0]["over_tolerance"] > 0  # always-JOINT misses the RAIL rows
    assert tuned["model"] is not None and "path model" in tuned["method"]
    coef = tuned["model"]["all_pairs"]
    assert coef[FEATURE_NAMES.index("log_estimate_v4")] == pytest.approx(0.5) and coef[
        0
    ] == pytest.approx(-0.2)
    # Every row has the same payload and some miss with JOINT: a gate would let the model decide
    # them all, so it gains nothing and none is recorded (the first of tied gatings).
    assert tuned["model_score"]["gate"] == "none" and "max_payload_bytes" not in tuned["model"]
    assert [sc["gate"] for sc in tuned["scores"] if sc.get("model")] == list(
        calibration.PAYLOAD_GATINGS
    )
    # Written to the file, loaded back, and the runtime decides with it.
    from megatron_railwave.lab.calibration import with_selector_settings

    path = tmp_path / "a.yaml"
    save_anchors(with_selector_settings(result.anchor_set, tuned), path)
    loaded = load_anchors(path, topo)
    assert loaded.path_model == RailJointModel.from_dict(tuned["model"])
    sel = selector_from_config(RailWaveConfig(path="auto", anchors=str(path)), topo)
    assert isinstance(sel, ModelSelector)
    # Not recorded when fit_model is off, nor without features on every row.
    assert calibration.tune_selector(result, split_fallback=False, fit_model=False)["model"] is None
    bare = calibration.CalibrationResult(
        anchor_set=result.anchor_set,
        rows=(dataclasses.replace(result.rows[0], features=None), *result.rows[1:]),
    )
    assert not any(
        sc.get("model") for sc in calibration.tune_selector(bare, split_fallback=False)["scores"]
    )


def _with_big_rows(
    result,
    *,
    payload: float,
    rail_s: float,
    windows: int = 1,
    seeds: int = 4,
    per_seed: int = 10,
    prefix: str = "big",
):
    """``result`` plus rows at ``payload`` whose RAIL takes ``rail_s`` against JOINT's 1.0, with the
    features the rows' law gives that ratio (the model predicts them right)."""
    rows = list(result.rows)
    lat = dict(rows[0].latency)
    lat[Route.JOINT] = PathLatency(median=1.0, p10=1.0, p90=1.0, samples=1)
    lat[Route.RAIL] = PathLatency(median=rail_s, p10=rail_s, p90=rail_s, samples=1)
    features = (1.0, 2 * (math.log(rail_s) + 0.2)) + (0.0,) * (F - 2)
    for s in range(seeds):
        for i in range(per_seed):
            rows.append(
                dataclasses.replace(
                    rows[0],
                    request=f"{prefix}{s}-{i}",
                    group=f"{prefix}{s}-{i}",
                    seed=f"glm{s}",
                    input_windows=windows,
                    stats=dataclasses.replace(rows[0].stats, B_mean_bytes=payload),
                    latency=lat,
                    best=Route.RAIL if rail_s < 1 else Route.JOINT,
                    features=features,
                )
            )
    return dataclasses.replace(result, rows=tuple(rows))


def test_tune_selector_keeps_a_payload_gate_only_where_it_loses_nothing_leaving_seeds_out():
    result, _ = _model_rows()
    ref = result.anchor_set.scales[0]
    tune = functools.partial(calibration.tune_selector, split_fallback=False)
    # Large layers where JOINT wins (RAIL 2% slower) and the model says so: a gate at 1.5 x ref
    # (JOINT misses only at ref) runs them as JOINT without a decision, at the same score.
    joint_wins = tune(_with_big_rows(result, payload=4 * ref, rail_s=1.02))
    gate = joint_wins["model"]["max_payload_bytes"]
    assert joint_wins["model_score"]["gate"] == "one" and gate == pytest.approx(
        calibration.PAYLOAD_GATE_MARGIN * ref
    )
    assert (
        joint_wins["model"]["max_payload_bytes_windowed"] == gate
        and "JOINT above" in joint_wins["method"]
    )
    by_gate = {sc["gate"]: sc for sc in joint_wins["scores"] if sc.get("model")}
    assert by_gate["none"]["total_s"] == pytest.approx(by_gate["one"]["total_s"])
    assert by_gate["one"]["decided"] == by_gate["none"]["decided"] - 40
    # Large layers where RAIL is 1% faster (JOINT within tolerance): the gate would cost 40 x 0.01,
    # so no gate.
    rail_wins = tune(_with_big_rows(result, payload=4 * ref, rail_s=0.99))
    assert (
        rail_wins["model_score"]["gate"] == "none" and "max_payload_bytes" not in rail_wins["model"]
    )
    by_gate = {sc["gate"]: sc for sc in rail_wins["scores"] if sc.get("model")}
    assert by_gate["one"]["total_s"] == pytest.approx(by_gate["none"]["total_s"] + 40 * 0.01)


def test_tune_selector_fits_a_gate_per_input_kind_where_that_saves_decisions():
    result, _ = _model_rows()
    ref = result.anchor_set.scales[0]
    # Windowed inputs where JOINT misses at 3 x ref (RAIL 10% faster) and all-pairs inputs at 2 x
    # ref where JOINT wins: one gate (4.5 x ref) decides the latter, a gate per kind (1.5 x ref for
    # all pairs) runs them as JOINT at the same score.
    rows = _with_big_rows(result, payload=3 * ref, rail_s=0.9, windows=3, prefix="win")
    tuned = calibration.tune_selector(
        _with_big_rows(rows, payload=2 * ref, rail_s=1.02), split_fallback=False
    )
    assert tuned["model_score"]["gate"] == "per_kind"
    assert tuned["model"]["max_payload_bytes"] == pytest.approx(
        calibration.PAYLOAD_GATE_MARGIN * ref
    )
    assert tuned["model"]["max_payload_bytes_windowed"] == pytest.approx(
        calibration.PAYLOAD_GATE_MARGIN * 3 * ref
    )
    assert "gates per input kind" in tuned["method"]
    model = RailJointModel.from_dict(tuned["model"])
    assert model.decides(1.5 * ref, input_windows=1) and not model.decides(2 * ref, input_windows=1)
    assert model.decides(4 * ref, input_windows=3) and not model.decides(5 * ref, input_windows=3)


def test_the_model_is_scored_with_the_gate_it_would_have_without_the_left_out_seed():
    result, _ = _model_rows()
    ref = result.anchor_set.scales[0]
    rows = list(result.rows)
    # Only seed 0 has large layers, and there JOINT misses by 10% while the features say RAIL: left
    # out, the other seeds' gate (1.5 x ref) sends them to JOINT and they count as over.
    lat = dict(rows[0].latency)
    lat[Route.JOINT] = PathLatency(median=1.0, p10=1.0, p90=1.0, samples=1)
    lat[Route.RAIL] = PathLatency(median=0.9, p10=0.9, p90=0.9, samples=1)
    features = (1.0, 2 * (math.log(0.9) + 0.2)) + (0.0,) * (
        F - 2
    )  # on the rows' own law: RAIL 10% faster
    for i in range(6):
        rows.append(
            dataclasses.replace(
                rows[0],
                request=f"big-{i}",
                group=f"big-{i}",
                seed="glm0",
                latency=lat,
                best=Route.RAIL,
                features=features,
                stats=dataclasses.replace(rows[0].stats, B_mean_bytes=4 * ref),
            )
        )
    tuned = calibration.tune_selector(
        dataclasses.replace(result, rows=tuple(rows)), split_fallback=False
    )
    by_gate = {sc["gate"]: sc for sc in tuned["scores"] if sc.get("model")}
    assert by_gate["one"]["over_tolerance"] == 6 and by_gate["none"]["over_tolerance"] == 0
    # So the gate is not kept: without it the model decides the large layers right.
    assert tuned["model_score"]["gate"] == "none" and "max_payload_bytes" not in tuned["model"]


def test_a_malformed_model_in_the_anchors_file_is_rejected_naming_the_field(tmp_path):
    import yaml

    result, topo = _model_rows(seeds=2, per_seed=20)
    from megatron_railwave.lab.calibration import with_selector_settings

    tuned = calibration.tune_selector(result, split_fallback=False)
    path = tmp_path / "a.yaml"
    save_anchors(with_selector_settings(result.anchor_set, tuned), path)
    data = yaml.safe_load(path.read_text())
    good = data["context"]["settings"]["selector"]["model"]
    data["context"]["settings"]["selector"]["model"] = {**good, "all_pairs": [1.0]}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"context\.settings\.selector\.model.*field 'all_pairs'"):
        load_anchors(path, topo)
    # Costs computed for other rail chunks than the file's JOINT: the estimate would be another one.
    data["context"]["settings"]["selector"]["model"] = {
        **good,
        "costs": {**good["costs"], "chunks": 2},
    }
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ValueError, match=r"context\.settings\.selector\.model\.costs\.chunks.*chunks=1"
    ):
        load_anchors(path, topo)


def test_validate_decides_with_the_model_and_rescore_compares_the_anchor_rule_on_the_same_medians():
    from megatron_railwave.selector import AnchorSelector
    from tests.unit.test_calibration import RECORD_BYTES, SETTINGS, TOPO, FakeBackend

    requests = calibration.calibration_requests(TOPO, SETTINGS, record_bytes=RECORD_BYTES)[:6]
    backend = FakeBackend(TOPO)
    model_sel = ModelSelector(_sign_model(1.0), TOPO)
    result = calibration.validate(
        backend, model_sel, requests, TOPO, warmups=0, repeats=1, progress=False
    )
    for req, row in zip(requests, result.rows):
        assert row.selected == model_sel.select_layer(
            calibration.request_stats(req, TOPO),
            req.demand,
            record_bytes=req.record_bytes,
            windows=req.windows,
        )
        assert row.anchor in ("model", None)
    calls = len(backend.calls)
    empty = AnchorSet(
        anchors=(),
        scales=AnchorSet.scales_for(TOPO),
        context=CalibrationContext(
            topology=TOPO.to_dict(), hidden_size=1, dtype="bf16", backend="fake", date="x"
        ),
    )
    other = calibration.rescore(result, AnchorSelector(empty), requests, TOPO, scales=empty.scales)
    assert len(backend.calls) == calls  # nothing measured again
    assert [r.median_s for r in other.rows] == [r.median_s for r in result.rows]
    assert {r.selected for r in other.rows} == {Route.JOINT}  # no anchors: the fallback everywhere


@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=4, gpus_per_node=4),
        RailTopology(num_nodes=5, gpus_per_node=3, failed_rails=frozenset({(1, 2), (3, 0)})),
    ],
    ids=["4x4", "5x3-failed-rails"],
)
def test_rail_windows_equal_to_the_cyclic_waves_give_a_zero_log_estimate(topo):
    # RAIL's phases come from the window masks, JOINT's from the cyclic fast path: on an input
    # whose windows ARE the cyclic waves both must see the same loads, bitwise.
    from megatron_railwave.planner import cyclic_schedule

    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        demand = DemandCounts(
            records_WNM=torch.randint(
                0, 30, (topo.world_size, topo.num_nodes, 1 << topo.gpus_per_node), generator=gen
            )
        )
        windows = cyclic_schedule(topo.num_nodes)
        f = path_features(demand, topo, record_bytes=64, windows=windows, costs=PathCosts(chunks=1))
        assert f[FEATURE_NAMES.index("log_estimate_v4")] == 0.0


def test_model_selector_refuses_the_descriptors_only_call():
    sel = ModelSelector(_sign_model(1.0), RailTopology(num_nodes=2, gpus_per_node=2))
    with pytest.raises(TypeError, match="select_for_layer"):
        sel.select(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", ["out of the expert GPU", "into the arrival GPU"])
@pytest.mark.parametrize(("local", "want"), [(4.0, 9.0), (10.0, 14.0)])
def test_combine_rounds_share_ports_with_the_local_round_until_it_is_done(local, want, port):
    # One node, 2 GPUs, two rounds back, each followed by a 1 s rail phase. Round 0: GPU 0 has 2 s
    # beside the local round (slowed by three quarters of the overlap: 3.5 s), GPU 1 6 s alone:
    # the round ends at 6 and GPU 0's local round runs alone from 3.5 to 6. local = 4: done by
    # then (4 - 1.5 - 2.5 = 0), so round 1 takes its busiest GPU's 2 s: 8, rail back 8 .. 9.
    # local = 10: 6 s left, round 1 on GPU 0 ends at 6 + 2 + 1.5 = 9.5 and the local round's
    # last 4.5 s end the combine at 14. The same on either port of the GPU.
    from megatron_railwave.selector.path_model import _combine_seconds, _Rounds

    loaded, idle = np.array([[[2.0, 6.0]], [[2.0, 0.0]]]), np.zeros((2, 1, 2))
    local_NG, none_NG = np.array([[local, 0.0]]), np.zeros((1, 2))
    if (
        port == "out of the expert GPU"
    ):  # dispatch's in-port of the target: round into it, local into it
        rounds = _Rounds(
            rail_P=np.array([1.0, 1.0]),
            into_PNG=loaded,
            out_PNG=idle,
            busiest_P=np.array([6.0, 2.0]),
        )
        got = _combine_seconds(rounds, none_NG, local_NG, 0.0, 0.0)
    else:  # dispatch's out-port of the arrival / source GPU
        rounds = _Rounds(
            rail_P=np.array([1.0, 1.0]),
            into_PNG=idle,
            out_PNG=loaded,
            busiest_P=np.array([6.0, 2.0]),
        )
        got = _combine_seconds(rounds, local_NG, none_NG, 0.0, 0.0)
    assert got == pytest.approx(want, rel=1e-12)


def test_estimate_charges_a_source_gpu_s_local_copies_on_its_own_port():
    # 2 nodes x 4 GPUs, no remote records. GPU (0, 0) has 10 records for its own node, each for
    # GPUs 1, 2 and 3: 30 copies leave its port (10 enter each target's). Dispatch's local round
    # and combine's local round back each take 30 copies' time on (0, 0); both paths the same.
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    wnm = torch.zeros(8, 2, 16, dtype=torch.int64)
    wnm[0, 0, 0b1110] = 10
    b = 8
    nvl = b / topo.nvlink_bytes_per_s
    est_rail, est_joint = path_estimates(
        DemandCounts(records_WNM=wnm),
        topo,
        record_bytes=b,
        costs=PathCosts(rail_phase_s=0.0, layer_s=0.0, chunks=2),
    )
    assert est_rail == est_joint == pytest.approx(60 * nvl, rel=1e-12)


def test_a_single_node_has_no_rail_phases():
    topo = RailTopology(num_nodes=1, gpus_per_node=4)
    wnm = torch.zeros(4, 1, 16, dtype=torch.int64)
    wnm[0, 0, 0b0110] = 5
    nvl = 8 / topo.nvlink_bytes_per_s
    est = path_estimates(
        DemandCounts(records_WNM=wnm), topo, record_bytes=8, costs=PathCosts(layer_s=1e-6, chunks=2)
    )
    assert est == pytest.approx((1e-6 + 20 * nvl, 1e-6 + 20 * nvl), rel=1e-12)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=3, gpus_per_node=4),
        RailTopology(num_nodes=4, gpus_per_node=3, failed_rails=frozenset({(2, 1)})),
    ],
    ids=["3x4", "4x3-failed-rail"],
)
def test_rounds_and_local_round_match_the_compiled_schedule_s_ports(topo, chunks):
    # Equal counts on every non-empty subset of each owner's target set (independent bits, the
    # arrival model exact): each round's wire copies into every target and out of every arrival
    # GPU, its busiest port, and the local round's ports equal the compiled schedule's transfers.
    from megatron_railwave.names import Route
    from megatron_railwave.selector.path_model import _Loads, class_copies_NGNKG
    from tests.helpers.delivery_cases import dispatch_deliveries, subset_demand

    n, g, b = topo.num_nodes, topo.gpus_per_node, 8
    nvl = b / topo.nvlink_bytes_per_s
    rng = np.random.default_rng(5)
    for _ in range(3):
        demand = subset_demand(topo, rng)
        loads = _Loads.of(
            demand.records_NGN().double().numpy(),
            class_copies_NGNKG(demand),
            record_bytes=b,
            topo=topo,
            chunks=chunks,
        )
        local_out, local_in = loads.local_round()
        for path, rounds in (
            (Route.RAIL, loads.windows((1.0 - np.eye(n))[None])),
            (Route.JOINT, loads.cyclic()),
        ):
            for step, src, dst, rows in dispatch_deliveries(demand, topo, path, chunks)[1]:
                moves = src != dst
                into = np.bincount(dst[moves], rows[moves], n * g).reshape(n, g) * nvl
                out = np.bincount(src[moves], rows[moves], n * g).reshape(n, g) * nvl
                if step == 0:
                    assert local_in == pytest.approx(
                        into, abs=1e-15
                    ) and local_out == pytest.approx(out, abs=1e-15)
                    continue
                v = step - 1
                assert rounds.into_PNG[v] == pytest.approx(into, abs=1e-15), (path, step)
                assert rounds.out_PNG[v] == pytest.approx(out, abs=1e-15), (path, step)
                assert rounds.busiest_P[v] == pytest.approx(max(into.max(), out.max()), abs=1e-15)


def test_score_path_model_fits_without_the_left_out_seed_and_gates_like_the_runtime():
    rng = np.random.default_rng(0)
    # Seed s0: 100 rows where RAIL is 40% faster; seeds s1, s2: 10 rows each where JOINT is 10%
    # faster. Left out, each seed is decided by a fit on the others, so it is decided wrong.
    units = np.array(["s0"] * 100 + ["s1"] * 10 + ["s2"] * 10, dtype=object)
    target = np.where(units == "s0", -0.5, 0.1)
    features = np.stack([np.ones(120), rng.normal(size=120)], axis=1)
    joint, rail = np.ones(120), np.exp(target)
    limit = calibration.MAX_RATIO_TO_BEST * np.minimum(rail, joint)
    windows, payload = np.ones(120, dtype=int), np.full(120, 1e6)
    score = calibration.score_path_model(
        features,
        windows,
        target,
        payload,
        units,
        rail,
        joint,
        limit,
        costs=PathCosts(),
        gating="none",
    )
    assert score == {
        "over_tolerance": 120,
        "total_s": pytest.approx(100.0 + 20 * math.exp(0.1)),
        "decided": 120,
    }
    # A gate from the other seeds' misses: s1 / s2 left out see s0's misses (JOINT 40% slower at
    # 1 MB) and decide; s0 left out sees none (gate 0) and runs JOINT without a decision.
    gated = calibration.score_path_model(
        features,
        windows,
        target,
        payload,
        units,
        rail,
        joint,
        limit,
        costs=PathCosts(),
        gating="one",
    )
    assert gated["decided"] == 20 and gated["over_tolerance"] == 120
    # A row without a finite target teaches nothing but is still decided and scored.
    target_nan = target.copy()
    target_nan[0] = np.nan
    assert (
        calibration.score_path_model(
            features,
            windows,
            target_nan,
            payload,
            units,
            rail,
            joint,
            limit,
            costs=PathCosts(),
            gating="none",
        )["decided"]
        == 120
    )
    with pytest.raises(ValueError, match="gating must be one of"):
        calibration.payload_gates(payload, joint > limit, windows == 1, gating="two")
    # The choice: fewest over, then least total, then fewest decided, then PAYLOAD_GATINGS' order.
    scores = {
        "none": {"over_tolerance": 1, "total_s": 1.0, "decided": 9},
        "one": {"over_tolerance": 1, "total_s": 1.0, "decided": 5},
        "per_kind": {"over_tolerance": 1, "total_s": 1.0, "decided": 5},
    }
    assert calibration.choose_gating(scores) == "one"
    assert (
        calibration.choose_gating({**scores, "none": {**scores["none"], "total_s": 0.5}}) == "none"
    )
    assert (
        calibration.choose_gating(
            {**scores, "per_kind": {**scores["per_kind"], "over_tolerance": 0}}
        )
        == "per_kind"
    )


def test_validate_names_the_payload_gates_per_input_kind():
    from megatron_railwave.commands.validate import _describe_gates

    model = RailJointModel(all_pairs=(0.0,) * F)
    mib = 2**20
    assert _describe_gates(model) == ""
    assert (
        _describe_gates(
            dataclasses.replace(model, max_payload_bytes=mib, max_payload_bytes_windowed=mib)
        )
        == ", payload gate 1.00 MiB"
    )
    assert (
        _describe_gates(
            dataclasses.replace(model, max_payload_bytes=mib, max_payload_bytes_windowed=3 * mib)
        )
        == ", payload gates all pairs 1.00 MiB, windowed 3.00 MiB"
    )
    assert (
        _describe_gates(dataclasses.replace(model, max_payload_bytes_windowed=3 * mib))
        == ", payload gates all pairs none, windowed 3.00 MiB"
    )
