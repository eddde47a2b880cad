"""The online selector: probes then exploits, neighbourhoods, seeds, bad timings, rank agreement,
its descriptors against ``demand_stats``, the learned-paths report, the config wiring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave import ops
from megatron_railwave.config import OnlineSettings, RailWaveConfig
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import Route
from megatron_railwave.selector import FixedSelector, OnlineSelector, selector_from_config
from megatron_railwave.selector.learned import FORMAT, learned_paths, save_learned_paths
from megatron_railwave.selector.online import (
    TIMING_MISSING,
    TIMING_NONE,
    TIMING_STALLED,
    encode_timing,
    fast_descriptors,
    slowest_timing,
)
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, TrafficStats
from tests.helpers.online_cases import SCALES, TOPO, TRUE_S, stats


def run(
    sel: OnlineSelector,
    times: dict[Route, float],
    calls: int,
    descr: TrafficStats,
    *,
    ranks: int = 1,
    skew=None,
) -> list[tuple[Route, str]]:
    """Drive ``sel`` like the dispatcher: each call's words carry the previous call's time from
    every rank (``skew[r]``: rank r's clock factor, default 1)."""
    out, prev = [], None
    for _ in range(calls):
        words = [
            encode_timing(
                None if prev is None else times[prev] * (skew[r] if skew else 1.0),
                expected=sel.expects_timing(),
            )
            for r in range(ranks)
        ]
        sel.observe(words)
        d = sel.decide("train", descr)
        out.append((d.path, d.mode))
        prev = d.path
    return out


def test_probes_each_candidate_then_exploits_the_fastest():
    sel = OnlineSelector(OnlineSettings(probes=2, reprobe_every=1000), scales=SCALES)
    seq = run(sel, TRUE_S, 20, stats(64))
    probes = [p for p, mode in seq if mode == "probe"]
    # Round 1 probes all four (JOINT first); NATIVE (2x JOINT's time) is dropped after one probe,
    # the others get their second probe; then JOINT, the fastest, runs.
    assert probes == [
        Route.JOINT,
        Route.RAIL,
        Route.PERM,
        Route.NATIVE,
        Route.JOINT,
        Route.RAIL,
        Route.PERM,
    ]
    assert all(p == Route.JOINT and mode == "exploit" for p, mode in seq[len(probes) :])


def test_native_wins_where_it_is_fastest_and_reprobes_pay_for_themselves():
    times = {Route.NATIVE: 1e-3, Route.RAIL: 1.1e-3, Route.PERM: 3e-3, Route.JOINT: 3e-3}
    sel = OnlineSelector(OnlineSettings(reprobe_every=5, reprobe_budget=0.1), scales=SCALES)
    seq = run(sel, times, 80, stats(8))
    exploit = [p for p, mode in seq if mode == "exploit"]
    assert exploit and set(exploit) == {Route.NATIVE}
    reprobes = [p for p, mode in seq if mode == "reprobe"]
    # RAIL is 10% over NATIVE: 5 exploit calls x 0.1 = 0.5 >= 0.1, re-probed every 5 exploits.
    # PERM / JOINT are 200% over: they wait 2.0 / 0.1 = 20 exploit calls each.
    assert reprobes.count(Route.RAIL) >= 8
    assert 1 <= reprobes.count(Route.JOINT) <= 3 and 1 <= reprobes.count(Route.PERM) <= 3
    cheap = OnlineSelector(OnlineSettings(reprobe_every=5, reprobe_budget=0.01), scales=SCALES)
    assert Route.JOINT not in [
        p for p, mode in run(cheap, times, 80, stats(8)) if mode == "reprobe"
    ]


def test_layers_share_what_they_measured():
    from megatron_railwave.selector.online import SharedNeighbourhoods

    shared = SharedNeighbourhoods()
    first = OnlineSelector(scales=SCALES, shared=shared, layer=1)
    run(first, TRUE_S, 12, stats(64))
    second = OnlineSelector(scales=SCALES, shared=shared, layer=2)
    seq = run(second, TRUE_S, 8, stats(80))
    assert Route.NATIVE not in [p for p, _ in seq]  # 2x JOINT on layer 1: deferred on layer 2
    alone = OnlineSelector(OnlineSettings(share=False), scales=SCALES, shared=shared, layer=3)
    assert Route.NATIVE in [p for p, _ in run(alone, TRUE_S, 8, stats(80))]


def test_switches_when_the_fabric_changes():
    sel = OnlineSelector(
        OnlineSettings(reprobe_every=4, window=4, reprobe_budget=0.5), scales=SCALES
    )
    run(sel, TRUE_S, 30, stats(64))
    changed = dict(TRUE_S, **{Route.RAIL: 1e-3})  # RAIL becomes the fastest
    seq = run(sel, changed, 60, stats(64))
    # RAIL's re-probes (10% over JOINT before: every 4 exploit calls) bring its new times in; once
    # they are the median of its window, it is the exploited path.
    assert {p for p, mode in seq[-20:] if mode == "exploit"} == {Route.RAIL}


def test_new_neighbourhood_when_descriptors_leave_and_seeded_from_the_nearest():
    sel = OnlineSelector(OnlineSettings(reprobe_every=1000), scales=SCALES)
    run(sel, TRUE_S, 12, stats(64))
    seq = run(sel, TRUE_S, 6, stats(512))  # 8x the payload: outside payload_ratio 2
    assert sel.decide("train", stats(512)).neighbourhood == 1
    # Seeded by neighbourhood 0: JOINT first, NATIVE (2x) deferred to re-probes.
    assert seq[0] == (Route.JOINT, "probe") and Route.NATIVE not in [p for p, _ in seq]
    # Back inside neighbourhood 0: its state is reused, no new probes.
    assert run(sel, TRUE_S, 3, stats(70))[-1] == (Route.JOINT, "exploit")
    # Learned: neighbourhood 1 never timed NATIVE (the seed deferred it), so its report lists only
    # the paths it timed; neighbourhood 0 timed all four.
    learned = {nb.index: (best, medians) for _, nb, best, medians in sel.learned()}
    assert "native" not in map(str, learned[1][1]) and str(learned[1][0]) == "joint"
    assert set(map(str, learned[0][1])) == {"joint", "rail", "perm", "native"}


def test_pass_kinds_have_separate_tables_and_recompute_is_replayed():
    sel = OnlineSelector(scales=SCALES)
    run(sel, TRUE_S, 12, stats(64))
    d = sel.decide("forward_only", stats(64))
    assert (d.path, d.mode) == (Route.JOINT, "probe")  # forward-only learns on its own
    # The recompute's count exchange reports the call before it; the recompute itself is neither a
    # decision nor timed (torch's default checkpoint stops it before the combine), so the next
    # call's words carry no time and a missing one is no bad timing.
    assert sel.expects_timing()
    sel.observe([encode_timing(1e-3, expected=True)])
    r = sel.replay(Route.RAIL)
    assert (r.path, r.mode, r.kind) == (Route.RAIL, "replay", "recompute")
    assert not sel.expects_timing()
    assert sel.observe([TIMING_NONE, TIMING_NONE]) is None and sel.bad_total == 0
    assert sel.snapshot(r)["measured_ms"]["rail"] is None


def test_a_first_neighbourhood_probes_in_candidate_order_joint_first():
    # Nothing measured yet, by this layer or any other: no seed, the candidates' order.
    sel = OnlineSelector(OnlineSettings(reprobe_every=1000), scales=SCALES)
    seq = run(sel, TRUE_S, 4, stats(64))
    assert seq == [(p, "probe") for p in (Route.JOINT, Route.RAIL, Route.PERM, Route.NATIVE)]


def test_slowest_rank_and_codes():
    assert slowest_timing([TIMING_NONE] * 4) == (None, None)
    assert slowest_timing([1000, 3000, 2000]) == (3e-6, None)
    seconds, problem = slowest_timing([1000, TIMING_MISSING, 5])
    assert seconds is None and "[1]" in problem and "missing" in problem
    assert "no timing where the others did" in slowest_timing([1000, TIMING_NONE])[1]
    assert encode_timing(float("nan"), expected=True) < 0 and encode_timing(-1.0, expected=True) < 0
    assert encode_timing(0.0, expected=True) == TIMING_STALLED
    assert encode_timing(None, expected=False) == TIMING_NONE


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, 0.0, None])
def test_bad_timings_fall_back_to_joint_on_every_rank(bad):
    sels = [OnlineSelector(OnlineSettings(max_bad=3), scales=SCALES, layer=5) for _ in range(4)]
    messages = [[] for _ in sels]
    decisions = [[] for _ in sels]
    for call in range(12):
        # Rank 2's clock goes bad from call 4 on; every rank receives the same words.
        words = [
            encode_timing(
                None if call == 0 else (bad if (r == 2 and call >= 4) else 1e-3 * (r + 1)),
                expected=call > 0,
            )
            for r in range(4)
        ]
        for k, sel in enumerate(sels):
            msg = sel.observe(words)
            if msg:
                messages[k].append(msg)
            decisions[k].append(sel.decide("train", stats(64)))
    assert all(d == decisions[0] for d in decisions)
    assert all(len(m) == 1 and "layer 5" in m[0] and "JOINT" in m[0] for m in messages)
    assert [d.mode for d in decisions[0][7:]] == ["fallback"] * 5
    assert all(d.path == Route.JOINT for d in decisions[0][7:])


