"""Per-layer logs: JSONL per rank / per job, deferred CUDA times, Megatron's tracker and writers,
and ``railwave report`` on a synthetic log."""

from __future__ import annotations

import json

import pytest

from megatron_railwave.cli import main
from megatron_railwave.names import ROUTES
from megatron_railwave.telemetry.commlog import FanoutSink, JsonlStatsSink, read_logs
from megatron_railwave.telemetry.megatron_logging import (
    MegatronMetricsSink,
    report_railwave_metrics,
)
from megatron_railwave.telemetry.stats import LayerCommStats

PATHS = tuple(map(str, ROUTES))


def make_stats(
    layer: int, step: int, path: str = "joint", *, ms: float = 1.0, shares=None
) -> LayerCommStats:
    return LayerCommStats(
        layer=layer,
        step=step,
        path=path,
        B_mean_bytes=float(2 << 20) * layer,
        B_max_bytes=float(3 << 20) * layer,
        rho_g=1.5,
        kappa=2.0,
        coords=[0.0, 0.1, 0.5],
        rho_g_exec=1.0,
        kappa_exec=1.0,
        rail_shares=shares or [[0.5, 0.5], [0.75, 0.25]],
        records_total=100,
        remote_records=80,
        relayed_records=7,
        num_waves=3 if path in ("perm", "joint") else 1,
        peak_fanin=1,
        plan_ms=0.2,
        dispatch_ms=ms,
        combine_ms=ms / 2,
    )


class FakeTimer:
    """A CUDA-like stopwatch whose event completes when the test says so."""

    def __init__(self, ms: float) -> None:
        self.ms, self.done, self.waited = ms, False, False

    def ready(self) -> bool:
        return self.done

    def elapsed_ms(self) -> float:
        self.waited = not self.done
        return self.ms


# ---------------------------------------------------------------------- JSONL
def test_jsonl_per_rank_files_and_interval(tmp_path):
    sinks = [JsonlStatsSink(tmp_path, interval=2, rank=r, run_id="r1") for r in range(2)]
    for step in range(4):
        for layer in (1, 2):
            for sink in sinks:
                if sink.wants(step):  # what the dispatcher asks before computing statistics
                    sink(make_stats(layer, step))
    for sink in sinks:
        sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "railwave_r1_rank0.jsonl",
        "railwave_r1_rank1.jsonl",
    ]
    lines = (tmp_path / "railwave_r1_rank1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["layer"], r["step"]) for r in records] == [
        (1, 0),
        (2, 0),
        (1, 2),
        (2, 2),
    ]  # steps 0 and 2
    assert records[0]["rank"] == 1 and records[0]["rail_shares"] == [[0.5, 0.5], [0.75, 0.25]]
    assert records[0]["run"] == "r1" and "timers" not in records[0]
    assert [sinks[0].wants(s) for s in range(4)] == [True, False, True, False]


def test_jsonl_per_job_only_rank0_writes(tmp_path):
    sinks = [JsonlStatsSink(tmp_path, rank=r, mode="job", run_id="r1") for r in range(3)]
    for sink in sinks:
        sink(make_stats(1, 0))
        sink.close()
    assert [p.name for p in tmp_path.iterdir()] == ["railwave_r1.jsonl"]
    assert len(read_logs(tmp_path)) == 1
    assert all(
        sink.wants(0) for sink in sinks
    )  # every rank answers alike: the count exchange's width
    with pytest.raises(ValueError, match="log mode must be 'rank' or 'job'"):
        JsonlStatsSink(tmp_path, mode="node")


