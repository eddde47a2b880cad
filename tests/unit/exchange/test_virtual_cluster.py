"""The exchange's rank programs on the in-process virtual cluster: the four paths bitwise equal,
the dense closed form within 1e-5 (fp32), one host sync per layer and rank, phases posted after
their dependencies, and the bytes moved equal to the schedule's; in fixed-capacity mode
(max_tokens_per_rank) no host sync at all, results bitwise equal to the normal mode, the padded
expert layout, fixed bytes, and the overflow / bad-input errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_railwave.exchange import VirtualCluster, virtual_rank_groups
from megatron_railwave.lab.bench.sync_audit import SyncAudit
from megatron_railwave.lab.bench.virtual_exchange import (
    VirtualSpec,
    dense_reference,
    make_virtual_inputs,
    run_virtual_layer,
)
from megatron_railwave.names import ROUTES
from megatron_railwave.planner import PlanOptions, schedule_from_windows
from megatron_railwave.topology import RailTopology

PATHS = tuple(map(str, ROUTES))


def _uneven_inputs(spec: VirtualSpec, tokens: list[int], skip_nodes: dict[int, list[int]]) -> dict:
    """Per-rank token counts (zero allowed) and ranks that route to no expert of some nodes."""
    inputs = make_virtual_inputs(spec)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    e, n = spec.experts, spec.topology.num_nodes
    per_node = e // n
    for r, t in enumerate(tokens):
        scores = torch.rand(t, e, generator=gen)
        for node in skip_nodes.get(r, []):
            scores[:, node * per_node : (node + 1) * per_node] = -1.0
        idx = scores.topk(spec.topk, dim=1).indices
        rm = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
        inputs["routing"][r] = rm
        inputs["probs"][r] = torch.softmax(torch.randn(t, e, generator=gen), dim=1) * rm
        inputs["hidden"][r] = torch.randn(t, spec.hidden, generator=gen).to(spec.torch_dtype)
        inputs["grad_out"][r] = torch.randn(t, spec.hidden, generator=gen).to(spec.torch_dtype)
    return inputs


CASES = {
    "2x2-fp32": (
        VirtualSpec(
            topology=RailTopology(num_nodes=2, gpus_per_node=2),
            tokens=24,
            hidden=8,
            experts=8,
            topk=3,
            seed=1,
        ),
        None,
    ),
    "4x2-uneven-failed-rail": (
        VirtualSpec(
            topology=RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            tokens=0,
            hidden=8,
            experts=16,
            topk=4,
            seed=2,
        ),
        ([20, 0, 33, 7, 16, 25, 1, 12], {2: [1, 3], 5: [0], 7: [2, 3, 1]}),
    ),
    "3x3-bf16": (
        VirtualSpec(
            topology=RailTopology(num_nodes=3, gpus_per_node=3),
            tokens=17,
            hidden=16,
            experts=18,
            topk=5,
            dtype="bf16",
            seed=3,
        ),
        None,
    ),
    "1x4-one-node": (
        VirtualSpec(
            topology=RailTopology(num_nodes=1, gpus_per_node=4),
            tokens=12,
            hidden=8,
            experts=8,
            topk=2,
            seed=4,
        ),
        None,
    ),
    "3x1-one-gpu-per-node": (
        VirtualSpec(
            topology=RailTopology(num_nodes=3, gpus_per_node=1),
            tokens=12,
            hidden=8,
            experts=6,
            topk=2,
            seed=5,
        ),
        None,
    ),
    "4x2-fanin2-windows": (
        VirtualSpec(
            topology=RailTopology(num_nodes=4, gpus_per_node=2),
            tokens=14,
            hidden=8,
            experts=8,
            topk=3,
            seed=6,
            options=PlanOptions(
                fanin=2,
                windows=schedule_from_windows(
                    4,
                    [
                        [(0, 1), (1, 0), (2, 3), (3, 2)],
                        [(0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1), (3, 0), (3, 1)],
                    ],
                ),
            ),
        ),
        None,
    ),
    # Rail chunks (PERM / JOINT; NATIVE / RAIL keep whole windows): 3 per wave with a failed rail,
    # uneven and empty ranks; 2 per wave in bf16 with 3 GPUs per node.
    "4x2-uneven-failed-rail-chunks3": (
        VirtualSpec(
            topology=RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            tokens=0,
            hidden=8,
            experts=16,
            topk=4,
            seed=2,
            options=PlanOptions(chunks=3),
        ),
        ([20, 0, 33, 7, 16, 25, 1, 12], {2: [1, 3], 5: [0], 7: [2, 3, 1]}),
    ),
    "3x3-bf16-chunks2": (
        VirtualSpec(
            topology=RailTopology(num_nodes=3, gpus_per_node=3),
            tokens=17,
            hidden=16,
            experts=18,
            topk=5,
            dtype="bf16",
            seed=3,
            options=PlanOptions(chunks=2),
        ),
        None,
    ),
    # Streamed relay (relay phase u carries what rail phase u sends): whole waves (JOINT's waves
    # stream, RAIL has one rail phase), and 3 chunks with a failed rail and uneven ranks (RAIL and
    # FLOW stream over their chunks too).
    "3x3-bf16-streamed": (
        VirtualSpec(
            topology=RailTopology(num_nodes=3, gpus_per_node=3),
            tokens=17,
            hidden=16,
            experts=18,
            topk=5,
            dtype="bf16",
            seed=3,
            options=PlanOptions(streamed=True),
        ),
        None,
    ),
    "4x2-uneven-failed-rail-streamed-chunks3": (
        VirtualSpec(
            topology=RailTopology(num_nodes=4, gpus_per_node=2, failed_rails=frozenset({(1, 0)})),
            tokens=0,
            hidden=8,
            experts=16,
            topk=4,
            seed=2,
            options=PlanOptions(chunks=3, streamed=True),
        ),
        ([20, 0, 33, 7, 16, 25, 1, 12], {2: [1, 3], 5: [0], 7: [2, 3, 1]}),
    ),
}


def _inputs(name: str) -> tuple[VirtualSpec, dict]:
    spec, uneven = CASES[name]
    return spec, (_uneven_inputs(spec, *uneven) if uneven else make_virtual_inputs(spec))


@pytest.mark.parametrize("name", list(CASES))
def test_paths_bitwise_equal_and_match_dense_reference(name):
    spec, inputs = _inputs(name)
    results = {path: run_virtual_layer(spec, inputs, path) for path in PATHS}
    limit = 1e-5 if spec.dtype == "fp32" else 2e-2
    for r in range(spec.topology.world_size):
        ref = dense_reference(spec, inputs, r)
        for key in ("out", "grad_hidden", "grad_probs"):
            base = results["native"][key][r]
            assert base.shape == ref[key].shape
            for path in PATHS:
                got = results[path][key][r]
                assert torch.equal(got, base), (
                    f"rank {r} {key}: {path} is not bitwise equal to native"
                )
            if not base.numel():
                continue
            scale = ref[key].abs().max().item() or 1.0
            err = (base.double() - ref[key]).abs().max().item() / scale
            assert err <= limit, f"rank {r} {key}: relative error {err:.3g} > {limit}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "name", ["4x2-uneven-failed-rail", "3x3-bf16", "4x2-uneven-failed-rail-streamed-chunks3"]
)
def test_one_host_sync_per_layer_and_rank(name, path):
    spec, inputs = _inputs(name)
    with SyncAudit() as audit:
        audit.mark(
            *inputs["hidden"],
            *inputs["probs"],
            *inputs["routing"],
            *inputs["grad_out"],
            inputs["maps_EHH"],
        )
        run_virtual_layer(spec, inputs, path)
    # Forward and backward of dispatch and combine: only the count exchange's copy to the host.
    assert audit.count == spec.topology.world_size, [(e.name, e.where) for e in audit.events]
    assert {e.name for e in audit.events} == {"cpu"}


def test_sync_audit_counts_a_sync_added_to_the_exchange(monkeypatch):
    """The audit catches a sync: a .tolist() on device data inside the exchange is counted."""
    import megatron_railwave.exchange.layer as layer

    spec, inputs = _inputs("2x2-fp32")
    original = layer._expand

    def expand_with_sync(meta_C, ctx, handle):
        meta_C[:, 0].tolist()
        return original(meta_C, ctx, handle)

    monkeypatch.setattr(layer, "_expand", expand_with_sync)
    with SyncAudit() as audit:
        audit.mark(
            *inputs["hidden"],
            *inputs["probs"],
            *inputs["routing"],
            *inputs["grad_out"],
            inputs["maps_EHH"],
        )
        run_virtual_layer(spec, inputs, "joint")
    assert audit.count == 2 * spec.topology.world_size


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "name",
    [
        "4x2-uneven-failed-rail",
        "4x2-uneven-failed-rail-chunks3",
        "4x2-uneven-failed-rail-streamed-chunks3",
    ],
)
def test_phases_wait_for_dependencies_and_move_the_scheduled_bytes(name, path):
    spec, inputs = _inputs(name)
    cluster = VirtualCluster(world_size=spec.topology.world_size)
    out = run_virtual_layer(spec, inputs, path, cluster=cluster)
    for r, handle in enumerate(out["handles"]):
        sched = handle.schedule
        events = [(e.stage, e.event) for e in cluster.events if e.rank == r]
        # Each program run posts every phase of its direction once and completes it once.
        for p in sched.phases:
            posts = [i for i, ev in enumerate(events) if ev == (p.name, "post")]
            assert len(posts) == 2, (p.name, events)  # forward run and backward run
            for post in posts:
                for dep in p.depends_on:
                    name = sched.phases[dep].name
                    done_before = [
                        i for i, ev in enumerate(events[:post]) if ev == (name, "complete")
                    ]
                    posted_before = [
                        i for i, ev in enumerate(events[:post]) if ev == (name, "post")
                    ]
                    assert len(done_before) == len(posted_before) >= 1, (p.name, "before", name)
        # Bytes: dispatch phases carry the dispatch rows forward and the combine rows in combine's
        # backward; combine phases the combine rows forward and the dispatch-grad rows backward.
        fwd, bwd = sched.rank_bytes(r), sched.rank_bytes(r, backward=True)
        for p in sched.phases:
            want_sent = fwd["sent"][p.index] + bwd["sent"][p.index]
            want_received = fwd["received"][p.index] + bwd["received"][p.index]
            assert cluster.bytes_sent[r].get(p.name, 0) == want_sent, (r, p.name)
            assert cluster.bytes_received[r].get(p.name, 0) == want_received, (r, p.name)


# ---------------------------------------------------------------------------- fixed capacity
# max_tokens_per_rank = C: the capacity plan's buffers, no host sync, results equal to the normal
# mode.


def _fixed(spec: VirtualSpec, inputs: dict, slack: int = 3) -> VirtualSpec:
    """The spec in fixed-capacity mode, C a little above the largest T of the case's ranks."""
    return dataclasses.replace(
        spec, max_tokens_per_rank=max(h.shape[0] for h in inputs["hidden"]) + slack
    )