@settings(max_examples=30, deadline=None)
@given(skews=st.lists(st.floats(0.5, 2.0), min_size=4, max_size=4), seed=st.integers(0, 1000))
def test_ranks_whose_clocks_differ_decide_the_same(skews, seed):
    # Each rank measures with its own clock (its own factor and noise); the words all ranks
    # receive are the same, so the decisions are too.
    rng = np.random.default_rng(seed)
    sels = [OnlineSelector(OnlineSettings(reprobe_every=3), scales=SCALES) for _ in range(4)]
    prev = None
    for call in range(40):
        words = [
            encode_timing(
                None if prev is None else TRUE_S[prev] * skews[r] * rng.uniform(0.9, 1.1),
                expected=prev is not None,
            )
            for r in range(4)
        ]
        descr = stats(64 if call < 20 else 300)
        ds = []
        for sel in sels:
            sel.observe(words)
            ds.append(sel.decide("train", descr))
        assert all(d == ds[0] for d in ds)
        prev = ds[0].path


def test_idle_layer_without_remote_payload():
    sel = OnlineSelector(scales=SCALES)
    d = sel.decide("train", stats(0))
    assert (d.path, d.mode) == (Route.JOINT, "idle") and not sel.expects_timing()


@pytest.mark.parametrize("seed", [0, 3])
def test_fast_descriptors_match_demand_stats(seed):
    maps = synthetic_routing_maps(TOPO, num_tokens=512, num_experts=64, topk=4, seed=seed)
    demand = DemandCounts.from_routing_maps(maps, TOPO)
    ref = demand_stats(demand, TOPO, record_bytes=4096)
    got = fast_descriptors(demand.records_WN.numpy(), TOPO, record_bytes=4096)
    for name in ("B_mean_bytes", "B_max_bytes", "rho_g", "kappa"):
        assert getattr(got, name) == pytest.approx(getattr(ref, name), rel=1e-12), name
    assert got.coords == pytest.approx(ref.coords, rel=1e-12)
    assert got.remote_records == ref.remote_records and got.records_total == ref.records_total


