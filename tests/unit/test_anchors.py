"""Anchors file: round trip, field-naming errors for malformed files, topology check."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_railwave.names import Route
from megatron_railwave.selector.anchors import (
    ANCHORS_VERSION,
    Anchor,
    AnchorSet,
    CalibrationContext,
    PathLatency,
    anchors_from_dict,
    load_anchors,
    save_anchors,
)
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=4, gpus_per_node=8, name="h800_4x8")


def _lat(ms: float, spread: float = 1.05) -> PathLatency:
    return PathLatency(median=ms * 1e-3, p10=ms * 1e-3 / spread, p90=ms * 1e-3 * spread, samples=10)


def make_set(topo: RailTopology = TOPO, anchors: tuple[Anchor, ...] | None = None) -> AnchorSet:
    if anchors is None:
        anchors = (
            Anchor(
                name="req-1",
                coords=(0.5, 0.1, 0.9),
                B_mean_bytes=79_000_000.0,
                rho_g=1.7,
                kappa=2.8,
                path=Route.RAIL,
                latency_s={
                    Route.NATIVE: _lat(9.0),
                    Route.RAIL: _lat(4.0),
                    Route.PERM: _lat(6.0),
                    Route.JOINT: _lat(5.0),
                },
            ),
        )
    ctx = CalibrationContext(
        topology=topo.to_dict(),
        hidden_size=4096,
        dtype="bf16",
        backend="fake",
        date="2026-01-01T00:00:00+00:00",
        settings={"repeats": 10},
    )
    return AnchorSet(anchors=anchors, scales=AnchorSet.scales_for(topo), context=ctx)


def test_anchors_round_trip_keeps_every_field(tmp_path):
    aset = make_set()
    path = save_anchors(aset, tmp_path / "sub" / "anchors.yaml")
    text = path.read_text()
    assert text.startswith("format: railwave-anchors\nversion: 1\n")
    back = load_anchors(path, TOPO)
    assert back == aset
    assert back.anchors[0].latency_s[Route.RAIL].spread == pytest.approx(1.05**2)


def test_anchors_round_trip_keeps_input_windows_and_settings(tmp_path):
    # What calibrate writes: an anchor of an arranged input (3 windows) next to an all-pairs one,
    # and the provenance of the requests (validate rebuilds held-out requests from it).
    base = make_set().anchors[0]
    arranged = Anchor(
        name="req-2",
        coords=(-5.0, 0.2, 0.9),
        B_mean_bytes=1_700_000.0,
        rho_g=2.4,
        kappa=2.8,
        path=Route.PERM,
        latency_s=base.latency_s,
        input_windows=3,
    )
    settings = {
        "repeats": 1,
        "requests": {
            "workload": "glm",
            "seed": 0,
            "layers": [1, 3],
            "tokens": [128, 4096],
            "payload_scales": [1.0],
            "arrangements": ["none", "extreme"],
        },
    }
    aset = make_set(anchors=(base, arranged))
    aset = AnchorSet(
        anchors=aset.anchors,
        scales=aset.scales,
        context=CalibrationContext(**{**aset.context.to_dict(), "settings": settings}),
    )
    back = load_anchors(save_anchors(aset, tmp_path / "a.yaml"), TOPO)
    assert back == aset
    assert [a.input_windows for a in back.anchors] == [1, 3]
    assert back.context.settings["requests"]["tokens"] == [128, 4096]
    legacy = aset.to_dict()
    del legacy["anchors"][0]["input_windows"]  # files written before the field: all pairs at once
    assert anchors_from_dict(legacy, topo=TOPO).anchors[0].input_windows == 1


def test_anchors_scales_default_to_topology():
    # 4 nodes x 8 rails: rho scale R - 1 = 7, kappa scale N - 2 = 2, payload reference 56 MiB.
    assert make_set().scales == (56.0 * 2**20, 7.0, 2.0)


def test_anchors_empty_list_is_valid(tmp_path):
    path = save_anchors(make_set(anchors=()), tmp_path / "a.yaml")
    assert load_anchors(path, TOPO).anchors == ()


def _mutate(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("format", "something-else", r"field 'format' must be 'railwave-anchors'"),
        ("version", 99, r"field 'version' must be 1"),
        ("context", KeyError, r"field 'context' must be a mapping"),
        ("context.hidden_size", "4096", r"field 'context.hidden_size' must be a positive integer"),
        ("context.backend", None, r"field 'context.backend' must be a string"),
        ("scales.rho_scale", 0, r"field 'scales.rho_scale' must be > 0"),
        ("anchors", {"a": 1}, r"field 'anchors' must be a list"),
        (
            "anchors.0.coords",
            [1.0, 2.0],
            r"field 'anchors\[0\].coords' must be a list of 3 finite numbers",
        ),
        (
            "anchors.0.path",
            "fastest",
            r"field 'anchors\[0\].path' must be one of native, rail, perm, joint",
        ),
        ("anchors.0.path", KeyError, r"field 'anchors\[0\].path' is missing"),
        ("anchors.0.rho_g", "high", r"field 'anchors\[0\].rho_g' must be a number"),
        ("anchors.0.B_mean_bytes", -1.0, r"field 'anchors\[0\].B_mean_bytes' must be > 0"),
        (
            "anchors.0.latency_s.perm",
            KeyError,
            r"field 'anchors\[0\].latency_s' lacks the path\(s\) \['perm'\]",
        ),
        (
            "anchors.0.latency_s.rail.p90",
            "x",
            r"field 'anchors\[0\].latency_s.rail.p90' must be a number",
        ),
        (
            "anchors.0.latency_s.rail.p10",
            1.0,
            r"field 'anchors\[0\].latency_s.rail' need 0 <= p10 <= median",
        ),
        (
            "anchors.0.latency_s.rail.samples",
            0,
            r"field 'anchors\[0\].latency_s.rail.samples' must be a positive",
        ),
        (
            "anchors.0.input_windows",
            0,
            r"field 'anchors\[0\].input_windows' must be an integer >= 1, got 0",
        ),
        (
            "anchors.0.input_windows",
            "3",
            r"field 'anchors\[0\].input_windows' must be an integer >= 1",
        ),
    ],
)
def test_anchors_malformed_field_is_named(field, value, message):
    data = _mutate(make_set().to_dict(), field, value)
    with pytest.raises(ValueError, match=message):
        anchors_from_dict(data, source="'x.yaml'", topo=TOPO)


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (RailTopology(num_nodes=2, gpus_per_node=8), "num_nodes"),
        (RailTopology(num_nodes=4, gpus_per_node=8, rail_gbps=200.0), "rail_gbps"),
        (
            RailTopology(num_nodes=4, gpus_per_node=8, failed_rails=frozenset({(1, 3)})),
            "failed_rails",
        ),
    ],
)
def test_anchors_for_another_topology_are_rejected(tmp_path, other, field):
    path = save_anchors(make_set(), tmp_path / "a.yaml")
    with pytest.raises(ValueError, match=rf"another topology: field 'context.topology.{field}'"):
        load_anchors(path, other)


def test_anchors_topology_name_may_differ(tmp_path):
    path = save_anchors(make_set(), tmp_path / "a.yaml")
    renamed = RailTopology(num_nodes=4, gpus_per_node=8, name="4x8")
    assert len(load_anchors(path, renamed).anchors) == 1


def test_anchors_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_anchors(bad, TOPO)
    with pytest.raises(FileNotFoundError):
        load_anchors(tmp_path / "missing.yaml", TOPO)


def test_anchors_version_constant_matches_written_files(tmp_path):
    path = save_anchors(make_set(), tmp_path / "a.yaml")
    assert yaml.safe_load(path.read_text())["version"] == ANCHORS_VERSION


@pytest.mark.parametrize("name", ["h800_4x8", "h20_4x8", "h800_4x8_c2", "h20_4x8_c2"])
def test_shipped_anchors_files_load_for_their_cluster_and_chunks(name):
    # Every packaged anchors file (megatron_railwave/configs/anchors) loads for the preset it names
    # and gives a selector with the rail chunks it records (the _c2 files: 2 chunks per wave; the
    # others whole waves); every file's tuning chose the path model over the anchors.
    from pathlib import Path

    from megatron_railwave.config import RailWaveConfig
    from megatron_railwave.selector import ModelSelector, selector_from_config
    from megatron_railwave.topology import load_topology

    repo = Path(__file__).resolve().parents[2]
    path = repo / "megatron_railwave" / "configs" / "anchors" / f"{name}.yaml"
    topo = load_topology(name.removesuffix("_c2"))
    aset = load_anchors(path, topo)
    assert aset.chunks == (2 if name.endswith("_c2") else 1)
    sel = selector_from_config(
        RailWaveConfig(path="auto", anchors=str(path), chunks=aset.chunks), topo
    )
    assert (
        isinstance(sel, ModelSelector)
        and sel.model == aset.path_model
        and sel.model.windowed is not None
    )
    assert sel.model.costs.chunks == aset.chunks
    # The anchor rule's anchors stay in the file for `validate --rule anchors`; the H800 whole-wave
    # tuning kept none (no anchor setting beat always-JOINT leaving seeds out).
    assert bool(aset.anchors) == (name != "h800_4x8")
    assert sorted(p.name.removesuffix(".yaml") for p in path.parent.glob("*.yaml")) == sorted(
        ["h800_4x8", "h20_4x8", "h800_4x8_c2", "h20_4x8_c2"]
    )


@pytest.mark.parametrize("name", ["h800_4x8", "h20_4x8", "h800_4x8_c2", "h20_4x8_c2"])
def test_shipped_files_coefficients_come_from_their_kept_rows(name):
    # megatron_railwave/configs/anchors/rows holds each file's calibration rows (RAIL / JOINT
    # seconds, features of this version's estimate): least squares on them gives the file's
    # coefficients, and a few rows' features are this code's, so a change of the estimate that is
    # not refitted (scripts/selector_refit.py, in git history at 7438618: configs/anchors/README.md)
    # fails here.
    import gzip
    import json
    from pathlib import Path

    import numpy as np

    from megatron_railwave.lab import calibration
    from megatron_railwave.selector.path_model import fit_rail_joint, path_features
    from megatron_railwave.topology import load_topology
    from megatron_railwave.traffic import dtype_bytes

    anchors = Path(__file__).resolve().parents[2] / "megatron_railwave" / "configs" / "anchors"
    model = load_anchors(anchors / f"{name}.yaml", None).path_model
    with gzip.open(anchors / "rows" / f"{name}.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    refit = fit_rail_joint(
        np.array([r["features"] for r in rows]),
        np.array([r["windows"] for r in rows]),
        np.log(np.array([r["rail_s"] for r in rows]) / np.array([r["joint_s"] for r in rows])),
        costs=model.costs,
    )
    assert np.allclose(refit.all_pairs, model.all_pairs, rtol=1e-9, atol=1e-12)
    assert np.allclose(refit.windowed, model.windowed, rtol=1e-9, atol=1e-12)
    aset = load_anchors(anchors / f"{name}.yaml", None)
    topo = load_topology(name.removesuffix("_c2"))
    record_bytes = aset.context.hidden_size * dtype_bytes(aset.context.dtype)
    small = [r for r in rows if r["T"] <= 256]
    assert small[0]["windows"] == 1 and small[-1]["windows"] > 1
    for row in (small[0], small[-1]):  # all pairs at once, then an arrangement's windows
        arrangement = row["name"].split("-")[4]
        (request,) = calibration.glm_requests(
            topo,
            layers=[row["layer"]],
            step=0,
            seed=row["seed"],
            payload_scales=[1.0],
            record_bytes=record_bytes,
            tokens=[row["T"]],
            arrangements=[arrangement],
        )
        assert request.name == row["name"]
        got = path_features(
            request.demand,
            topo,
            record_bytes=request.record_bytes,
            windows=request.windows,
            costs=model.costs,
        )
        assert np.allclose(got, row["features"], rtol=1e-12, atol=0), row["name"]