def _mark_inputs(audit: SyncAudit, inputs: dict) -> None:
    audit.mark(
        *inputs["hidden"],
        *inputs["probs"],
        *inputs["routing"],
        *inputs["grad_out"],
        inputs["maps_EHH"],
    )


@pytest.mark.parametrize("name", list(CASES))
def test_fixed_capacity_equals_normal_mode_bitwise_on_every_path(name):
    spec, inputs = _inputs(name)
    fixed = _fixed(spec, inputs)
    for path in PATHS:
        normal = run_virtual_layer(spec, inputs, path)
        got = run_virtual_layer(fixed, inputs, path)
        for r in range(spec.topology.world_size):
            assert torch.equal(got["tokens_per_expert"][r].cpu(), normal["tokens_per_expert"][r]), (
                path,
                r,
            )
            for key in ("out", "grad_hidden", "grad_probs"):
                assert got[key][r].shape == normal[key][r].shape
                assert torch.equal(got[key][r], normal[key][r]), (
                    f"{path} rank {r} {key}: fixed capacity != normal"
                )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "name", ["4x2-uneven-failed-rail", "3x3-bf16", "4x2-uneven-failed-rail-streamed-chunks3"]
)
def test_fixed_capacity_needs_no_host_sync(name, path):
    spec, inputs = _inputs(name)
    fixed = _fixed(spec, inputs)
    run_virtual_layer(
        fixed, inputs, path
    )  # first call: builds the cached capacity plan (host work)
    with SyncAudit() as audit:
        _mark_inputs(audit, inputs)
        run_virtual_layer(fixed, inputs, path)
    # Forward and backward of dispatch and combine, every rank, and the experts: nothing reads
    # device data back (not even the first call's cache build touches routing data).
    assert audit.count == 0, [(e.name, e.where) for e in audit.events]