def test_fast_descriptors_with_shared_rails_and_a_failed_rail():
    topo = RailTopology(
        num_nodes=2, gpus_per_node=4, rail_of_gpu=(0, 0, 1, 1), failed_rails=((1, 1),)
    )
    maps = synthetic_routing_maps(topo, num_tokens=256, num_experts=16, topk=2, seed=1)
    demand = DemandCounts.from_routing_maps(maps, topo)
    ref = demand_stats(demand, topo, record_bytes=64)
    got = fast_descriptors(demand.records_WN.numpy(), topo, record_bytes=64)
    assert (got.rho_g, got.kappa) == pytest.approx((ref.rho_g, ref.kappa), rel=1e-12)


def test_learned_paths_report_by_layer_pass_kind_and_neighbourhood():
    sel = OnlineSelector(
        OnlineSettings(drop_ratio=10.0, reprobe_every=1000), scales=SCALES, layer=3
    )
    run(sel, TRUE_S, 12, stats(64))
    sel.observe([encode_timing(TRUE_S[Route.JOINT], expected=sel.expects_timing())])
    sel.decide("forward_only", stats(64))  # a forward-only probe whose time is not back: untimed
    report = learned_paths([sel], TOPO)
    assert report["format"] == FORMAT and report["topology"] == TOPO.to_dict()
    (entry,) = report["entries"]
    assert (entry["layer"], entry["pass_kind"], entry["neighbourhood"]) == (3, "train", 0)
    assert entry["best"] == "joint"
    assert entry["median_s"] == pytest.approx(
        {"joint": 2e-3, "rail": 2.2e-3, "perm": 3e-3, "native": 4e-3}
    )
    assert entry["centre"] == pytest.approx(list(stats(64).coords), abs=1e-6)
    assert report["online"]["payload_ratio"] == 2.0


