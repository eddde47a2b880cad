"""Peers of RailWave on the same links and demand: Megatron's all-to-all (NCCL), a PXN-like
"direct" DeepEP and a FAST-style per-layer Birkhoff-von-Neumann schedule. The baseline users run,
DeepEP's normal kernels, is not here: it is the NATIVE path with ``delivery='streamed'``
(`execute`), whose forwarders pass chunks on over NVLink as they arrive.

Letters: N nodes (s source, d destination), G GPUs per node, W = N * G ranks, E experts,
K waves of a BvN decomposition.

Megatron ``alltoall`` (`megatron_program`): every (token, expert) copy is sent from its source
GPU to the expert's GPU (no per-node or per-GPU de-duplication: a token with two experts on one
GPU travels twice), after a count exchange (Megatron's ``tokens_per_expert`` all-to-all and its
host sync, `NetModelConfig.count_exchange_s`), one all-to-all call per direction (one
``wave_latency_s`` each). Each copy carries the hidden row plus its fp32 routing probability in
dispatch and the hidden row in combine. Rail-optimized cluster, NCCL with PXN (assumed on): a
copy from GPU (s, g) to GPU (d, j) on another rail first crosses NVLink to GPU (s, j) and then
rail j; modelled as one streamed flow over both (NCCL pipelines PXN through the intermediate
GPU's buffer). Same-rail copies go straight; same-node copies use NVLink only. Combine is the
reverse (PXN on node d). NCCL's grouped send/recv does not post every pair at once: its p2p
schedule walks the nodes in rounds (round k: send to node + k, receive from node - k), so by
default (``rounds='rotating'``, peer 'megatron') round k carries the pairs s -> (s + k) mod N and
the rounds run in order. That is the strictly time-shaped end: NCCL spreads the rounds over its
channels, so consecutive rounds overlap in part; 'megatron-flat' (every pair at once) is the
other end.

DeepEP "direct" (`deepep_direct_program`, peer 'deepep-direct'): one copy per (token, target
GPU) instead of per (token, node) with a forwarder, sent like a PXN all-to-all (NVLink hop to the
GPU with the target's local index, then its rail), all pairs at once, one call per direction
after the count exchange. Dispatch rows carry the hidden row and the fp32 probs of the target
GPU's experts. It stands for kernels that skip the forwarder stage (every token crosses the rail
once per target GPU, no NVLink fan-out at the destination).

Per-call costs, the same fields for every program (`NetModelConfig`; docs/netmodel.md "Per-call
costs" gives their sources): ``count_exchange_s`` once per layer (DeepEP's notify / layout
step; Megatron's count all-to-all and host sync), ``wave_latency_s`` per rail call or wave
(kernel launch, notify, the CPU's wait on the receive counter), RailBalance's barrier and quota
steps for RAIL, JOINT and FAST's rebalancing.

FAST-style (`fast_program`, after FAST, arXiv 2505.09764): intra-server rebalancing (here
RailBalance's quotas and relays: the RAIL plan) and a scale-out schedule recomputed for every
layer: the node-to-node record matrix is padded to equal line sums and decomposed into
permutations (Birkhoff-von-Neumann, `bvn_waves`); wave k sends, for each node pair of its
permutation, its share of the pair's records, one-to-one. A pair can span several waves. The
phases run as RailWave's do (store and forward): relay and the local delivery, then the rail
waves in order, each followed by the delivery of what it brought; wave k's delivery at node d is
the share of d's incoming records that arrives in wave k (proportional split: the delivery
copies are known per node, not per source). Combine is the same backwards. The decomposition's
wall time is FAST's per-layer planning cost (`bvn_waves` is timed by the caller).
"""

from __future__ import annotations

import numpy as np

