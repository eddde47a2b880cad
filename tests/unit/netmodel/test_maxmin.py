"""Hand-worked cases and invariants of the max-min flow engine and the incast model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_railwave.lab.netmodel import (
    FlowSet,
    IncastModel,
    Network,
    PhaseGraph,
    alpha_from_slowdowns,
    fit_incast_alpha,
    links_from_csr,
    maxmin,
    simulate,
)


def _net(*caps, rx=None):
    return Network(capacity_Bps_L=np.array(caps, dtype=float), receiver_port_L=rx)


def _flows(sizes, links, phase=None, sender=None):
    width = max(len(p) for p in links)
    table = np.array([list(p) + [-1] * (width - len(p)) for p in links])
    return FlowSet(
        size_bytes_F=np.array(sizes, dtype=float),
        links_FH=table,
        phase_F=None if phase is None else np.array(phase),
        sender_F=None if sender is None else np.array(sender),
    )


def test_simulate_two_flows_share_one_link():
    # Link 0: 100 B/s. Flows of 50 B and 150 B get 50 B/s each; the small one ends at
    # t=1, then the big one (100 B left) runs alone at 100 B/s and ends at t=2.
    res = simulate(_net(100.0), _flows([50, 150], [[0], [0]]), rel_tol=0.0)
    np.testing.assert_allclose(res.finish_s_F, [1.0, 2.0])
    assert res.makespan_s == pytest.approx(2.0)


def test_simulate_bottlenecked_flow_frees_capacity():
    # Links: A=0 (100 B/s), B=1 (30 B/s). f0 crosses A, f1 crosses A and B.
    # f1 is capped at 30 by B, so f0 gets 70 (not 50): sizes 70 and 30 both end at t=1.
    res = simulate(_net(100.0, 30.0), _flows([70, 30], [[0], [0, 1]]), rel_tol=0.0)
    np.testing.assert_allclose(res.finish_s_F, [1.0, 1.0])


def test_simulate_bottleneck_chain_three_levels():
    # Links 0 (10), 1 (100), 2 (100). f0: [0,1]; f1: [1,2]; f2: [2].
    # Level 1: link 0 saturates at 10 -> f0 = 10. Link 1 has 90 left for f1 alone,
    # link 2 offers 50 to f1 and f2 -> f1 = f2 = 50. Sizes chosen to end at t=1.
    res = simulate(
        _net(10.0, 100.0, 100.0), _flows([10, 50, 50], [[0, 1], [1, 2], [2]]), rel_tol=0.0
    )
    np.testing.assert_allclose(res.finish_s_F, [1.0, 1.0, 1.0])


def test_simulate_phases_run_in_order_with_latency():
    # One 100 B flow per phase on a 100 B/s link, chained, 0.5 s latency per phase,
    # plus 0.25 s extra on phase 2: starts 0.5, 2.0, 3.75; finishes 1.5, 3.0, 4.75.
    phases = PhaseGraph(depends_on=((), (0,), (1,)), latency_s_Q=np.array([0.0, 0.0, 0.25]))
    res = simulate(
        _net(100.0),
        _flows([100, 100, 100], [[0], [0], [0]], phase=[0, 1, 2]),
        phases,
        incast=IncastModel(per_phase_latency_s=0.5),
        rel_tol=0.0,
    )
    np.testing.assert_allclose(res.phase_start_s_Q, [0.5, 2.0, 3.75])
    np.testing.assert_allclose(res.phase_finish_s_Q, [1.5, 3.0, 4.75])
    np.testing.assert_allclose(res.finish_s_F, [1.5, 3.0, 4.75])


def test_simulate_join_waits_for_all_dependencies():
    # Phases 0 and 1 start at once (1 s and 2 s on separate links); phase 2 waits for both.
    phases = PhaseGraph(depends_on=((), (), (0, 1)))
    res = simulate(
        _net(100.0, 100.0),
        _flows([100, 200, 100], [[0], [1], [0]], phase=[0, 1, 2]),
        phases,
        rel_tol=0.0,
    )
    np.testing.assert_allclose(res.phase_start_s_Q, [0.0, 0.0, 2.0])
    np.testing.assert_allclose(res.finish_s_F, [1.0, 2.0, 3.0])


def test_simulate_empty_phase_and_zero_size_flow_complete_at_start():
    # Phase 1 has no flows; phase 2 holds a 0-byte flow and a 100 B flow. Latency 0.1 s.
    phases = PhaseGraph.chain(3)
    res = simulate(
        _net(100.0),
        _flows([100, 0, 100], [[0], [0], [0]], phase=[0, 2, 2]),
        phases,
        incast=IncastModel(per_phase_latency_s=0.1),
        rel_tol=0.0,
    )
    np.testing.assert_allclose(res.phase_start_s_Q, [0.1, 1.2, 1.3])
    np.testing.assert_allclose(res.phase_finish_s_Q, [1.1, 1.2, 2.3])
    np.testing.assert_allclose(res.finish_s_F, [1.1, 1.3, 2.3])


def test_simulate_incast_slows_k_to_one_by_expected_factor():
    # k=4 senders, own 100 B/s uplinks 0..3, one 100 B/s receiver port 4, 100 B each.
    # Max-min: 25 B/s each, done at 4 s. Incast alpha=0.25: C_eff = 100 / (1 + 0.25*3),
    # so every flow ends at 4 * 1.75 = 7 s.
    rx = np.array([False] * 4 + [True])
    net = _net(100.0, 100.0, 100.0, 100.0, 100.0, rx=rx)
    flows = _flows([100] * 4, [[s, 4] for s in range(4)])
    np.testing.assert_allclose(simulate(net, flows, rel_tol=0.0).finish_s_F, [4.0] * 4)
    slow = simulate(net, flows, incast=IncastModel(alpha=0.25), rel_tol=0.0)
    np.testing.assert_allclose(slow.finish_s_F, [7.0] * 4)
    # k_free=2: only 2 excess senders -> 4 * 1.5 = 6 s.
    free2 = simulate(net, flows, incast=IncastModel(alpha=0.25, k_free=2), rel_tol=0.0)
    np.testing.assert_allclose(free2.finish_s_F, [6.0] * 4)


def test_simulate_incast_tracks_k_as_senders_leave():
    # Receiver port 2 (100 B/s), senders on uplinks 0, 1 (100 B/s); sizes 50 and 150 B,
    # alpha = 1. k=2: C_eff = 50 -> 25 B/s each; flow 0 ends at 2 s (flow 1 has 100 B left).
    # Then k=1: full 100 B/s -> flow 1 ends at 3 s.
    rx = np.array([False, False, True])
    res = simulate(
        _net(100.0, 100.0, 100.0, rx=rx),
        _flows([50, 150], [[0, 2], [1, 2]]),
        incast=IncastModel(alpha=1.0),
        rel_tol=0.0,
    )
    np.testing.assert_allclose(res.finish_s_F, [2.0, 3.0])


def test_simulate_incast_counts_distinct_senders():
    # Two flows into port 1 from the same sender id: k=1, no penalty (both at 50 B/s).
    rx = np.array([False, True])
    flows = _flows([100, 100], [[0, 1], [0, 1]], sender=[7, 7])
    res = simulate(_net(100.0, 100.0, rx=rx), flows, incast=IncastModel(alpha=1.0), rel_tol=0.0)
    np.testing.assert_allclose(res.finish_s_F, [2.0, 2.0])
    flows = _flows([100, 100], [[0, 1], [0, 1]], sender=[7, 8])
    res = simulate(_net(100.0, 100.0, rx=rx), flows, incast=IncastModel(alpha=1.0), rel_tol=0.0)
    np.testing.assert_allclose(res.finish_s_F, [4.0, 4.0])


def test_simulate_incast_counts_grouped_identical_flows():
    # 4 identical flows (uplink 0 at 1000 B/s, receiver port 1 at 100 B/s, 100 B each) form
    # one class of weight 4, which still counts as k=4 senders: 4 * (1 + 0.25 * 3) = 7 s.
    # With one sender id for all four, k=1 and max-min gives 4 s.
    rx = np.array([False, True])
    net = _net(1000.0, 100.0, rx=rx)
    model = IncastModel(alpha=0.25)
    res = simulate(net, _flows([100] * 4, [[0, 1]] * 4), incast=model, rel_tol=0.0)
    assert res.num_classes == 1
    np.testing.assert_allclose(res.finish_s_F, [7.0] * 4)
    res = simulate(
        net, _flows([100] * 4, [[0, 1]] * 4, sender=[0, 1, 2, 3]), incast=model, rel_tol=0.0
    )
    np.testing.assert_allclose(res.finish_s_F, [7.0] * 4)
    res = simulate(net, _flows([100] * 4, [[0, 1]] * 4, sender=[5] * 4), incast=model, rel_tol=0.0)
    np.testing.assert_allclose(res.finish_s_F, [4.0] * 4)


def test_simulate_groups_identical_flows_into_classes():
    # 6 flows: 3 identical (link 0, 10 B), 2 identical (links 0+1, 10 B), 1 alone.
    flows = _flows([10, 10, 10, 10, 10, 20], [[0], [0], [0], [0, 1], [1, 0], [0]])
    res = simulate(_net(60.0, 60.0), flows, rel_tol=0.0)
    assert res.num_classes == 3
    # 6 flows share link 0 at 10 B/s: the 10 B flows end at 1 s, the 20 B one at 1 + 10/60.
    np.testing.assert_allclose(res.finish_s_F, [1.0] * 5 + [1.0 + 10.0 / 60.0])


def test_links_from_csr_pads_with_minus_one():
    table = links_from_csr(np.array([0, 1, 3, 3 + 0]), np.array([4, 1, 2]))
    np.testing.assert_array_equal(table, [[4, -1], [1, 2], [-1, -1]])


def test_simulate_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"link id 3 but the network has 2 links"):
        simulate(_net(1.0, 1.0), _flows([1], [[3]]))
    with pytest.raises(ValueError, match=r"phase 1 but the phase graph has 1 phases"):
        simulate(_net(1.0), _flows([1], [[0]], phase=[1]))
    with pytest.raises(ValueError, match=r"cycle through phases \[0, 1\]"):
        PhaseGraph(depends_on=((1,), (0,)))
    with pytest.raises(ValueError, match=r"flows \[0\] have none"):
        _flows([1], [[-1]])
    with pytest.raises(ValueError, match=r"flows \[0\] repeat a link"):
        _flows([1], [[0, 0]])
    with pytest.raises(
        ValueError, match=r"capacity_Bps_L must be finite and > 0; links \[1\] have \[0.0\]"
    ):
        _net(1.0, 0.0)
    with pytest.raises(ValueError, match=r"IncastModel.alpha must be a finite number >= 0, got -1"):
        IncastModel(alpha=-1)
    with pytest.raises(ValueError, match=r"rel_tol must be in \[0, 0.1\], got 0.5"):
        simulate(_net(1.0), _flows([1], [[0]]), rel_tol=0.5)


def test_incast_model_off_is_pure_max_min():
    off = IncastModel.off()
    assert not off.penalizes and off.per_phase_latency_s == 0.0
    np.testing.assert_allclose(off.capacity_factor(np.array([1, 5, 100])), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(
        IncastModel(alpha=0.5).slowdown(np.array([0, 1, 3])), [1.0, 1.0, 2.0]
    )


def test_alpha_from_slowdowns_recovers_linear_model():
    k = np.array([1, 2, 3, 4])
    assert alpha_from_slowdowns(k, 1.0 + 0.3 * (k - 1)) == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"num_senders > k_free=1"):
        alpha_from_slowdowns([1, 1], [1.0, 1.0])


def test_fit_incast_alpha_through_the_engine_recovers_alpha():
    # Calibration set: k-to-1 patterns for k = 2, 3, 4 measured with alpha = 0.4.
    def k_to_one(k):
        rx = np.array([False] * k + [True])
        return _net(*([100.0] * (k + 1)), rx=rx), _flows([100] * k, [[s, k] for s in range(k)])

    cases = [k_to_one(k) for k in (2, 3, 4)]

    def predict(model):
        return np.array([simulate(n, f, incast=model, rel_tol=0.0).makespan_s for n, f in cases])

    measured = predict(IncastModel(alpha=0.4, per_phase_latency_s=0.0))
    fitted = fit_incast_alpha(predict, measured, bounds=(0.0, 2.0), tol=1e-6)
    assert fitted.alpha == pytest.approx(0.4, abs=1e-4)


@st.composite
def _flow_problems(draw):
    num_links = draw(st.integers(1, 5))
    caps = draw(st.lists(st.integers(1, 20), min_size=num_links, max_size=num_links))
    num_flows = draw(st.integers(1, 10))
    links, sizes = [], []
    for _ in range(num_flows):
        path = draw(st.lists(st.integers(0, num_links - 1), min_size=1, max_size=3, unique=True))
        links.append(path)
        sizes.append(draw(st.integers(0, 50)))
    num_phases = draw(st.integers(1, 3))
    phase = draw(st.lists(st.integers(0, num_phases - 1), min_size=num_flows, max_size=num_flows))
    chained = draw(st.booleans())
    rx = np.array(draw(st.lists(st.booleans(), min_size=num_links, max_size=num_links)))
    alpha = draw(st.sampled_from([0.0, 0.5]))
    latency = draw(st.sampled_from([0.0, 0.3]))
    rel_tol = draw(st.sampled_from([0.0, 0.0, 1e-2]))
    indexed = draw(st.booleans())
    return caps, sizes, links, phase, num_phases, chained, rx, alpha, latency, rel_tol, indexed


@settings(max_examples=150, deadline=None)
@given(_flow_problems())
def test_simulate_invariants_hold_on_random_flow_sets(problem):
    caps, sizes, links, phase, num_phases, chained, rx, alpha, latency, rel_tol, indexed = problem
    if indexed:  # force the link-indexed water-filling, normally used only on large sets
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(maxmin, "_INDEXED_MIN_ENTRIES", 0)
        try:
            _check_invariants(
                caps, sizes, links, phase, num_phases, chained, rx, alpha, latency, rel_tol
            )
        finally:
            monkeypatch.undo()
    else:
        _check_invariants(
            caps, sizes, links, phase, num_phases, chained, rx, alpha, latency, rel_tol
        )


def _check_invariants(caps, sizes, links, phase, num_phases, chained, rx, alpha, latency, rel_tol):
    net = _net(*caps, rx=rx)
    flows = _flows(sizes, links, phase=phase)
    phases = PhaseGraph.chain(num_phases) if chained else PhaseGraph.independent(num_phases)
    model = IncastModel(alpha=alpha, per_phase_latency_s=latency)
    res = simulate(net, flows, phases, incast=model, rel_tol=rel_tol, record_trace=True)
    size_F = flows.size_bytes_F
    start_F = res.phase_start_s_Q[flows.phase_F]

    # Every flow completes, not before its phase starts nor faster than its slowest link.
    assert np.all(np.isfinite(res.finish_s_F))
    min_cap_F = np.array([min(caps[l] for l in path) for path in links])
    assert np.all(res.finish_s_F >= start_F + size_F / min_cap_F * (1 - 1e-9))
    # A phase finishes with its last flow (or at its start when it is empty).
    for q in range(num_phases):
        in_q = flows.phase_F == q
        expect = max(res.finish_s_F[in_q].max(initial=-np.inf), res.phase_start_s_Q[q])
        assert res.phase_finish_s_Q[q] == pytest.approx(expect)
    if chained:
        assert np.all(res.phase_start_s_Q[1:] >= res.phase_finish_s_Q[:-1] + latency - 1e-12)
    if rel_tol > 0:  # batching: the per-interval checks below hold only for exact runs
        exact = simulate(net, flows, phases, incast=model, rel_tol=0.0)
        np.testing.assert_allclose(res.finish_s_F, exact.finish_s_F, rtol=10 * rel_tol)
        return

    sent_F = np.zeros_like(size_F)
    for seg in res.trace:
        dt = seg.end_s - seg.start_s
        assert dt >= 0
        sent_F += seg.rate_Bps_F * dt
        load_L = np.zeros(len(caps))
        for f, path in enumerate(links):
            load_L[path] += seg.rate_Bps_F[f]
        # No link is over its (incast-reduced) capacity at any moment.
        assert np.all(load_L <= seg.capacity_Bps_L * (1 + 1e-9))
        assert np.all(seg.capacity_Bps_L <= np.array(caps, dtype=float) * (1 + 1e-12))
        # Max-min: every active flow has a saturated link on which its rate is the largest.
        saturated = load_L >= seg.capacity_Bps_L * (1 - 1e-9)
        for f, path in enumerate(links):
            r = seg.rate_Bps_F[f]
            if r == 0:
                continue
            assert any(
                saturated[l]
                and all(seg.rate_Bps_F[g] <= r * (1 + 1e-9) for g, p in enumerate(links) if l in p)
                for l in path
            ), f"flow {f} has no bottleneck link"
    # Total bytes conserved: what each flow was sent over time equals its size.
    np.testing.assert_allclose(sent_F, size_F, rtol=1e-9, atol=1e-9)
    assert sent_F.sum() == pytest.approx(size_F.sum(), rel=1e-9, abs=1e-9)


def _rail_all_to_all(num_nodes, gpus, *, waves, seed=0):
    # GPU (s, l) -> GPU (d, l) for all d != s; uplink s*G+l, downlink N*G + d*G+l.
    rng = np.random.default_rng(seed)
    world = num_nodes * gpus
    src = np.repeat(np.arange(num_nodes), (num_nodes - 1) * gpus)
    shift = np.tile(np.repeat(np.arange(1, num_nodes), gpus), num_nodes)
    rail = np.tile(np.arange(gpus), num_nodes * (num_nodes - 1))
    dst = (src + shift) % num_nodes
    flows = FlowSet(
        size_bytes_F=rng.integers(1, 100, size=src.size) * 1e4,
        links_FH=np.stack([src * gpus + rail, world + dst * gpus + rail], axis=1),
        phase_F=shift - 1 if waves else None,
    )
    phases = PhaseGraph.chain(num_nodes - 1) if waves else None
    return Network(capacity_Bps_L=np.full(2 * world, 1e9)), flows, phases


@pytest.mark.parametrize("waves", [False, True])
def test_simulate_batching_stays_close_to_exact(waves):
    net, flows, phases = _rail_all_to_all(8, 4, waves=waves)
    exact = simulate(net, flows, phases, rel_tol=0.0)
    for rel_tol, bound in ((1e-3, 5e-3), (1e-2, 5e-2)):
        fast = simulate(net, flows, phases, rel_tol=rel_tol)
        assert fast.num_events <= exact.num_events
        np.testing.assert_allclose(fast.finish_s_F, exact.finish_s_F, rtol=bound)
        assert fast.makespan_s == pytest.approx(exact.makespan_s, rel=rel_tol)
        if waves:  # flows of a wave share no link: batching changes nothing
            np.testing.assert_allclose(fast.finish_s_F, exact.finish_s_F, rtol=1e-12)


@pytest.mark.parametrize("waves", [False, True])
def test_simulate_indexed_and_plain_water_filling_agree(waves, monkeypatch):
    net, flows, phases = _rail_all_to_all(8, 4, waves=waves, seed=3)
    rx = np.zeros(net.num_links, dtype=bool)
    rx[net.num_links // 2 :] = True
    net = Network(capacity_Bps_L=net.capacity_Bps_L, receiver_port_L=rx)
    model = IncastModel(alpha=0.2, per_phase_latency_s=1e-6)
    plain = simulate(net, flows, phases, incast=model, rel_tol=1e-3)
    monkeypatch.setattr(maxmin, "_INDEXED_MIN_ENTRIES", 0)
    indexed = simulate(net, flows, phases, incast=model, rel_tol=1e-3)
    np.testing.assert_allclose(indexed.finish_s_F, plain.finish_s_F, rtol=1e-9)
    np.testing.assert_allclose(indexed.phase_finish_s_Q, plain.phase_finish_s_Q, rtol=1e-9)