def test_sync_audit_counts_a_sync_added_to_the_fixed_capacity_mode(monkeypatch):
    """The audit sees the fixed mode's device data: a .tolist() on the slot tokens is counted."""
    import megatron_railwave.exchange.layer as layer

    spec, inputs = _inputs("2x2-fp32")
    original = layer.slot_tokens

    def slot_tokens_with_sync(routing_map, num_nodes, capacity):
        out = original(routing_map, num_nodes, capacity)
        out.tolist()
        return out

    monkeypatch.setattr(layer, "slot_tokens", slot_tokens_with_sync)
    with SyncAudit() as audit:
        _mark_inputs(audit, inputs)
        run_virtual_layer(_fixed(spec, inputs), inputs, "perm")
    assert audit.count == spec.topology.world_size


def test_fixed_capacity_padded_layout_and_fixed_bytes():
    """Entries of expert e are rows [e * W * C, e * W * C + tokens_per_expert[e]) in the normal
    mode's order, padding rows are zero, and the bytes moved are the capacity schedule's: the
    same for any routing."""
    spec, inputs = _inputs("4x2-uneven-failed-rail")
    fixed = _fixed(spec, inputs)
    w, c = spec.topology.world_size, fixed.max_tokens_per_rank
    e_loc = spec.experts // w
    sent = []
    other = _uneven_inputs(
        dataclasses.replace(spec, seed=7), [5, 36, 0, 2, 30, 1, 0, 9], {0: [0, 1, 2]}
    )
    for case_inputs in (inputs, other):
        cluster = VirtualCluster(world_size=w)
        out = run_virtual_layer(fixed, case_inputs, "joint", cluster=cluster)
        sent.append(cluster.bytes_sent)
        for r, handle in enumerate(out["handles"]):
            sched = handle.schedule
            fwd, bwd = sched.rank_bytes(r), sched.rank_bytes(r, backward=True)
            for p in sched.phases:
                assert (
                    cluster.bytes_sent[r].get(p.name, 0)
                    == fwd["sent"][p.index] + bwd["sent"][p.index]
                )
                assert (
                    cluster.bytes_received[r].get(p.name, 0)
                    == fwd["received"][p.index] + bwd["received"][p.index]
                )
    assert sent[0] == sent[1]

    # The dispatched rows themselves, rank by rank, against the normal mode's.
    from megatron_railwave.exchange import (
        RankContext,
        dispatch_forward,
        gather_demand,
        prepare_capacity_layer,
        prepare_layer,
        virtual_rank_groups,
    )
    from megatron_railwave.planner import build_plan

    topo = spec.topology
    ctxs = [
        RankContext(
            topo=topo,
            groups=virtual_rank_groups(topo, r),
            num_experts=spec.experts,
            options=spec.options,
        )
        for r in range(w)
    ]
    h, p, rm = inputs["hidden"], inputs["probs"], inputs["routing"]
    cluster = VirtualCluster(world_size=w)
    layers = cluster.run([gather_demand(ctxs[r], h[r], p[r], rm[r]) for r in range(w)])
    normal = [
        prepare_layer(
            ctxs[r],
            layers[r],
            build_plan(layers[r].demand, topo, "rail"),
            hidden_dtype=h[r].dtype,
            probs_dtype=p[r].dtype,
            hidden_size=spec.hidden,
        )
        for r in range(w)
    ]
    padded = [
        prepare_capacity_layer(ctxs[r], h[r], p[r], rm[r], path="rail", capacity=c)
        for r in range(w)
    ]
    assert (
        padded[0].schedule
        is prepare_capacity_layer(ctxs[0], h[0], p[0], rm[0], path="rail", capacity=c).schedule
    )  # planned once, cached
    want = cluster.run([dispatch_forward(ctxs[r], normal[r], h[r], p[r], rm[r]) for r in range(w)])
    got = cluster.run([dispatch_forward(ctxs[r], padded[r], h[r], p[r], rm[r]) for r in range(w)])
    for r in range(w):
        tokens, probs, entries = got[r]
        assert tokens.shape == (e_loc * w * c, spec.hidden) and probs.shape == (e_loc * w * c,)
        counts = normal[r].tokens_per_expert.tolist()
        assert entries.tokens_per_expert.tolist() == counts
        start = 0
        for e, n_e in enumerate(counts):
            block = slice(e * w * c, (e + 1) * w * c)
            assert torch.equal(tokens[block][:n_e], want[r][0][start : start + n_e]), (r, e)
            assert torch.equal(probs[block][:n_e], want[r][1][start : start + n_e]), (r, e)
            assert not tokens[block][n_e:].any() and not probs[block][n_e:].any(), (r, e)
            start += n_e


