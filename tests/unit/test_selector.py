"""AnchorSelector: the paper's reuse rule worked out by hand, purity, rank agreement, config
wiring."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import Route
from megatron_railwave.selector import (
    AnchorSelector,
    FixedSelector,
    fallback_phases_of,
    posts_fewer_phases,
    selector_from_config,
)
from megatron_railwave.selector import policies as selector_mod
from megatron_railwave.selector.anchors import (
    Anchor,
    AnchorSet,
    CalibrationContext,
    PathLatency,
    load_anchors,
    save_anchors,
)
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, MiB, TrafficStats, local_demand

TOPO = RailTopology(num_nodes=4, gpus_per_node=8)
REF = 56 * MiB  # scales on 4 x 8: payload 56 MiB, rho (R - 1) = 7, kappa (N - 2) = 2
LAT = {p: PathLatency(median=1e-3, p10=1e-3, p90=1e-3, samples=3) for p in Route}


def anchor(name: str, coords: tuple[float, float, float], path: Route) -> Anchor:
    return Anchor(
        name=name,
        coords=coords,
        B_mean_bytes=REF * 2 ** coords[0],
        rho_g=1 + 7 * coords[1],
        kappa=1 + 2 * coords[2],
        path=path,
        latency_s=LAT,
    )


def anchor_set(anchors: tuple[Anchor, ...], topo: RailTopology = TOPO) -> AnchorSet:
    ctx = CalibrationContext(
        topology=topo.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
    )
    return AnchorSet(anchors=anchors, scales=AnchorSet.scales_for(topo), context=ctx)


def stats(b_ratio: float, rho_coord: float, kappa_coord: float) -> TrafficStats:
    """Descriptors at log2(B / ref) = log2(b_ratio) and the given shape coordinates."""
    b = REF * b_ratio
    coords = (math.log2(b_ratio) if b_ratio > 0 else -math.inf, rho_coord, kappa_coord)
    return TrafficStats(
        B_mean_bytes=b,
        B_max_bytes=b,
        rho_g=1 + 7 * rho_coord,
        kappa=1 + 2 * kappa_coord,
        coords=coords,
        records_total=0,
        remote_records=0,
    )


# Three anchors: A and C differ by 0.03 in the rho coordinate; B is 2x A's payload.
A = anchor("a", (0.0, 0.10, 0.5), Route.RAIL)
B = anchor("b", (1.0, 0.10, 0.5), Route.PERM)
C = anchor("c", (0.0, 0.13, 0.5), Route.NATIVE)
SEL = AnchorSelector(anchor_set((A, B, C)))


@pytest.mark.parametrize(
    ("descr", "expected", "why"),
    [
        (stats(1.0, 0.10, 0.5), Route.RAIL, "exactly on A"),
        (stats(1.25, 0.10, 0.5), Route.RAIL, "payload ratio 1.25 to A: still eligible"),
        (stats(1.0 / 1.25, 0.10, 0.5), Route.RAIL, "ratio 1.25 below A"),
        (stats(1.26, 0.10, 0.5), Route.JOINT, "ratio 1.26 to A, 2/1.26 = 1.59 to B: none eligible"),
        (stats(2.0 * 1.2, 0.10, 0.5), Route.PERM, "ratio 1.2 to B"),
        (stats(1.0, 0.119, 0.5), Route.NATIVE, "A at 0.019, C at 0.011: both eligible, C nearer"),
        (stats(1.0, 0.114, 0.5), Route.RAIL, "A at 0.014, C at 0.016: A nearer"),
        (stats(1.0, 0.085, 0.5), Route.RAIL, "A at 0.015, C at 0.045: only A"),
        (stats(1.0, 0.10, 0.53), Route.JOINT, "kappa 0.03 away from every anchor"),
        (
            stats(0.5, 0.10, 0.5),
            Route.RAIL,
            "2x below A: RAIL (1 phase < JOINT's 3) is eligible at any smaller payload",
        ),
        (stats(1.0 / 64, 0.10, 0.5), Route.RAIL, "64x below A: still A"),
        (stats(1.0 / 64, 0.12, 0.5), Route.NATIVE, "64x below A and C, C nearer in rho"),
        (
            stats(0.5, 0.16, 0.5),
            Route.JOINT,
            "below A and C, but rho 0.03 from C: the shape window still holds",
        ),
        (
            stats(1.5, 0.10, 0.5),
            Route.JOINT,
            "1.5x above A (never extended upward), 1.33x below B (PERM: not extended)",
        ),
        (stats(1.0, 0.10, 0.48), Route.RAIL, "kappa 0.02 below A: boundary is eligible"),
        (stats(0.0, 0.10, 0.5), Route.JOINT, "no remote payload: log2(0) = -inf"),
    ],
)
def test_anchor_selector_rule_by_hand(descr, expected, why):
    assert SEL.select(descr) == expected, why


def test_extension_below_applies_only_to_paths_with_fewer_phases_than_joint():
    # The paper's two-sided window when switched off: 2x below A is nobody's.
    assert (
        AnchorSelector(anchor_set((A, B, C)), extend_below=False).select(stats(0.5, 0.10, 0.5))
        == Route.JOINT
    )
    # PERM posts JOINT's N - 1 waves: its window stays two-sided.
    perm = AnchorSelector(anchor_set((B,)))
    assert perm.select(stats(2.0 / 1.25, 0.10, 0.5)) == Route.PERM
    assert perm.select(stats(2.0 / 1.3, 0.10, 0.5)) == Route.JOINT
    # RAIL on an arranged input with N - 1 = 3 windows posts 3 phases, as many as JOINT: not
    # extended.
    arranged = Anchor(
        name="w3",
        coords=A.coords,
        B_mean_bytes=A.B_mean_bytes,
        rho_g=A.rho_g,
        kappa=A.kappa,
        path=Route.RAIL,
        latency_s=LAT,
        input_windows=3,
    )
    sel = AnchorSelector(anchor_set((arranged,)))
    assert sel.explain(stats(1.0 / 1.25, 0.10, 0.5), input_windows=3).path == Route.RAIL
    assert sel.explain(stats(0.5, 0.10, 0.5), input_windows=3).path == Route.JOINT
    # On 2 nodes JOINT has one wave, as many phases as RAIL: not extended (4 x 8's scales kept, so
    # only the node count recorded in the file differs).
    two = RailTopology(num_nodes=2, gpus_per_node=8)
    ctx = CalibrationContext(
        topology=two.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
    )
    on_two = AnchorSelector(AnchorSet(anchors=(A,), scales=AnchorSet.scales_for(TOPO), context=ctx))
    assert on_two.select(stats(1.0 / 1.25, 0.10, 0.5)) == Route.RAIL
    assert on_two.select(stats(0.5, 0.10, 0.5)) == Route.JOINT
    # The distance still counts the whole payload gap (nearest wins among the extended anchors).
    assert SEL.explain(stats(0.25, 0.10, 0.5)).distance == pytest.approx(2.0)


def test_anchor_selector_matches_the_number_of_input_windows():
    # Same descriptors, different sending windows: an all-pairs anchor (1 window) never decides
    # for an arranged input (3 windows) and the reverse; the default is a training step's 1.
    arranged = Anchor(
        name="w3",
        coords=A.coords,
        B_mean_bytes=A.B_mean_bytes,
        rho_g=A.rho_g,
        kappa=A.kappa,
        path=Route.PERM,
        latency_s=LAT,
        input_windows=3,
    )
    sel = AnchorSelector(anchor_set((A, arranged)))
    on_a = stats(1.0, 0.10, 0.5)
    assert sel.select(on_a) == Route.RAIL
    assert sel.explain(on_a, input_windows=1).anchor == "a"
    assert sel.explain(on_a, input_windows=3).anchor == "w3"
    assert sel.explain(on_a, input_windows=2).path == Route.JOINT
    with pytest.raises(ValueError, match="input_windows must be an integer >= 1"):
        Anchor(
            name="bad",
            coords=A.coords,
            B_mean_bytes=1.0,
            rho_g=1.0,
            kappa=1.0,
            path=Route.RAIL,
            input_windows=0,
        )


def test_anchor_selector_thresholds_are_configurable():
    wide = AnchorSelector(anchor_set((A, B, C)), payload_ratio=2.0, shape_distance=0.05)
    assert wide.select(stats(1.0, 0.10, 0.53)) == Route.RAIL  # kappa 0.03 < 0.05
    # 1.6x A: log2 1.6 = 0.678 from A, log2(2 / 1.6) = 0.322 from B: both within log2 2 = 1, B
    # nearer.
    assert wide.select(stats(1.6, 0.10, 0.5)) == Route.PERM
    strict = AnchorSelector(anchor_set((A,)), payload_ratio=1.0, shape_distance=0.0)
    assert strict.select(stats(1.0, 0.10, 0.5)) == Route.RAIL
    assert strict.select(stats(1.01, 0.10, 0.5)) == Route.JOINT
    with pytest.raises(ValueError, match="payload_ratio must be >= 1"):
        AnchorSelector(anchor_set((A,)), payload_ratio=0.9)


def test_anchor_selector_explain_names_anchor_and_distance():
    choice = SEL.explain(stats(1.0, 0.119, 0.5))
    assert (choice.path, choice.anchor) == (Route.NATIVE, "c")
    assert choice.distance == pytest.approx(0.011)
    fallback = SEL.explain(stats(3.0, 0.5, 0.5))
    assert (fallback.path, fallback.anchor, fallback.distance) == (Route.JOINT, None, math.inf)


def test_anchor_selector_without_anchors_is_always_joint():
    empty = AnchorSelector(anchor_set(()))
    assert empty.select(stats(1.0, 0.1, 0.5)) == Route.JOINT


def _reference_rule(sel: AnchorSelector, s: TrafficStats) -> Route:
    """The rule written plainly: filter eligible anchors, take the nearest (first on ties). On
    4 nodes with all-pairs inputs, NATIVE and RAIL anchors (1 phase, JOINT 3) reach any smaller
    payload."""
    x = sel.anchor_set.coords(s)
    lr = math.log2(sel.payload_ratio) + 1e-12
    eligible = [
        a
        for a in sel.anchor_set.anchors
        if -lr <= x[0] - a.coords[0] <= lr
        or (x[0] - a.coords[0] < -lr and not a.path.waved)  # NATIVE, RAIL, FLOW
    ]
    eligible = [
        a
        for a in eligible
        if abs(x[1] - a.coords[1]) <= sel.shape_distance + 1e-12
        and abs(x[2] - a.coords[2]) <= sel.shape_distance + 1e-12
    ]
    if not eligible:
        return Route.JOINT
    return min(eligible, key=lambda a: sum((u - v) ** 2 for u, v in zip(x, a.coords))).path


_coord = st.floats(min_value=-0.2, max_value=0.4, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(
    queries=st.lists(
        st.tuples(st.floats(min_value=0.05, max_value=1.5), _coord, _coord), min_size=1, max_size=8
    ),
    points=st.lists(
        st.tuples(
            st.floats(min_value=-0.3, max_value=0.3), _coord, _coord, st.sampled_from(list(Route))
        ),
        max_size=6,
    ),
)
def test_anchor_selector_is_pure_and_matches_reference(queries, points):
    sel = AnchorSelector(
        anchor_set(tuple(anchor(f"p{i}", (x, y, z), p) for i, (x, y, z, p) in enumerate(points))),
        shape_distance=0.1,
    )
    descrs = [stats(*q) for q in queries]
    first = [sel.select(d) for d in descrs]
    # Same input, same output, whatever was asked in between (no state between calls).
    again = [sel.select(d) for d in reversed(descrs)][::-1]
    assert first == again == [_reference_rule(sel, d) for d in descrs]


def test_anchor_selector_keeps_no_mutable_state():
    assert not hasattr(SEL, "__dict__")  # slots only
    before = (SEL.anchor_set, SEL.payload_ratio, SEL.shape_distance, SEL.fallback)
    for _ in range(3):
        SEL.select(stats(1.0, 0.119, 0.5))
    assert (SEL.anchor_set, SEL.payload_ratio, SEL.shape_distance, SEL.fallback) == before


def test_ranks_agree_although_local_traffic_differs():
    # 2 nodes x 4 GPUs, 16 experts (2 per rank), top-2; each rank has its own locality, so the
    # ranks' local demands differ, but every rank selects from the same gathered counts.
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    maps = synthetic_routing_maps(topo, num_tokens=64, num_experts=16, topk=2, seed=3, locality=6.0)
    local = [local_demand(m, topo) for m in maps]
    assert any(not torch.equal(local[0][0], part[0]) for part in local[1:])
    gathered = DemandCounts(
        records_WNM=torch.stack([p[0] for p in local]),
        experts_WE=torch.stack([p[1] for p in local]),
    )
    assert torch.equal(gathered.records_WNM, DemandCounts.from_routing_maps(maps, topo).records_WNM)
    record_bytes = 4096 * 2
    descr = demand_stats(gathered, topo, record_bytes=record_bytes)
    # One anchor on the layer's point (RAIL) and one elsewhere (PERM).
    aset = anchor_set(
        (
            anchor("here", descr.coords, Route.RAIL),
            anchor("far", (descr.coords[0] + 3, 0, 0), Route.PERM),
        ),
        topo,
    )
    decisions = []
    for rank in range(topo.world_size):
        # What rank `rank` holds after the exchange's gather (node view): every rank's per-node
        # totals, but the mask histograms only of records into its own node, which differ
        # between nodes. The descriptors use the totals only.
        node = topo.node_of(rank)
        records_WNM = torch.stack([p[0] for p in local])
        counts = DemandCounts(
            records_WN=records_WNM.sum(dim=-1),
            view_node=node,
            view_masks_WM=records_WNM[:, node, :].clone(),
        )
        sel = AnchorSelector(aset)
        decisions.append(sel.select(demand_stats(counts, topo, record_bytes=record_bytes)))
    assert decisions == [Route.RAIL] * topo.world_size
    # The same rule on each rank's *local* traffic alone would not be consistent: B differs.
    local_b = {
        float(
            demand_stats(
                DemandCounts(
                    records_WNM=p[0].unsqueeze(0).expand(topo.world_size, -1, -1),
                    experts_WE=p[1].unsqueeze(0).expand(topo.world_size, -1),
                ),
                topo,
                record_bytes=record_bytes,
            ).B_mean_bytes
        )
        for p in local
    }
    assert len(local_b) > 1


# ---------------------------------------------------------------------- selector_from_config
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(selector_mod, "_WARNED", set())


def test_selector_from_config_missing_file_is_joint_with_one_logged_warning(
    tmp_path, fresh_warnings, caplog
):
    cfg = RailWaveConfig(anchors=str(tmp_path / "missing.yaml"))
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.WARNING, "megatron_railwave"),
    ):
        warnings.simplefilter("always")
        sels = [selector_from_config(cfg, TOPO) for _ in range(5)]  # e.g. five MoE layers
    assert all(
        isinstance(s, FixedSelector) and s.select(stats(1, 0, 0)) == Route.JOINT for s in sels
    )
    # Through logging, not warnings.warn (which PYTHONWARNINGS=ignore would hide).
    assert caught == []
    logged = [r for r in caplog.records if r.name.startswith("megatron_railwave")]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "missing.yaml' does not exist: every layer runs JOINT" in logged[0].getMessage()


def test_selector_from_config_warns_only_where_asked(tmp_path, fresh_warnings, caplog):
    # The dispatcher passes warn=True on global rank 0 only.
    cfg = RailWaveConfig(anchors=str(tmp_path / "missing.yaml"))
    with caplog.at_level(logging.WARNING, "megatron_railwave"):
        for _ in range(3):
            selector_from_config(cfg, TOPO, warn=False)
    assert [r for r in caplog.records if r.name.startswith("megatron_railwave")] == []


def test_selector_from_config_loads_anchors_with_config_thresholds(tmp_path, fresh_warnings):
    path = save_anchors(anchor_set((A,)), tmp_path / "a.yaml")
    cfg = RailWaveConfig(anchors=str(path), payload_ratio=1.5, shape_distance=0.05)
    sel = selector_from_config(cfg, TOPO)
    assert isinstance(sel, AnchorSelector)
    assert (sel.payload_ratio, sel.shape_distance) == (1.5, 0.05)
    assert sel.select(stats(1.4, 0.14, 0.5)) == Route.RAIL


def _tuned_set(ratio, distance):
    base = anchor_set((A,))
    ctx = CalibrationContext(
        topology=TOPO.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
        settings={"selector": {"payload_ratio": ratio, "shape_distance": distance}},
    )
    return AnchorSet(anchors=base.anchors, scales=base.scales, context=ctx)


def test_selector_from_config_takes_the_files_tuned_thresholds_unless_the_config_sets_them(
    tmp_path, fresh_warnings
):
    tuned = save_anchors(_tuned_set(1.5, 0.2), tmp_path / "tuned.yaml")
    sel = selector_from_config(RailWaveConfig(anchors=str(tuned)), TOPO)
    assert (sel.payload_ratio, sel.shape_distance) == (1.5, 0.2)
    # 1.4x A's payload and 0.15 off in kappa: only the tuned thresholds reach A.
    assert sel.select(stats(1.4, 0.10, 0.65)) == Route.RAIL
    over = selector_from_config(RailWaveConfig(anchors=str(tuned), payload_ratio=1.25), TOPO)
    assert (over.payload_ratio, over.shape_distance) == (1.25, 0.2)
    assert over.select(stats(1.4, 0.10, 0.65)) == Route.JOINT
    plain = save_anchors(anchor_set((A,)), tmp_path / "plain.yaml")  # records none: the paper's
    sel = selector_from_config(RailWaveConfig(anchors=str(plain)), TOPO)
    assert (sel.payload_ratio, sel.shape_distance) == (1.25, 0.02)


@pytest.mark.parametrize(
    ("ratio", "distance", "field"),
    [(0.8, 0.2, "payload_ratio"), (1.5, -0.1, "shape_distance"), ("wide", 0.2, "payload_ratio")],
)
def test_anchors_file_with_bad_tuned_thresholds_is_rejected(
    tmp_path, fresh_warnings, ratio, distance, field
):
    path = save_anchors(_tuned_set(ratio, distance), tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match=rf"field 'context.settings.selector.{field}'"):
        selector_from_config(RailWaveConfig(anchors=str(path)), TOPO)


def test_selector_from_config_rejects_bad_files(tmp_path, fresh_warnings):
    path = save_anchors(anchor_set((A,)), tmp_path / "a.yaml")
    with pytest.raises(ValueError, match=r"another topology: field 'context.topology.num_nodes'"):
        selector_from_config(
            RailWaveConfig(anchors=str(path)), RailTopology(num_nodes=2, gpus_per_node=8)
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("path: rail", "path: sideways"))
    with pytest.raises(ValueError, match=r"field 'anchors\[0\].path'"):
        selector_from_config(RailWaveConfig(anchors=str(bad)), TOPO)


def _chunked_set(chunks):
    base = anchor_set((A,))
    ctx = CalibrationContext(
        topology=TOPO.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
        settings={"chunks": chunks},
    )
    return AnchorSet(anchors=base.anchors, scales=base.scales, context=ctx)


def test_selector_from_config_needs_the_rail_chunks_the_anchors_were_calibrated_with(
    tmp_path, fresh_warnings
):
    # The anchors say where a path beats JOINT with 2 rail chunks per wave; a job running whole
    # waves (or 3 chunks) would reuse boundaries of another JOINT: refused, naming both values.
    path = save_anchors(_chunked_set(2), tmp_path / "c2.yaml")
    assert load_anchors(path, TOPO).chunks == 2
    sel = selector_from_config(RailWaveConfig(anchors=str(path), chunks=2), TOPO)
    assert isinstance(sel, AnchorSelector) and sel.select(stats(1.0, 0.1, 0.5)) == Route.RAIL
    for chunks in (1, 3):
        with pytest.raises(
            ValueError,
            match=rf"calibrated with chunks=2 \(field 'context.settings.chunks'\) but "
            rf"this RailWave config has chunks={chunks}; set chunks: 2 or run "
            rf"`railwave calibrate --chunks {chunks}`",
        ):
            selector_from_config(RailWaveConfig(anchors=str(path), chunks=chunks), TOPO)
    # A file recording no chunks was calibrated with whole waves.
    plain = save_anchors(anchor_set((A,)), tmp_path / "plain.yaml")
    assert load_anchors(plain, TOPO).chunks == 1
    with pytest.raises(ValueError, match=r"calibrated with chunks=1"):
        selector_from_config(RailWaveConfig(anchors=str(plain), chunks=2), TOPO)


@pytest.mark.parametrize("chunks", [0, 65, True, "2", 1.5])
def test_anchors_file_with_bad_chunks_is_rejected(tmp_path, fresh_warnings, chunks):
    path = save_anchors(_chunked_set(chunks), tmp_path / "bad.yaml")
    with pytest.raises(
        ValueError, match=r"field 'context.settings.chunks' must be an integer in 1..64"
    ):
        load_anchors(path, TOPO)


def test_fewer_phase_rule_counts_the_chunked_joint_phases():
    # On 4 nodes JOINT posts 3 waves x chunks rail phases; an arranged input's RAIL posts 3 windows:
    # as many as whole-wave JOINT (no reach-down), fewer than JOINT with 2 chunks (reach-down).
    assert fallback_phases_of(anchor_set((A,)), Route.JOINT) == TOPO.num_nodes - 1
    assert fallback_phases_of(_chunked_set(2), Route.JOINT) == 2 * (TOPO.num_nodes - 1)
    arranged = dataclasses.replace(A, input_windows=TOPO.num_nodes - 1)
    assert not posts_fewer_phases(arranged, fallback_phases_of(anchor_set((A,)), Route.JOINT))
    assert posts_fewer_phases(arranged, fallback_phases_of(_chunked_set(2), Route.JOINT))


def test_reach_matches_the_runtime_rule():
    # reach_AR (calibration's cross-seed check) marks exactly the anchors explain may pick from:
    # a point gets an anchor iff one reaches it, and the one it gets reaches it.
    rng = np.random.default_rng(7)
    paths = [Route.RAIL, Route.NATIVE, Route.PERM]
    anchors = tuple(
        dataclasses.replace(
            anchor(
                f"a{i}",
                (float(rng.uniform(-2, 2)), float(rng.uniform(0, 0.5)), float(rng.uniform(0, 1))),
                paths[i % 3],
            ),
            input_windows=int(rng.choice([1, 3])),
        )
        for i in range(12)
    )
    sel = AnchorSelector(anchor_set(anchors), payload_ratio=1.5, shape_distance=0.15)
    points = [
        stats(float(2 ** rng.uniform(-4, 3)), float(rng.uniform(0, 0.5)), float(rng.uniform(0, 1)))
        for _ in range(400)
    ] + [stats(0.0, 0.1, 0.5)]
    windows = rng.choice([1, 3], size=len(points))
    reach = sel.reach_AR(np.array([p.coords for p in points]), windows)
    names = [a.name for a in anchors]
    assert reach.any() and not reach.all()
    for r, (p, w) in enumerate(zip(points, windows)):
        got = sel.explain(p, input_windows=int(w))
        assert (got.anchor is not None) == bool(reach[:, r].any()), r
        if got.anchor is not None:
            assert reach[names.index(got.anchor), r]


def _below_set(below):
    base = anchor_set((A,))
    ctx = CalibrationContext(
        topology=TOPO.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
        settings={"selector": {"fallback_below": below}},
    )
    return AnchorSet(anchors=base.anchors, scales=base.scales, context=ctx)


def test_selector_from_config_applies_the_files_fallback_below(tmp_path, fresh_warnings):
    # Below 1/4 of A's payload, away from A's shape: RAIL (the file's split); above it, JOINT.
    path = save_anchors(_below_set({"payload_bytes": REF / 4, "path": "rail"}), tmp_path / "b.yaml")
    sel = selector_from_config(RailWaveConfig(anchors=str(path)), TOPO)
    assert sel.fallback_below == (REF / 4, Route.RAIL)
    assert sel.select(stats(0.2, 0.9, 0.9)) == Route.RAIL
    assert sel.select(stats(0.3, 0.9, 0.9)) == Route.JOINT
    assert sel.select(stats(1.0, 0.10, 0.5)) == Route.RAIL  # A itself
    assert sel.explain(stats(0.2, 0.9, 0.9), input_windows=TOPO.num_nodes - 1).path == Route.JOINT


@pytest.mark.parametrize(
    ("below", "field"),
    [
        ({"payload_bytes": -1, "path": "rail"}, "payload_bytes"),
        ({"payload_bytes": 1e6, "path": "joint"}, "path"),
        ({"payload_bytes": 1e6, "path": "up"}, "path"),
        ({"path": "rail"}, "payload_bytes"),
    ],
)
def test_anchors_file_with_bad_fallback_below_is_rejected(tmp_path, fresh_warnings, below, field):
    path = save_anchors(_below_set(below), tmp_path / "bad.yaml")
    with pytest.raises(
        ValueError, match=rf"field 'context.settings.selector.fallback_below.{field}'"
    ):
        load_anchors(path, TOPO)


def test_the_anchor_rule_needs_the_descriptors_and_says_so():
    from megatron_railwave.selector import needs_descriptors, select_for_layer

    demand = DemandCounts(records_WN=torch.ones(4, 2, dtype=torch.int64))
    assert needs_descriptors(SEL)
    with pytest.raises(ValueError, match="AnchorSelector decides from the descriptors"):
        select_for_layer(SEL, None, demand, record_bytes=16)
    assert select_for_layer(SEL, stats(0.5, 0.10, 0.5), demand, record_bytes=16) == SEL.select(
        stats(0.5, 0.10, 0.5)
    )