def test_second_run_gets_its_own_files_and_report_keeps_runs_apart(tmp_path, capsys):
    """A second run into the same directory writes new files; report summarises each run alone."""
    from megatron_railwave.lab.log_summary import summarize_logs
    from megatron_railwave.telemetry.commlog import split_runs

    for run, (steps, ms) in {"20250101-000000-1": (3, 1.0), "20250102-000000-2": (5, 7.0)}.items():
        sink = JsonlStatsSink(tmp_path, rank=0, run_id=run)
        for step in range(steps):
            sink(make_stats(1, step, "rail", ms=ms))
        sink.close()
    (tmp_path / "railwave_rank0.jsonl").write_text(
        json.dumps(make_stats(1, 0).to_dict()) + "\n"
    )  # an old file
    runs = split_runs(read_logs(tmp_path))
    assert {run: len(records) for run, records in runs.items()} == {
        "-": 1,
        "20250101-000000-1": 3,
        "20250102-000000-2": 5,
    }
    second = summarize_logs(runs["20250102-000000-2"])
    assert second["run"] == "20250102-000000-2" and second["layers"][0]["calls"] == 5
    assert second["layers"][0]["p50_ms"] == pytest.approx(
        10.5
    )  # 7 + 3.5, none of the first run's times
    with pytest.raises(ValueError, match="log records of 3 runs"):
        summarize_logs(read_logs(tmp_path))
    out_json = tmp_path / "one.json"
    assert (
        main(
            [
                "report",
                str(tmp_path),
                "--no-plots",
                "--run",
                "20250101-000000-1",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    assert json.loads(out_json.read_text())["num_calls"] == 3
    assert main(["report", str(tmp_path), "--no-plots", "--json", str(out_json)]) == 0
    assert sorted(json.loads(out_json.read_text())["runs"]) == [
        "-",
        "20250101-000000-1",
        "20250102-000000-2",
    ]
    assert capsys.readouterr().out.count(" run ") >= 4  # one table per run (plus the --run one)


def test_job_run_id_is_agreed_through_the_store(monkeypatch):
    from megatron_railwave.telemetry import commlog

    monkeypatch.setattr(commlog, "_RUN_ID", [])
    monkeypatch.setenv(commlog.RUN_ENV, "bad id/..")
    with pytest.raises(ValueError, match="RAILWAVE_RUN_ID='bad id/..' must use only"):
        commlog.job_run_id()
    monkeypatch.setattr(commlog, "_RUN_ID", [])
    monkeypatch.setenv(commlog.RUN_ENV, "exp-7")
    assert commlog.job_run_id() == "exp-7" and commlog.job_run_id() == "exp-7"


def test_jsonl_waits_for_cuda_events_without_blocking(tmp_path):
    sink = JsonlStatsSink(tmp_path, rank=0)
    first, second = make_stats(1, 0), make_stats(2, 0)
    t1, t2 = FakeTimer(3.0), FakeTimer(4.0)
    first.set_timers(dispatch=t1)
    second.set_timers(dispatch=t2)
    sink(first)
    sink(second)
    assert not sink.path.exists() or read_logs(tmp_path) == []
    t1.done = True
    sink(make_stats(3, 0))  # the next record drains what is ready, in order, and stops at layer 2
    assert [r["layer"] for r in read_logs(tmp_path)] == [1]
    assert read_logs(tmp_path)[0]["dispatch_ms"] == 3.0 and not t1.waited
    sink.close()  # flush waits for the rest
    assert [r["layer"] for r in read_logs(tmp_path)] == [1, 2, 3]
    assert t2.waited and read_logs(tmp_path)[1]["dispatch_ms"] == 4.0
    sink.close()  # idempotent
    sink(make_stats(4, 0))  # a late record reopens the file and appends
    sink.close()
    assert [r["layer"] for r in read_logs(tmp_path)] == [1, 2, 3, 4]


def test_read_logs_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no railwave"):
        read_logs(tmp_path)
    (tmp_path / "railwave_rank0.jsonl").write_text('{"layer": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"railwave_rank0.jsonl:2: not valid JSON"):
        read_logs(tmp_path)


def test_fanout_sink_reaches_every_sink(tmp_path):
    seen = []
    jsonl = JsonlStatsSink(tmp_path, rank=0)
    fan = FanoutSink(seen.append, None, jsonl)
    fan(make_stats(1, 0))
    fan.close()
    assert len(seen) == 1 and len(read_logs(tmp_path)) == 1


# ---------------------------------------------------------------------- Megatron's tracker
class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, name, value, iteration):  # TensorBoard's signature
        self.scalars[name] = float(value)
        self.iteration = iteration


class FakeWandb:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, data, step):
        self.logged.update({k: float(v) for k, v in data.items()})


@pytest.fixture
def sink():
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()  # CPU torch: Megatron's MoE package imports Triton kernels
    from megatron_railwave.telemetry.megatron_logging import _make_tracker

    return MegatronMetricsSink(tracker=_make_tracker())


def test_megatron_per_layer_scalars(sink):
    # Layers 1 and 3 are MoE (layer 2 dense); two micro-batches each, layer 3 runs RAIL once.
    sink(make_stats(1, 0, "joint", ms=2.0))
    sink(make_stats(1, 1, "joint", ms=4.0))
    sink(make_stats(3, 0, "joint", ms=1.0))
    sink(make_stats(3, 1, "rail", ms=1.0))
    writer, wandb = FakeWriter(), FakeWandb()
    text = report_railwave_metrics(writer, wandb, 10, True, sink=sink)
    s = writer.scalars
    # Per layer i = layer number - 1 (Megatron's convention), mean over the calls.
    assert s["moe/railwave_dispatch_ms_layer_0"] == pytest.approx(3.0)
    assert s["moe/railwave_combine_ms_layer_0"] == pytest.approx(1.5)
    assert s["moe/railwave_path_rail_layer_2"] == pytest.approx(0.5)
    assert s["moe/railwave_B_mean_MiB_layer_2"] == pytest.approx(6.0)  # 2 MiB x layer 3
    assert s["moe/railwave_rail_share_max_layer_0"] == pytest.approx(0.75)
    # Layer averages over the 2 MoE layers: path_joint (1 + 0.5) / 2; dispatch (3 + 1) / 2.
    assert s["railwave_path_joint"] == pytest.approx(0.75)
    assert s["railwave_dispatch_ms"] == pytest.approx(2.0)
    assert wandb.logged == s and writer.iteration == 10
    assert "railwave_path_joint: 0.75" in text


def test_megatron_layer_averages_only_without_per_layer_logging(sink):
    sink(make_stats(1, 0, "perm"))
    writer = FakeWriter()
    report_railwave_metrics(writer, None, 1, False, sink=sink)
    assert writer.scalars["railwave_path_perm"] == 1.0
    assert not [k for k in writer.scalars if k.startswith("moe/")]


def test_megatron_report_respects_log_interval_and_clears(sink):
    sink(make_stats(1, 0, ms=1.0))
    writer = FakeWriter()
    assert report_railwave_metrics(writer, None, 3, True, log_interval=2, sink=sink) == ""
    assert writer.scalars == {}
    sink(make_stats(1, 1, ms=3.0))  # the interval's steps are averaged together
    report_railwave_metrics(writer, None, 4, True, log_interval=2, sink=sink)
    assert writer.scalars["moe/railwave_dispatch_ms_layer_0"] == pytest.approx(2.0)
    writer2 = FakeWriter()
    sink(make_stats(1, 2, ms=5.0))
    report_railwave_metrics(writer2, None, 6, True, log_interval=2, sink=sink)
    assert writer2.scalars["moe/railwave_dispatch_ms_layer_0"] == pytest.approx(
        5.0
    )  # cleared after report


def test_megatron_sink_defers_cuda_times_to_report(sink):
    stats = make_stats(2, 0)
    timer = FakeTimer(7.0)
    stats.set_timers(dispatch=timer)
    sink(stats)
    assert not timer.waited
    writer = FakeWriter()
    report_railwave_metrics(writer, None, 1, True, num_layers=4, sink=sink)
    assert writer.scalars["moe/railwave_dispatch_ms_layer_1"] == pytest.approx(7.0)
    assert "moe/railwave_dispatch_ms_layer_3" in writer.scalars  # entries sized num_layers
    # num_layers given without moe_layer_freq: Megatron averages over all 4 layers.
    assert writer.scalars["railwave_dispatch_ms"] == pytest.approx(7.0 / 4)


def test_megatron_sink_ignores_unnumbered_layers(sink):
    sink(make_stats(0, 0))
    assert report_railwave_metrics(FakeWriter(), None, 1, True, sink=sink) == ""


def test_megatron_report_hook_appends_railwave_scalars(sink, monkeypatch):
    from megatron.core.transformer.moe import moe_logging

    from megatron_railwave.telemetry.megatron_logging import (
        attach_to_megatron_report,
        detach_from_megatron_report,
    )

    monkeypatch.setattr(moe_logging, "_MOE_METRICS_TRACKER", moe_logging.MoEMetricsTracker())
    tracker = moe_logging.get_moe_metrics_tracker()
    monkeypatch.setattr(
        tracker, "_sync_metrics", lambda names, pg=None: None
    )  # no parallel state here
    assert attach_to_megatron_report(sink=sink, log_interval=2)
    assert not attach_to_megatron_report(sink=sink)  # once only
    sink(make_stats(1, 0, "rail"))
    writer = FakeWriter()
    # What Megatron-LM's training_log does every iteration (its own metrics: none recorded here).
    kwargs = dict(
        loss_scale=1.0,
        writer=writer,
        wandb_writer=None,
        per_layer_logging=True,
        force_initialize=False,
        track_names=[],
        num_layers=2,
        moe_layer_freq=None,
    )
    assert tracker.report(iteration=1, **kwargs) == ""  # not a log step for railwave (interval 2)
    text = tracker.report(iteration=2, **kwargs)
    assert "railwave_path_rail: 0.50" in text  # 1 of 2 layers; num_layers from Megatron's call
    assert writer.scalars["moe/railwave_path_rail_layer_0"] == 1.0
    detach_from_megatron_report()
    assert getattr(tracker.report, "_railwave_original", None) is None


# ---------------------------------------------------------------------- railwave report
def _synthetic_log(log_dir, *, ranks=2, layers=4, steps=6):
    for rank in range(ranks):
        sink = JsonlStatsSink(log_dir, rank=rank)
        for step in range(steps):
            for layer in range(1, layers + 1):
                path = PATHS[(layer + step // 3) % 4]
                shares = (
                    [[0.5, 0.5], [0.5, 0.5]]
                    if path in ("rail", "joint")
                    else [[0.8, 0.2], [0.6, 0.4]]
                )
                sink(make_stats(layer, step, path, ms=1.0 + rank + 0.1 * layer, shares=shares))
        sink.close()


def test_report_table_json_and_plots(tmp_path, capsys):
    from megatron_railwave.lab.log_summary import summarize_logs

    log_dir = tmp_path / "logs"
    _synthetic_log(log_dir)
    summary = summarize_logs(read_logs(log_dir))
    assert summary["num_records"] == 2 * 4 * 6 and summary["num_calls"] == 4 * 6
    layer1 = summary["layers"][0]
    # Layer 1: steps 0-2 run PATHS[1] = rail, steps 3-5 PATHS[2] = perm.
    assert layer1["path_mix"] == {
        "native": 0.0,
        "rail": 0.5,
        "perm": 0.5,
        "joint": 0.0,
        "flow": 0.0,
        "flow-waves": 0.0,
    }
    # Slowest rank per (layer, step): rank 1, (1 + 1 + 0.1) x 1.5 = 3.15 ms dispatch + combine.
    assert layer1["p50_ms"] == pytest.approx(3.15) and layer1["p95_ms"] == pytest.approx(3.15)
    assert summary["paths"]["rail"]["nic_shares"] == pytest.approx([0.5, 0.5])
    assert summary["paths"]["perm"]["nic_shares"] == pytest.approx([0.7, 0.3])

    out_json = tmp_path / "report.json"
    assert (
        main(["report", str(log_dir), "--out", str(tmp_path / "plots"), "--json", str(out_json)])
        == 0
    )
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["latency.png", "nic_shares.png", "path_choice.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert json.loads(out_json.read_text())["num_calls"] == 24
    assert "layer calls" in capsys.readouterr().out


def test_report_missing_logs_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path)])
    assert exc.value.code == 2


def test_report_online_selector_state(tmp_path, capsys):
    """Records with the online selector's state: the per-layer probe share and online.png."""
    from megatron_railwave.lab.log_summary import summarize_logs

    log_dir = tmp_path / "logs"
    sink = JsonlStatsSink(log_dir, rank=0)
    order = ["joint", "rail", "perm", "native", "joint", "joint", "rail", "joint"]
    for step, path in enumerate(order):
        s = make_stats(1, step, path)
        s.set_online(
            {
                "mode": "probe" if step < 4 or step == 6 else "exploit",
                "neighbourhood": 0,
                "measured_ms": {
                    "native": 4.0 if step > 3 else None,
                    "rail": 2.2 if step > 1 else None,
                    "perm": 3.0 if step > 2 else None,
                    "joint": 2.0 if step > 0 else None,
                },
                "last_ms": 2.0 if step else None,
                "bad_timings": 0,
            }
        )
        sink(s)
    sink.close()
    records = read_logs(log_dir)
    assert records[5]["selector_mode"] == "exploit" and records[5]["measured_ms"]["native"] == 4.0
    summary = summarize_logs(records)
    assert summary["layers"][0]["online_probe_share"] == pytest.approx(5 / 8)
    assert main(["report", str(log_dir), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "online.png").read_bytes()[:4] == b"\x89PNG"
    assert "online selector" in capsys.readouterr().out