def test_config_wiring():
    sel = selector_from_config(RailWaveConfig(), TOPO)
    assert isinstance(sel, OnlineSelector) and sel.scales == SCALES
    # Fixed-capacity mode with path auto runs the online selector too (its epochs variant).
    assert RailWaveConfig(max_tokens_per_rank=64).selector_kind() == "online"
    assert isinstance(
        selector_from_config(RailWaveConfig(max_tokens_per_rank=64), TOPO), OnlineSelector
    )
    assert RailWaveConfig(path="rail", selector=None).selector_kind() == "fixed"
    fixed = selector_from_config(RailWaveConfig(path="rail"), TOPO)
    assert isinstance(fixed, FixedSelector) and fixed.path == Route.RAIL
    with pytest.raises(ValueError, match="path: auto"):
        RailWaveConfig(path="joint", selector="online")


def test_layers_wait_for_an_in_flight_probe_instead_of_repeating_it():
    """Six layers called in order every step (as a model's layers are): a path another layer is
    probing is waited for (at most 2 calls) and then judged by that layer's ratio to JOINT, so
    NATIVE (2x JOINT) runs on far fewer layers than with per-layer learning; JOINT never waits."""
    from megatron_railwave.selector.online import SharedNeighbourhoods

    def native_probes(share: bool) -> tuple[int, list[str]]:
        shared = SharedNeighbourhoods()
        sels = [
            OnlineSelector(OnlineSettings(share=share), scales=SCALES, shared=shared, layer=i)
            for i in range(6)
        ]
        prev: list = [None] * 6
        count, first_modes = 0, []
        for step in range(12):
            for i, sel in enumerate(sels):
                sel.observe(
                    [
                        encode_timing(
                            None if prev[i] is None else TRUE_S[prev[i]],
                            expected=sel.expects_timing(),
                        )
                    ]
                )
                d = sel.decide("train", stats(64))
                count += d.path == Route.NATIVE and d.mode in ("probe", "reprobe")
                if step == 0:
                    first_modes.append((str(d.path), d.mode))
                prev[i] = d.path
        return count, first_modes

    shared_count, first = native_probes(True)
    alone_count, _ = native_probes(False)
    assert alone_count == 6 and shared_count <= 2
    assert first == [("joint", "probe")] * 6  # JOINT never waits


