"""Trace files: bit-exact round trips, clear errors for wrong versions, damage and topologies."""

import json
import zipfile

import numpy as np
import pytest
import torch

from megatron_railwave.telemetry.capture import (
    LayerTrace,
    Trace,
    TraceFormatError,
    TraceMeta,
    read_trace,
    write_trace,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

TOPO = RailTopology(num_nodes=2, gpus_per_node=2, name="two-by-two")


def _meta(num_experts=8, topk=3, topo=TOPO):
    return TraceMeta(
        model="tiny",
        topology=topo,
        num_experts=num_experts,
        topk=topk,
        hidden_size=64,
        dtype="bf16",
        step=12,
        extra={"note": "test"},
    )


def _ids(seed, num_experts=8, topk=3, tokens=10, sort=True):
    rng = np.random.default_rng(seed)
    ids = np.stack(
        [
            np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(tokens)])
            for _ in range(TOPO.world_size)
        ]
    )
    return np.sort(ids, axis=-1) if sort else ids


def _roundtrip(tmp_path, layers, meta):
    path = write_trace(tmp_path / "t.npz", layers, meta)
    return read_trace(path, expect_topology=meta.topology)


def test_trace_roundtrip_bit_exact_sorted_and_unsorted(tmp_path):
    sorted_ids = _ids(0)
    sorted_ids[1, 2, 1:] = -1  # fewer experts than K: -1 slots last (delta encoding)
    unsorted = _ids(1, sort=False)
    unsorted[0, 0, 0] = -1  # -1 first: raw encoding
    layers = [
        LayerTrace(layer=3, topk_ids_WTK=sorted_ids),
        LayerTrace(layer=7, topk_ids_WTK=torch.tensor(unsorted)),
    ]
    back = _roundtrip(tmp_path, layers, _meta())
    assert back.layer_ids == (3, 7)
    for a, b in zip(layers, back.layers):
        assert b.topk_ids_WTK.dtype == np.int16
        assert np.array_equal(a.topk_ids_WTK, b.topk_ids_WTK)
    assert back.meta.to_dict() == _meta().to_dict()
    with zipfile.ZipFile(tmp_path / "t.npz") as zf:
        header = json.loads(np.load(zf.open("header.npy")).tobytes())
    assert header["encoding"] == {"layer_3": "delta", "layer_7": "raw"}


def test_trace_roundtrip_many_experts_uses_int16(tmp_path):
    ids = _ids(2, num_experts=300, topk=4)
    back = _roundtrip(
        tmp_path, [LayerTrace(layer=1, topk_ids_WTK=ids)], _meta(num_experts=300, topk=4)
    )
    assert np.array_equal(back.layers[0].topk_ids_WTK, ids)


def test_trace_demand_matches_routing_maps():
    trace = Trace(meta=_meta(), layers=(LayerTrace(layer=5, topk_ids_WTK=_ids(3)),))
    ref = DemandCounts.from_routing_maps(trace.routing_maps(5), TOPO)
    got = trace.demand(5)
    assert torch.equal(got.records_WNM, ref.records_WNM) and torch.equal(
        got.experts_WE, ref.experts_WE
    )
    with pytest.raises(ValueError, match=r"layer 6 is not in the trace; recorded layers: \[5\]"):
        trace.demand(6)


def test_trace_rejects_wrong_shape_and_ids():
    with pytest.raises(ValueError, match=r"expected \[W=4, T, K=3\]"):
        Trace(
            meta=_meta(), layers=(LayerTrace(layer=1, topk_ids_WTK=np.zeros((2, 5, 3), np.int16)),)
        )
    with pytest.raises(ValueError, match=r"expert id 8 >= num_experts=8"):
        Trace(meta=_meta(), layers=(LayerTrace(layer=1, topk_ids_WTK=np.full((4, 5, 3), 8)),))


def _rewrite_header(path, **changes):
    with np.load(path) as data:
        entries = {k: data[k] for k in data.files}
    header = json.loads(entries["header"].tobytes())
    header.update(changes)
    entries["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez_compressed(path, **entries)


def test_read_trace_wrong_version_names_both(tmp_path):
    path = write_trace(tmp_path / "t.npz", [LayerTrace(layer=1, topk_ids_WTK=_ids(0))], _meta())
    _rewrite_header(path, version=99)
    msg = r"format version 99, but this megatron_railwave reads version 1"
    with pytest.raises(TraceFormatError, match=msg):
        read_trace(path)


def test_read_trace_malformed_files(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(TraceFormatError, match=r"not a railwave trace \(not an .npz archive"):
        read_trace(bad)
    np.savez_compressed(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceFormatError, match=r"has no 'header' entry"):
        read_trace(tmp_path / "other.npz")
    path = write_trace(tmp_path / "t.npz", [LayerTrace(layer=1, topk_ids_WTK=_ids(0))], _meta())
    _rewrite_header(path, layers=[1, 2])
    with pytest.raises(TraceFormatError, match=r"lists layer 2 but entry 'layer_2' is missing"):
        read_trace(path)
    _rewrite_header(path, layers=[1], meta={"model": "x"})
    with pytest.raises(TraceFormatError, match=r"malformed header \(KeyError"):
        read_trace(path)
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes((tmp_path / "other.npz").read_bytes()[:40])
    with pytest.raises(TraceFormatError, match=r"not a railwave trace"):
        read_trace(truncated)
    with pytest.raises(ValueError, match=r"does not exist"):
        read_trace(tmp_path / "missing.npz")


def test_read_trace_topology_mismatch_names_both(tmp_path):
    path = write_trace(tmp_path / "t.npz", [LayerTrace(layer=1, topk_ids_WTK=_ids(0))], _meta())
    other = RailTopology(num_nodes=4, gpus_per_node=1, name="four-by-one")
    both = r"'two-by-two' \(2 nodes x 2 GPUs.*'four-by-one' \(4 nodes x 1 GPUs"
    with pytest.raises(ValueError, match=both):
        read_trace(path, expect_topology=other)
    # Same layout, other link speeds: fine unless strict.
    faster = RailTopology(num_nodes=2, gpus_per_node=2, rail_gbps=200.0, name="h20")
    assert read_trace(path, expect_topology=faster).layer_ids == (1,)
    with pytest.raises(ValueError, match=r"differing: rail_gbps: 400.0 vs 200.0"):
        read_trace(path, expect_topology=faster, strict_topology=True)
