"""TraceRecorder: capture interval, first call per (step, layer, rank) wins, per-rank parts
merge."""

import numpy as np
import pytest
import torch

from megatron_railwave.telemetry.capture import (
    TraceFormatError,
    TraceMeta,
    TraceRecorder,
    merge_captures,
    read_trace,
    routing_map_from_topk_ids,
    step_dir,
)
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=2, gpus_per_node=2)
E, K = 8, 2


def _meta():
    return TraceMeta(model="tiny", topology=TOPO, num_experts=E, topk=K, hidden_size=32)


def _ids(seed, tokens=6):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])
    return np.sort(ids, axis=1).astype(np.int16)


def test_recorder_interval_and_start_step(tmp_path):
    rec = TraceRecorder(tmp_path, 5, TOPO, _meta(), start_step=3)
    assert [s for s in range(20) if rec.should_capture(s)] == [3, 8, 13, 18]
    assert rec.record(4, 1, 0, _ids(0)) is False
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"interval_steps must be a positive integer, got 0"):
        TraceRecorder(tmp_path, 0, TOPO, _meta())


def test_recorder_merge_roundtrip_maps_and_ids(tmp_path):
    # Ranks 0 and 2 report routing maps, 1 and 3 top-k ids (unsorted, one -1 slot); rank 3 has
    # fewer tokens and is padded with -1 rows in the merged trace.
    rec = TraceRecorder(tmp_path, 2, TOPO, _meta())
    expect = {}
    for step in (0, 1, 2):
        for layer in (1, 2):
            for rank in range(4):
                ids = _ids(100 * step + 10 * layer + rank, tokens=4 if rank == 3 else 6)
                if rank == 1:
                    ids = ids[:, ::-1].copy()
                    ids[0, 0] = -1
                routing = (
                    routing_map_from_topk_ids(ids, E) if rank % 2 == 0 else torch.from_numpy(ids)
                )
                recorded = rec.record(step, layer, rank, routing)
                assert recorded == (step % 2 == 0)
                expect[step, layer, rank] = ids
    # A second micro-batch (or a recomputation) of the same layer is ignored.
    assert rec.record(2, 1, 0, routing_map_from_topk_ids(_ids(999), E)) is False
    rec.close()
    assert sorted(p.name for p in step_dir(tmp_path, 0).iterdir()) == [
        f"rank{r:05d}.npz" for r in range(4)
    ]
    paths = merge_captures(tmp_path)
    assert [p.name for p in paths] == ["trace_step000000000.npz", "trace_step000000002.npz"]
    for path, step in zip(paths, (0, 2)):
        trace = read_trace(path, expect_topology=TOPO)
        assert trace.meta.step == step and trace.layer_ids == (1, 2)
        assert trace.meta.extra["capture_interval_steps"] == 2
        for layer in (1, 2):
            ids_WTK = trace.layer(layer).topk_ids_WTK
            assert ids_WTK.shape == (4, 6, K)
            for rank in range(4):
                want = np.sort(
                    np.where(expect[step, layer, rank] < 0, E, expect[step, layer, rank]), axis=1
                )
                want = np.where(want == E, -1, want)
                got = ids_WTK[rank]
                assert np.array_equal(got[: want.shape[0]], want)
                assert (got[want.shape[0] :] == -1).all()
    # read_trace assembles a step directory directly.
    direct = read_trace(step_dir(tmp_path, 2))
    assert np.array_equal(direct.layer(2).topk_ids_WTK, read_trace(paths[1]).layer(2).topk_ids_WTK)


def test_recorder_layers_per_step_writes_early(tmp_path):
    rec = TraceRecorder(tmp_path, 1, TOPO, _meta(), layers_per_step=2)
    rec.record(0, 1, 3, _ids(0))
    part = step_dir(tmp_path, 0) / "rank00003.npz"
    assert not part.exists()
    rec.record(0, 2, 3, _ids(1))
    assert part.exists()
    assert rec.record(0, 2, 3, _ids(2)) is False  # already written


def test_merge_reports_missing_ranks_or_skips(tmp_path):
    with TraceRecorder(tmp_path, 1, TOPO, _meta()) as rec:
        for rank in (0, 1, 3):
            rec.record(0, 1, rank, _ids(rank))
    with pytest.raises(ValueError, match=r"lacks the parts of ranks \[2\] \(have 3 of 4\)"):
        merge_captures(tmp_path)
    assert merge_captures(tmp_path, skip_incomplete=True) == []


def test_recorder_rejects_bad_input(tmp_path):
    rec = TraceRecorder(tmp_path, 1, TOPO, _meta())
    with pytest.raises(ValueError, match=r"rank 4 is out of range 0..3"):
        rec.record(0, 1, 4, _ids(0))
    with pytest.raises(ValueError, match=r"expected \[T, E=8\]"):
        rec.record(0, 1, 0, torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[T, K=2\] integer array"):
        rec.record(0, 1, 0, np.zeros((3, 4), np.int64))
    other = RailTopology(num_nodes=4, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"expected topology"):
        TraceRecorder(tmp_path, 1, other, _meta())


def test_read_trace_on_capture_dir_needs_one_step(tmp_path):
    with TraceRecorder(tmp_path, 1, TOPO, _meta()) as rec:
        for step in (0, 1):
            for rank in range(4):
                rec.record(step, 1, rank, _ids(rank))
    with pytest.raises(ValueError, match=r"holds 2 step directories .*call merge_captures"):
        read_trace(tmp_path)
    assert read_trace(step_dir(tmp_path, 1)).meta.step == 1
    with pytest.raises(TraceFormatError, match=r"is a 'rank-part' file, not a trace"):
        read_trace(step_dir(tmp_path, 1) / "rank00000.npz")


def test_record_reads_no_device_data_back_on_the_dispatch_path(tmp_path):
    # The dispatcher used to hand routing_map.cpu() to record (a host sync per captured layer
    # call). Now record starts a copy and the part is converted when written: SyncAudit, which
    # treats the marked routing map as device data, counts nothing in record.
    from megatron_railwave.lab.bench.sync_audit import SyncAudit

    rec = TraceRecorder(tmp_path, 1, TOPO, _meta())
    ids = _ids(5)
    routing = routing_map_from_topk_ids(ids, E)
    with SyncAudit() as audit:
        audit.mark(routing)
        assert rec.record(0, 1, 2, routing) is True
    assert audit.count == 0, [(e.name, e.where) for e in audit.events]
    # the recorder copied it: a later change of the caller's tensor does not leak in
    routing.zero_()
    rec.close()
    from megatron_railwave.telemetry.capture.trace import _read_archive

    _, _, layers = _read_archive(step_dir(tmp_path, 0) / "rank00002.npz")
    assert np.array_equal(layers[1], ids)