def test_fixed_capacity_overflow_and_bad_input_raise_before_any_communication():
    from megatron_railwave.exchange import (
        CapacityOverflowError,
        InputError,
        RankContext,
        check_capacity,
        prepare_capacity_layer,
        virtual_rank_groups,
    )

    spec, inputs = _inputs("2x2-fp32")  # T = 24
    topo = spec.topology
    ctx = RankContext(
        topo=topo,
        groups=virtual_rank_groups(topo, 3),
        num_experts=spec.experts,
        options=spec.options,
    )
    h, p, rm = inputs["hidden"][3], inputs["probs"][3], inputs["routing"][3]
    with pytest.raises(
        CapacityOverflowError,
        match=r"EP rank 3: 24 tokens in this layer call exceed "
        r"max_tokens_per_rank=20 .*at least 24",
    ):
        prepare_capacity_layer(ctx, h, p, rm, path="joint", capacity=20)
    with pytest.raises(InputError, match=r"EP rank 3: routing_map has dtype torch.float32"):
        prepare_capacity_layer(ctx, h, p, rm.float(), path="joint", capacity=24)
    handle = prepare_capacity_layer(ctx, h, p, rm, path="joint", capacity=24)  # T == C is fine
    assert handle.capacity == 24 and handle.num_entries == 2 * 4 * 24
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            check_capacity(bad)
    with pytest.raises(ValueError, match="--tokens 24 exceeds --max-tokens-per-rank 8"):
        dataclasses.replace(spec, max_tokens_per_rank=8)