from megatron_railwave.lab.netmodel.execute import (
    NetModelConfig,
    fabric_for,
    model_wire,
    synced_program,
)
from megatron_railwave.lab.netmodel.program import LinkProgram, ProgramBuilder, run_program
from megatron_railwave.planner import PathPlan
from megatron_railwave.schedule import PhaseKind, compile_schedule
from megatron_railwave.topology import RailTopology

__all__ = [
    "PEERS",
    "bvn_waves",
    "copies_WW",
    "deepep_direct_program",
    "fast_program",
    "gpu_copies_WW",
    "megatron_program",
    "model_peer",
]

PEERS = ("megatron", "megatron-flat", "deepep-direct", "fast")
"""Peer programs `model_peer` knows (the DeepEP baseline itself is NATIVE with streamed
delivery)."""


def copies_WW(demand, topo: RailTopology) -> np.ndarray:
    """[W, W] int64 (token, expert) copies from rank w to the rank of the expert.

    Uses ``demand.experts_WE`` ([W, E], routed pairs per expert; experts placed contiguously,
    E / W per rank).
    """
    experts = getattr(demand, "experts_WE", None)
    if experts is None:
        raise ValueError(
            "the Megatron peer needs the demand's experts_WE ((token, expert) pairs per rank and "
            "expert); a sparse demand has none: run the peers at a size with a dense demand"
        )
    e = np.asarray(experts, dtype=np.int64)
    world = topo.world_size
    if e.shape[0] != world or e.shape[1] % world:
        raise ValueError(
            f"experts_WE has shape {tuple(e.shape)}; need [W={world}, E] with E a multiple of W"
        )
    return e.reshape(world, world, e.shape[1] // world).sum(axis=-1)


def _pxn_program(
    copies_WW: np.ndarray,
    topo: RailTopology,
    *,
    dispatch_row: int,
    combine_row: int,
    model: NetModelConfig,
    rounds: str,
) -> LinkProgram:
    """One all-to-all per direction of ``copies_WW`` rows, PXN on the rails (module docstring).

    ``rounds``: 'flat' (every pair at once) or 'rotating' (NCCL's p2p node schedule: round k,
    k = 0..N-1, carries node s -> node (s + k) mod N; rounds run in order, the call's fixed cost
    paid once, before round 0)."""
    fabric = fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    g, n = topo.gpus_per_node, topo.num_nodes
    src, dst = np.nonzero(copies_WW)
    count = copies_WW[src, dst].astype(np.float64)
    b = ProgramBuilder(fabric=fabric)
    counts = b.phase("counts", "sync", -1, (), model.count_exchange_s)
    wave = model.wave_cost_s(topo.world_size)
    delta = (dst // g - src // g) % n  # the node round of each pair
    num_rounds = n if rounds == "rotating" else 1
    if rounds == "flat":
        delta = np.zeros_like(delta)
    phases = {}
    for direction, name, row, (a, z) in (
        (0, "dispatch", dispatch_row, (src, dst)),
        (1, "combine", combine_row, (dst, src)),
    ):
        before = (
            (counts,) if direction == 0 else (b.phase("experts", "sync", -1, tuple(phases[0])),)
        )
        chain: list[int] = []
        for k in range(num_rounds):
            label = f"{name}.alltoall" + (f"[{k}]" if num_rounds > 1 else "")
            chain.append(
                b.phase(
                    label,
                    "alltoall",
                    direction,
                    (chain[-1],) if chain else before,
                    wave if not chain else 0.0,
                )
            )
            sel = delta == k
            local = sel & (a // g == z // g)
            remote = sel & (a // g != z // g)
            b.nvlink(chain[-1], a[local], z[local], count[local] * row)
            # PXN: leave on the rail of the receiving GPU's local index.
            b.rail(chain[-1], a[remote], z[remote], count[remote] * row, via_gpu_F=z[remote] % g)
        phases[direction] = chain
    return b.build()


def megatron_program(
    demand,
    topo: RailTopology,
    *,
    record_bytes: int,
    model: NetModelConfig,
    rounds: str = "rotating",
) -> LinkProgram:
    """Megatron's ``alltoall`` dispatcher on ``demand`` (module docstring) as a `LinkProgram`:
    every (token, expert) copy, NCCL's rotating node rounds (``rounds='flat'``: all pairs at
    once)."""
    return _pxn_program(
        copies_WW(demand, topo),
        topo,
        dispatch_row=record_bytes + 4,
        combine_row=record_bytes,
        model=model,
        rounds=rounds,
    )


def gpu_copies_WW(demand, topo: RailTopology) -> np.ndarray:
    """[W, W] int64 (token, target GPU) copies from rank w to rank v: one per GPU a token has
    experts on (``demand.copies_WNG``; needs the full demand)."""
    copies = getattr(demand, "copies_WNG", None)
    if copies is None or getattr(demand, "records_WNM", None) is None:
        raise ValueError(
            "the DeepEP direct peer needs the full demand (records_WNM: target masks per node); "
            "a sparse demand or a node view has none: run the peers at a size with a dense demand"
        )
    c = np.asarray(copies(), dtype=np.int64)  # [W, N, G]
    return c.reshape(c.shape[0], -1)


def deepep_direct_program(
    demand, topo: RailTopology, *, record_bytes: int, model: NetModelConfig
) -> LinkProgram:
    """A PXN-like "direct" DeepEP on ``demand``: one copy per (token, target GPU), straight to
    the target GPU, across the rail of the target's local index after an NVLink hop at the
    source (streamed: one flow over both), all pairs at once, one call per direction. Dispatch
    rows carry the hidden row and the fp32 probs of the target GPU's E / W experts."""
    experts_per_gpu = max(1, model.num_experts // topo.world_size)
    return _pxn_program(
        gpu_copies_WW(demand, topo),
        topo,
        dispatch_row=record_bytes + 4 * experts_per_gpu,
        combine_row=record_bytes,
        model=model,
        rounds="flat",
    )


def _perfect_matching(support_NN: np.ndarray, weight_NN: np.ndarray) -> np.ndarray:
    """[N] column matched to each row on ``support`` (Kuhn's augmenting paths, heaviest first)."""
    n = support_NN.shape[0]
    order = [
        np.flatnonzero(support_NN[i])[np.argsort(-weight_NN[i, support_NN[i]], kind="stable")]
        for i in range(n)
    ]
    match_col = np.full(n, -1, dtype=np.int64)

    def augment(i: int, seen: np.ndarray) -> bool:
        for j in order[i]:
            if not seen[j]:
                seen[j] = True
                if match_col[j] < 0 or augment(int(match_col[j]), seen):
                    match_col[j] = i
                    return True
        return False

    for i in range(n):
        if not augment(i, np.zeros(n, dtype=bool)):
            raise AssertionError(
                "no perfect matching on the support of a matrix with equal line sums"
            )
    row = np.empty(n, dtype=np.int64)
    row[match_col] = np.arange(n)
    return row


def bvn_waves(records_NN: np.ndarray) -> list[np.ndarray]:
    """Birkhoff-von-Neumann waves of a node-to-node record matrix.

    Args:
        records_NN: [N, N] int64 >= 0, records s -> d (diagonal ignored).

    Returns:
        K matrices [N, N] int64, each with at most one nonzero per row and per column (a
        one-to-one wave), summing to ``records_NN`` off the diagonal. Waves that carry only
        padding are dropped.
    """
    real = np.array(records_NN, dtype=np.int64)
    np.fill_diagonal(real, 0)
    n = real.shape[0]
    if n < 2 or not real.any():
        return []
    line = int(max(real.sum(axis=1).max(), real.sum(axis=0).max()))
    padded = real.copy()
    rows, cols = line - padded.sum(axis=1), line - padded.sum(axis=0)
    i = j = 0
    while i < n and j < n:  # north-west corner: pad to equal line sums
        add = min(rows[i], cols[j])
        padded[i, j] += add
        rows[i] -= add
        cols[j] -= add
        if rows[i] == 0:
            i += 1
        if cols[j] == 0:
            j += 1
    waves = []
    while padded.any():
        col_N = _perfect_matching(padded > 0, padded)
        idx = np.arange(n)
        weight = int(padded[idx, col_N].min())
        padded[idx, col_N] -= weight
        sent = np.minimum(real[idx, col_N], weight)
        real[idx, col_N] -= sent
        if sent.any():
            wave = np.zeros((n, n), dtype=np.int64)
            wave[idx, col_N] = sent
            waves.append(wave)
    assert not real.any(), "BvN waves must cover every record"
    return waves


def fast_program(
    rail_plan: PathPlan,
    demand,
    waves: list[np.ndarray],
    *,
    record_bytes: int,
    model: NetModelConfig,
) -> LinkProgram:
    """The FAST-style execution of ``rail_plan`` (a RAIL plan) in the BvN ``waves``."""
    topo = rail_plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    fabric = fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    sched = compile_schedule(rail_plan, model_wire(topo, record_bytes, model), demand=demand)
    bytes_of = {"dispatch": sched.wire.dispatch_bytes, "combine": sched.wire.combine_bytes}

    def table(kind: PhaseKind, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src, dst, rows = (t.numpy() for t in sched.transfers(sched.phase("dispatch", kind, step)))
        return src, dst, rows.astype(np.float64)

    relay = table(PhaseKind.RELAY, 0)
    local = table(PhaseKind.DELIVER, 0)
    remote_deliv = (
        table(PhaseKind.DELIVER, 1)
        if rail_plan.num_waves
        else (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
    )
    rail = (
        table(PhaseKind.RAIL, 0)
        if rail_plan.num_waves
        else (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
    )
    pair = rail_plan.records_NNG.sum(dim=-1).numpy().astype(np.float64)  # [s, d] records
    incoming = pair.sum(axis=0) - np.diag(pair)
    share_rail = [
        np.divide(w, pair, out=np.zeros_like(pair), where=pair > 0) for w in waves
    ]  # [s, d]
    share_deliv = [
        np.divide(w.sum(axis=0), incoming, out=np.zeros(n), where=incoming > 0) for w in waves
    ]  # [d]

    b = ProgramBuilder(fabric=fabric)
    counts = b.phase("counts", "sync", -1, (), model.count_exchange_s)
    wave_cost = model.wave_cost_s(topo.world_size)
    rb_cost = model.railbalance_barrier_s + model.railbalance_quota_s
    num = len(waves)
    # Dispatch: relay | deliver[0], rail[k] after rail[k-1] (rail[0] after relay), deliver[k+1]
    # after rail[k] and deliver[k].
    d_relay = b.phase("dispatch.relay", "relay", 0, (counts,), rb_cost)
    d_deliv = [b.phase("dispatch.deliver[0]", "deliver", 0, (counts,))]
    d_rail = []
    for k in range(num):
        d_rail.append(
            b.phase(f"dispatch.rail[{k}]", "rail", 0, (d_rail[-1] if k else d_relay,), wave_cost)
        )
        d_deliv.append(b.phase(f"dispatch.deliver[{k + 1}]", "deliver", 0, (d_rail[k], d_deliv[k])))
    experts = b.phase("experts", "sync", -1, tuple([d_relay] + d_deliv + d_rail))
    # Combine: cdeliver[k+1] -> crail[k] in order, crelay after the last; the local round
    # cdeliver[0] overlaps the waves (cdeliver[1] does not wait for it), as in the schedule
    # JOINT runs (schedule.execution), so both get the same combine overlap.
    c_deliv = [b.phase("combine.deliver[0]", "deliver", 1, (experts,))]
    c_rail: list[int] = []
    for k in range(num):
        c_deliv.append(
            b.phase(f"combine.deliver[{k + 1}]", "deliver", 1, (c_deliv[k] if k else experts,))
        )
        c_rail.append(
            b.phase(
                f"combine.rail[{k}]",
                "rail",
                1,
                (c_deliv[k + 1],) + ((c_rail[-1],) if k else ()),
                wave_cost,
            )
        )
    c_relay = b.phase("combine.relay", "relay", 1, (c_rail[-1],) if c_rail else (c_deliv[-1],))

    for direction, ph_relay, ph_deliv, ph_rail in (
        (0, d_relay, d_deliv, d_rail),
        (1, c_relay, c_deliv, c_rail),
    ):
        row = bytes_of["dispatch" if direction == 0 else "combine"]

        def put(kind: str, phase: int, src, dst, amount, direction=direction, row=row) -> None:
            a, z = (src, dst) if direction == 0 else (dst, src)
            (b.nvlink if kind == "node" else b.rail)(phase, a, z, amount * row)

        put("node", ph_relay, *relay)
        put("node", ph_deliv[0], *local)
        for k in range(num):
            src, dst, rows = rail
            put("rail", ph_rail[k], src, dst, rows * share_rail[k][src // g, dst // g])
            src, dst, rows = remote_deliv
            put("node", ph_deliv[k + 1], src, dst, rows * share_deliv[k][dst // g])
    return b.build()


def model_peer(
    name: str,
    demand,
    topo: RailTopology,
    *,
    record_bytes: int,
    model: NetModelConfig,
    repeats: int = 1,
) -> dict:
    """Model one peer on one layer: {'comm_s', 'dispatch_s', 'combine_s', 'bound_s', 'plan_s',
    'bvn_s', 'waves'}. ``plan_s``: FAST's per-layer planning (its RAIL plan + `bvn_waves`, median
    of ``repeats`` timed runs after one warm-up; 0 when ``repeats`` is 0), ``bvn_s`` the
    decomposition alone (what JOINT replaces by its cached cyclic waves); Megatron plans nothing."""
    import statistics
    import time

    from megatron_railwave.planner import build_plan

    fabric = fabric_for(topo, model.nodes_per_leaf, float(model.spine_oversubscription))
    plan_s, bvn_s, waves = 0.0, 0.0, 1
    if name in ("megatron", "megatron-flat"):
        program = megatron_program(
            demand,
            topo,
            record_bytes=record_bytes,
            model=model,
            rounds="rotating" if name == "megatron" else "flat",
        )
    elif name == "deepep-direct":
        program = deepep_direct_program(demand, topo, record_bytes=record_bytes, model=model)
    elif name == "fast":
        times, bvn_times = [], []
        for i in range(1 + repeats):
            t0 = time.perf_counter()
            plan = build_plan(demand.records_NGN(), topo, "rail")
            t1 = time.perf_counter()
            bvn = bvn_waves(plan.records_NNG.sum(dim=-1).numpy())
            if i:
                times.append(time.perf_counter() - t0)
                bvn_times.append(time.perf_counter() - t1)
        plan_s = statistics.median(times) if times else 0.0
        bvn_s = statistics.median(bvn_times) if bvn_times else 0.0
        waves = len(bvn)
        program = fast_program(plan, demand, bvn, record_bytes=record_bytes, model=model)
    else:
        raise ValueError(f"peer {name!r} is unknown; choose one of {', '.join(PEERS)}")
    program = synced_program(program, model, topo.world_size)
    rel_tol = model.large_rel_tol if program.flows.num_flows > model.large_flows else model.rel_tol
    run = run_program(fabric, program, incast=model.incast(), rel_tol=rel_tol, nvlink=model.nvlink)
    return {
        "comm_s": run.total_s,
        "dispatch_s": run.dispatch_s,
        "combine_s": run.combine_s,
        "bound_s": run.bound_s,
        "plan_s": plan_s,
        "bvn_s": bvn_s,
        "waves": waves,
    }