def test_save_learned_paths_writes_what_live_selectors_learned(tmp_path):
    sel = OnlineSelector(OnlineSettings(drop_ratio=10.0), scales=SCALES, layer=77)
    run(sel, TRUE_S, 12, stats(64))
    path = save_learned_paths(tmp_path / "sub" / "out.yaml", TOPO)
    entries = yaml.safe_load(path.read_text())["entries"]
    assert {"layer": 77, "pass_kind": "train", "neighbourhood": 0}.items() <= next(
        e for e in entries if e["layer"] == 77
    ).items()


def test_save_learned_paths_never_replaces_a_file_with_nothing(tmp_path, caplog, monkeypatch):
    """A model freed before interpreter exit (a model local to a training function) leaves no live
    selector: the at-exit save must keep the earlier run's file, not write an empty report over
    it; and the write goes to a temporary file renamed over the target, so a write that fails
    before the rename (here: the rename itself) leaves the old file and no temporary file."""
    import gc

    import megatron_railwave.selector.learned as learned_module

    gc.collect()  # selectors of earlier tests, if unreferenced, are gone before this one's
    sel = OnlineSelector(OnlineSettings(drop_ratio=10.0), scales=SCALES, layer=78)
    run(sel, TRUE_S, 12, stats(64))
    out = tmp_path / "out.yaml"
    assert save_learned_paths(out, TOPO) == out
    good = out.read_text()
    assert "layer: 78" in good
    del sel
    gc.collect()
    with caplog.at_level("WARNING", logger="megatron_railwave.selector.learned"):
        assert save_learned_paths(out, TOPO) is None
    assert out.read_text() == good
    assert "nothing learned to write" in caplog.text and str(out) in caplog.text

    sel = OnlineSelector(OnlineSettings(drop_ratio=10.0), scales=SCALES, layer=79)
    run(sel, TRUE_S, 12, stats(64))

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(learned_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_learned_paths(out, TOPO)
    assert out.read_text() == good and sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml"]


def _ratio_by_full_scan(shared, kind, centre, path, exclude):
    """``SharedNeighbourhoods.ratio`` by its definition: every neighbourhood of every layer."""
    best = None
    for nb in shared.tables.get(kind, []):
        t = nb.times.get(path)
        if nb is exclude or t is None or not t.recent:
            continue
        others = [q.median() for c, q in nb.times.items() if c != path and q.recent]
        if others:
            d2 = sum((a - b) ** 2 for a, b in zip(centre, nb.centre))
            if best is None or d2 < best[0]:
                best = (d2, t.median() / min(others))
    return None if best is None else best[1]


def test_shared_ratio_index_matches_a_full_scan_through_evictions():
    """The per-path index ``ratio`` scans gives what a scan of every neighbourhood gives, also
    after layers forget neighbourhoods (max_neighbourhoods 2) and with equally distant ones."""
    from megatron_railwave.selector.online import SharedNeighbourhoods

    shared = SharedNeighbourhoods()
    rng = np.random.default_rng(5)
    sels = [
        OnlineSelector(
            OnlineSettings(max_neighbourhoods=2, probes=1), scales=SCALES, shared=shared, layer=i
        )
        for i in range(4)
    ]
    payloads = [8, 64, 512, 4096]
    prev: list[float | None] = [None] * len(sels)
    for step in range(60):
        for i, sel in enumerate(sels):
            sel.observe([encode_timing(prev[i], expected=sel.expects_timing())])
            d = sel.decide("train", stats(payloads[(step // 6 + i) % 4]))
            prev[i] = TRUE_S[d.path] * (1 + 0.3 * rng.random())
        probe = stats(float(rng.choice([8, 30, 64, 200, 512, 4096])))
        for path in Route:
            exclude = sels[0]._tables["train"][0]
            assert shared.ratio("train", probe.coords, path, exclude) == _ratio_by_full_scan(
                shared, "train", probe.coords, path, exclude
            )
    assert all(len(sel._tables["train"]) <= 2 and sel.fallback_reason is None for sel in sels)
    assert shared._created > 8  # neighbourhoods were forgotten
    listed = {id(e[4]) for entries in shared.timed.values() for e in entries}
    assert listed <= {id(nb) for nb in shared.tables["train"]}


@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=4, gpus_per_node=8, failed_rails=((1, 3), (2, 0))),
        RailTopology(num_nodes=1, gpus_per_node=4),
        RailTopology(num_nodes=3, gpus_per_node=2),
    ],
)
def test_fast_descriptors_match_demand_stats_on_more_topologies(topo):
    for seed in range(3):
        maps = synthetic_routing_maps(
            topo, num_tokens=128, num_experts=4 * topo.world_size, topk=4, seed=seed
        )
        demand = DemandCounts.from_routing_maps(maps, topo)
        ref = demand_stats(demand, topo, record_bytes=64)
        got = fast_descriptors(demand.records_WN.numpy(), topo, record_bytes=64)
        for name in ("B_mean_bytes", "B_max_bytes", "rho_g", "kappa"):
            assert getattr(got, name) == pytest.approx(getattr(ref, name), rel=1e-12), name
        assert got.remote_records == ref.remote_records and got.records_total == ref.records_total


_COMPILED = ops.load_error() is None and ops.compiled_for(torch.device("cpu"))


@pytest.mark.skipif(not _COMPILED, reason="the compiled ops did not load (make ext)")
@pytest.mark.parametrize(
    "topo",
    [
        RailTopology(num_nodes=4, gpus_per_node=8),
        RailTopology(num_nodes=4, gpus_per_node=8, failed_rails=((1, 3), (2, 0))),
        RailTopology(
            num_nodes=2, gpus_per_node=4, rail_of_gpu=(0, 0, 1, 1), failed_rails=((1, 1),)
        ),
        RailTopology(num_nodes=3, gpus_per_node=4, rail_of_gpu=(3, 2, 1, 0)),
        RailTopology(num_nodes=1, gpus_per_node=4),
        RailTopology(num_nodes=8, gpus_per_node=1),
        RailTopology(num_nodes=16, gpus_per_node=8),
    ],
)
def test_fast_descriptors_compiled_and_numpy_agree_bitwise(topo):
    """``ops.layer_descriptors`` against the numpy reference on random counts (zeros, a single hot
    cell, large counts): every field equal, not approximately."""
    rng = np.random.default_rng(topo.world_size)
    shape = (topo.world_size, topo.num_nodes)
    cases = [np.zeros(shape, dtype=np.int64), np.eye(*shape, k=1, dtype=np.int64) * 7]
    cases += [
        rng.integers(0, high, size=shape) * (rng.random(shape) < keep)
        for high in (3, 5000, 1 << 24)
        for keep in (1.0, 0.3)
    ]
    for records in cases:
        records = np.ascontiguousarray(records, dtype=np.int64)
        ref = fast_descriptors(records, topo, record_bytes=8336, compiled=False)
        # a strided view, as the count message's
        wide = torch.zeros(records.shape[0], records.shape[1] + 3, dtype=torch.int64)
        wide[:, : records.shape[1]] = torch.from_numpy(records)
        for counts in (records, torch.from_numpy(records), wide[:, : records.shape[1]]):
            got = fast_descriptors(counts, topo, record_bytes=8336)
            assert got == ref, (records, got, ref)


@pytest.mark.skipif(not _COMPILED, reason="the compiled ops did not load (make ext)")
def test_layer_descriptors_refuses_bad_arguments():
    geometry = np.array([2, 4, 4, 0, 1, 2, 3] + [1] * 8, dtype=np.int64)
    assert ops.layer_descriptors(np.zeros((8, 2), dtype=np.int64), geometry) == (
        0.0,
        0.0,
        0.0,
        0.0,
        1.0,
        0.0,
    )
    with pytest.raises(ValueError, match="records must be"):
        ops.layer_descriptors(np.zeros((8, 3), dtype=np.int64), geometry)
    with pytest.raises(ValueError, match="records must be a 2-D int64"):
        ops.layer_descriptors(np.zeros((8, 2), dtype=np.int32), geometry)
    with pytest.raises(ValueError, match="length"):
        ops.layer_descriptors(np.zeros((8, 2), dtype=np.int64), geometry[:-1])
    bad_rail = geometry.copy()
    bad_rail[6] = 4
    with pytest.raises(ValueError, match="rail"):
        ops.layer_descriptors(np.zeros((8, 2), dtype=np.int64), bad_rail)


@pytest.mark.parametrize(
    "words",
    [
        [5, 9, 7],
        [0, 0, 0],
        [0, 4, 4],
        [3, TIMING_MISSING, 2],
        [TIMING_STALLED, 8, 1],
        [1 << 40, 1, 2],
    ],
)
def test_slowest_timing_reads_the_count_exchange_words_as_a_list(words):
    """``TimingWords`` (min / max of the packed status words) gives what the plain list gives."""
    from megatron_railwave.exchange.layer import TimingWords, pack_status

    status = [pack_status(0, w) for w in words]
    packed = TimingWords(status, max(status))
    assert (packed.lowest, packed.highest, list(packed)) == (min(words), max(words), words)
    assert slowest_timing(packed) == slowest_timing(words)


def test_streamed_candidates_are_timed_apart_from_their_route_and_exploited():
    """'joint+streamed' is its own candidate: probed, timed under its own key, exploited where it
    is the fastest, and its decisions say streamed (what the dispatcher plans with)."""
    settings = OnlineSettings(candidates=("joint", "native", "joint+streamed"), reprobe_every=1000)
    sel = OnlineSelector(settings, scales=SCALES)
    times = {"joint": 2e-3, "native": 3e-3, "joint+streamed": 1e-3}
    prev, seq = None, []
    for _ in range(12):
        sel.observe(
            [encode_timing(None if prev is None else times[prev], expected=prev is not None)]
        )
        d = sel.decide("train", stats(64))
        seq.append((str(d.candidate), d.mode, d.path, d.streamed))
        prev = str(d.candidate)
    assert [c for c, mode, *_ in seq if mode == "probe"][:3] == [
        "joint",
        "native",
        "joint+streamed",
    ]
    exploits = [(c, path, streamed) for c, mode, path, streamed in seq if mode == "exploit"]
    assert exploits and set(exploits) == {("joint+streamed", Route.JOINT, True)}
    snapshot = sel.snapshot(d)
    assert snapshot["measured_ms"]["joint+streamed"] == pytest.approx(1.0)
    assert snapshot["measured_ms"]["joint"] == pytest.approx(2.0)
    assert "rail+streamed" not in snapshot["measured_ms"]  # not a candidate of this layer


def test_streamed_candidates_parse_and_are_refused_where_they_cannot_run():
    assert OnlineSettings(candidates=["JOINT", "Flow_Waves+streamed"]).candidates == (
        "joint",
        "flow-waves+streamed",
    )
    with pytest.raises(ValueError, match="unknown path"):
        OnlineSettings(candidates=["joint", "bogus+streamed"])
    with pytest.raises(ValueError, match="must include joint"):
        OnlineSettings(candidates=["joint+streamed"])
    online = {"candidates": ["joint", "joint+streamed"]}
    assert RailWaveConfig(path="auto", online=online).streamed_candidates == ("joint+streamed",)
    assert RailWaveConfig(path="joint", online=online).streamed_candidates == ()
    with pytest.raises(ValueError, match="torch backend only.*drop the"):
        RailWaveConfig(path="auto", backend="deepep", online=online)
    with pytest.raises(ValueError, match="fixed-capacity mode.*streamed: true"):
        RailWaveConfig(path="auto", max_tokens_per_rank=64, online=online)


def test_noise_estimate_reads_the_spread_of_repeated_times():
    from megatron_railwave.selector.online import NoiseEstimate

    rng = np.random.default_rng(7)
    noise = NoiseEstimate()
    base = 2e-3
    for _ in range(15):
        noise.add(base * np.exp(0.05 * rng.standard_normal()), base)
    assert noise.sigma() is None  # fewer than 16 pairs: not used yet
    for _ in range(400):
        a, b = base * np.exp(0.05 * rng.standard_normal(2))
        noise.add(a, b)
    assert 0.042 < noise.sigma() < 0.058
    before = noise.sigma()
    for _ in range(20):  # the routing jumped inside a neighbourhood: a median barely moves
        noise.add(4 * base, base)
    assert abs(noise.sigma() - before) < 0.2 * before


@pytest.mark.parametrize(
    "sigma, drop_sigmas, bar",
    [
        (0.05, 3.0, math.exp(3 * math.sqrt(2) * 0.05)),  # 1.236: the job's spread sets the bar
        (0.01, 3.0, 1.1),  # a quiet fabric: never tighter than 10%
        (0.2, 3.0, 1.5),  # a noisy one: never looser than drop_ratio
        (0.05, 0.0, 1.5),  # drop_sigmas 0: drop_ratio alone
        (None, 3.0, 1.5),  # spread not known yet
    ],
)
def test_drop_bar_follows_the_measured_spread(sigma, drop_sigmas, bar):
    sel = OnlineSelector(OnlineSettings(drop_sigmas=drop_sigmas), scales=SCALES)
    if sigma is not None:
        for _ in range(64):  # |log ratio| median = 0.6745 * sqrt(2) * sigma
            sel.noise.add(math.exp(0.6745 * math.sqrt(2) * sigma), 1.0)
    assert sel._drop_bar() == pytest.approx(bar, rel=1e-9)


def test_a_candidate_behind_by_more_than_the_spread_stops_after_one_probe():
    """RAIL 20% behind JOINT: with drop_ratio alone it gets both probes; once the job's spread
    is known to be 2% (bar 1.1), its first time stops it (a re-probe may still bring it back)."""
    times = dict(TRUE_S, **{Route.RAIL: 2.4e-3})

    def rail_probes(spread: bool) -> int:
        sel = OnlineSelector(OnlineSettings(reprobe_every=1000), scales=SCALES)
        if spread:
            for _ in range(32):
                sel.noise.add(math.exp(0.6745 * math.sqrt(2) * 0.02), 1.0)
        return [p for p, mode in run(sel, times, 12, stats(64)) if mode == "probe"].count(
            Route.RAIL
        )

    assert rail_probes(False) == 2
    assert rail_probes(True) == 1


def test_a_seeded_best_is_probed_at_once_not_waited_for():
    """Two layers that learned RAIL is fastest move to a new neighbourhood in the same step: the
    first probes RAIL there, and the second probes it too (its seed's best: waiting would run an
    untimed guess), instead of running JOINT while it waits for the first one's time."""
    from megatron_railwave.selector.online import SharedNeighbourhoods

    times = {Route.NATIVE: 4e-3, Route.RAIL: 1e-3, Route.PERM: 3e-3, Route.JOINT: 2e-3}
    shared = SharedNeighbourhoods()
    sels = [OnlineSelector(scales=SCALES, shared=shared, layer=i) for i in range(2)]
    prev: list = [None, None]
    last: list = [None, None]
    for step in range(14):
        descr = stats(64) if step < 13 else stats(1024)
        for i, sel in enumerate(sels):
            sel.observe(
                [
                    encode_timing(
                        None if prev[i] is None else times[prev[i]], expected=sel.expects_timing()
                    )
                ]
            )
            d = sel.decide("train", descr)
            prev[i], last[i] = d.path, (d.path, d.mode)
    assert last == [(Route.RAIL, "probe"), (Route.RAIL, "probe")]