def test_capacity_cache_keys_on_every_plan_option():
    """Two exchanges that differ only in rail chunks get their own capacity plans (the cache key
    covers every PlanOptions field)."""
    from megatron_railwave.exchange.capacity import capacity_layer
    from megatron_railwave.schedule import RecordWireFormat

    topo = RailTopology(num_nodes=3, gpus_per_node=2)
    wire = RecordWireFormat(
        hidden=8, payload_dtype=torch.float32, probs_dtype=torch.float32, experts_per_node=4
    )
    whole = capacity_layer(topo, "joint", 4, PlanOptions(), wire, 0, torch.device("cpu"))
    chunked = capacity_layer(topo, "joint", 4, PlanOptions(chunks=3), wire, 0, torch.device("cpu"))
    assert whole.schedule.plan.chunks == 1 and chunked.schedule.plan.chunks == 3
    assert (
        capacity_layer(topo, "joint", 4, PlanOptions(chunks=3), wire, 0, torch.device("cpu"))
        is chunked
    )


def test_fixed_capacity_padding_is_left_out_of_every_segment_sum(monkeypatch):
    # The old code summed all padding rows into one extra segment (n_copy, or token T) that one
    # SM walks on CUDA: far more rows than the max_segment_len the caller states. Padding now
    # carries an out-of-range id, so every in-range segment keeps within that bound.
    import megatron_railwave.exchange.layer as layer

    real = layer.ops.segment_sum
    calls = []

    def recording(values, ids, num_segments, **kw):
        in_range = ids[(ids >= 0) & (ids < num_segments)]
        longest = int(torch.bincount(in_range, minlength=1).max()) if in_range.numel() else 0
        calls.append(
            (longest, kw.get("max_segment_len"), num_segments, int(ids.numel() - in_range.numel()))
        )
        return real(values, ids, num_segments, **kw)

    monkeypatch.setattr(layer.ops, "segment_sum", recording)
    spec, inputs = _inputs("3x3-bf16")
    fixed = _fixed(spec, inputs, slack=20)
    run_virtual_layer(fixed, inputs, "joint")
    assert calls and all(longest <= bound for longest, bound, _, _ in calls if bound is not None), (
        calls
    )
    assert any(left_out for *_, left_out in calls)  # the padding rows were there, and left out


def test_fixed_capacity_warns_once_with_the_numbers_above_the_stated_multiple():
    import warnings

    from megatron_railwave.exchange import build_exchange
    from megatron_railwave.exchange.capacity import _PADDING_WARNED, PADDING_WARN_MULTIPLE

    _PADDING_WARNED.clear()
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    # E = 32, top-2: E_loc * W * C = 32 * 8 = 256 padded rows per rank vs C * K = 16: 16x > 4x.
    kwargs = dict(
        backend="torch",
        num_experts=32,
        topk=2,
        hidden_size=64,
        hidden_dtype=torch.bfloat16,
        max_tokens_per_rank=8,
    )
    with pytest.warns(
        UserWarning, match=r"256 rows .*where a full batch has 16 .*: 16x, over the 4x"
    ):
        build_exchange(topo, virtual_rank_groups(topo, 0), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        build_exchange(topo, virtual_rank_groups(topo, 1), **kwargs)
        # E = 8, top-2: 4x, at the limit: no warning.
        build_exchange(topo, virtual_rank_groups(topo, 0), **{**kwargs, "num_experts": 8})
    assert PADDING_WARN_MULTIPLE == 4


def test_cuda_sync_count_leaves_the_harness_out(monkeypatch):
    # On CUDA the count is the sync debug mode's warnings. The harness's own blocking copies
    # (the experts' host-to-device index maps) used to be counted with the exchange's. Faked on
    # CPU: a fake debug mode, and the harness's experts warn like a synchronising call would.
    import warnings

    import megatron_railwave.lab.bench.virtual_exchange as vx

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__("now", m))
    real_experts = vx._experts

    def syncing_experts(*args, **kwargs):
        if mode["now"] == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return real_experts(*args, **kwargs)

    monkeypatch.setattr(vx, "_experts", syncing_experts)
    spec, inputs = _inputs("3x3-bf16")
    assert (
        vx._count_cuda_syncs(spec, inputs, "joint") == 0
    )  # the exchange itself: no warning on CPU
    assert mode["now"] == 0  # the mode is restored


def test_fixed_capacity_caches_built_in_inference_mode_serve_training():
    # A first layer call under torch.inference_mode() (an eval before training) builds the
    # capacity plan's cached index maps; they must not be inference tensors, or the training
    # layer that reuses them fails to save them for backward.
    from megatron_railwave.exchange import capacity

    spec, inputs = _inputs("3x3-bf16")
    fixed = _fixed(spec, inputs, slack=11)
    capacity._LAYERS.clear()
    capacity._SCHEDULES.clear()
    with torch.inference_mode():
        run_virtual_layer(fixed, inputs, "joint")
    cached = list(capacity._LAYERS.values())
    assert cached
    for layer in cached:
        for f in dataclasses.fields(layer.layout):
            value = getattr(layer.layout, f.name)
            if isinstance(value, torch.Tensor):
                assert not value.is_inference(), f.name
    hidden = [h.clone().requires_grad_(True) for h in inputs["hidden"]]
    run_virtual_layer(fixed, {**inputs, "hidden": hidden}, "joint")  # training after eval: works


def test_timing_words_ride_in_the_status_word_at_no_extra_bytes():
    """Every rank gets every rank's timing word (times, codes, the extremes) from the count
    exchange, the message is no longer for it, and a bad input is still reported with it."""
    from megatron_railwave.exchange import RankContext, gather_demand, virtual_rank_groups
    from megatron_railwave.exchange.layer import TIMING_WORD_MAX, TIMING_WORD_MIN, count_row_words
    from megatron_railwave.selector.online import (
        TIMING_MAX_NS,
        TIMING_MISSING,
        TIMING_NAN,
        TIMING_NEGATIVE,
        TIMING_NONE,
        TIMING_STALLED,
        encode_timing,
    )

    spec, inputs = _inputs("4x2-uneven-failed-rail")
    topo, w = spec.topology, spec.topology.world_size
    ctxs = [
        RankContext(
            topo=topo,
            groups=virtual_rank_groups(topo, r),
            num_experts=spec.experts,
            options=spec.options,
        )
        for r in range(w)
    ]
    h, p, rm = inputs["hidden"], inputs["probs"], inputs["routing"]
    assert (
        TIMING_MAX_NS <= TIMING_WORD_MAX
        and min(TIMING_MISSING, TIMING_NAN, TIMING_NEGATIVE, TIMING_STALLED) >= TIMING_WORD_MIN
    )
    words = [
        encode_timing(1e9 * 86400 * 365, expected=True),
        TIMING_MISSING,
        TIMING_NAN,
        TIMING_NEGATIVE,
        TIMING_STALLED,
        TIMING_NONE,
        1,
        123_456_789,
    ]
    assert words[0] == TIMING_MAX_NS
    cluster = VirtualCluster(world_size=w)
    plain = cluster.run([gather_demand(ctxs[r], h[r], p[r], rm[r]) for r in range(w)])
    timed = VirtualCluster(world_size=w).run(
        [gather_demand(ctxs[r], h[r], p[r], rm[r], timing_word=words[r]) for r in range(w)]
    )
    for r in range(w):
        assert plain[r].timing_W is None
        assert list(timed[r].timing_W) == words and timed[r].timing_W[2:4] == words[2:4]
        assert (timed[r].timing_W.lowest, timed[r].timing_W.highest) == (min(words), max(words))
        assert torch.equal(timed[r].demand.records_WN, plain[r].demand.records_WN)
        assert (
            timed[r].max_tokens == plain[r].max_tokens
            and timed[r].num_records == plain[r].num_records
        )
    # The count message: the same number of words with and without the timing word.
    assert count_row_words(topo, spec.experts, timing=True) == count_row_words(topo, spec.experts)
    sizes = {
        word: next(gather_demand(ctxs[0], h[0], p[0], rm[0], timing_word=word)).send.shape
        for word in (None, TIMING_NONE, TIMING_MAX_NS)
    }
    assert len(set(sizes.values())) == 1 and sizes[None] == (
        w,
        count_row_words(topo, spec.experts),
    ), sizes
    # A timing word out of range raises on the rank that passes it, before the exchange.
    with pytest.raises(ValueError, match="timing_word"):
        next(gather_demand(ctxs[0], h[0], p[0], rm[0], timing_word=TIMING_WORD_MAX + 1))
    # A malformed input on rank 3 is still found under a timing word (the low status bits).
    bad_rm = list(rm)
    bad_rm[3] = rm[3].to(torch.int64)
    from megatron_railwave.exchange import InputError

    with pytest.raises(InputError, match=r"EP rank\(s\) \[3\]"):
        VirtualCluster(world_size=w).run(
            [gather_demand(ctxs[r], h[r], p[r], bad_rm[r], timing_word=words[r]) for r in range(w)]
        )
