"""Worker side of the testbed experiments: the real ``TorchDistExchange`` on every rank.

Letters: N nodes, G GPUs per node (= rails), W = N * G ranks, T tokens per rank, E experts,
E_loc = E / W local experts, K top-k, H hidden size.

Every rank builds its groups with :func:`~megatron_railwave.lab.testbed.launch.make_groups` (node
groups on loopback, rail groups on the rail NICs) and a control group on the management network
(:func:`~megatron_railwave.lab.testbed.launch.make_control_group`). The exchange's ``RailGroups``
are assembled from them: ``ep_group`` = the control group (the count all-gather must survive a
failed rail, see docs/testbed.md), ``node_group`` = loopback, ``rail_group`` = the rank's rail.

Receives first (``receives_first``): gloo's TCP pair announces a posted receive to its peer with a
small notice that travels in the same FIFO as its outgoing payloads, and a peer sends a payload
only after that notice. ``p2p.start_exchange`` posts, per peer, the send before the receive, so
when two ranks exchange in both directions one of them often waits for the other's whole payload
before its own starts: a full-duplex rail pair runs half-duplex (measured 2x on a 2 x 2 testbed).
RDMA NICs have no such coupling. The study workers therefore post every batch's receives before
its sends (same ops, same per-kind order, works returned in the caller's order); see
docs/testbed.md. The exchange itself could do this in ``start_exchange``.

One timed exchange (``_timed_exchange``): control barrier, NIC counters, then
``gather_demand`` -> ``plan`` -> ``dispatch`` -> expert step (not timed) -> ``combine``, control
barrier, NIC counters. The expert of global index e multiplies its rows by ``prob * scale_E[e]``,
so the result has a dense closed form: out[t] = x[t] * sum_e p[t, e] * scale_E[e].
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_railwave.exchange import ExchangeTimeoutError, TorchDistExchange, rank_groups
from megatron_railwave.lab.testbed.launch import WorkerContext, make_control_group, make_groups
from megatron_railwave.lab.testbed.netns import fail_rail
from megatron_railwave.names import parse_candidate, parse_route
from megatron_railwave.planner import PlanOptions, schedule_from_windows
from megatron_railwave.telemetry.capture import routing_map_from_topk_ids
from megatron_railwave.topology import RailTopology

__all__ = ["fault_worker", "online_worker", "receives_first", "study_worker"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@contextmanager
def receives_first(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``dist.batch_isend_irecv`` posts all receives before all sends (module
    docstring). Per-kind order is kept, so message matching per (peer, tag) is unchanged, and the
    works come back in the order of the caller's ops (one work per op, as gloo returns them)."""
    if not enabled:
        yield
        return
    original = dist.batch_isend_irecv

    def batch(ops: list[dist.P2POp]) -> list[Any]:
        order = sorted(range(len(ops)), key=lambda i: getattr(ops[i].op, "__name__", "") != "irecv")
        works = original([ops[i] for i in order])
        if len(works) != len(ops):  # a coalesced backend (NCCL): one work for the batch
            return works
        out: list[Any] = [None] * len(ops)
        for pos, i in enumerate(order):
            out[i] = works[pos]
        return out

    dist.batch_isend_irecv = batch
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


def nic_bytes(ifname: str) -> tuple[int, int]:
    """(tx, rx) byte counters of a NIC of this process's namespace (``ip netns exec`` mounts the
    namespace's own sysfs)."""
    base = f"/sys/class/net/{ifname}/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def expert_scales(num_experts: int) -> torch.Tensor:
    """[E] float32 scale of each expert's stand-in (distinct, exact in bf16)."""
    return 1.0 + (torch.arange(num_experts, dtype=torch.float32) % 8) / 8.0


def make_inputs(
    rank: int, ids_WTK: np.ndarray, *, num_experts: int, hidden: int, dtype: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, H] dtype, probs [T, E] float32, routing_map [T, E] bool) of ``rank``; seeded."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    routing = routing_map_from_topk_ids(ids_WTK[rank], num_experts)
    x = torch.randn(routing.shape[0], hidden, generator=gen).to(_DTYPES[dtype])
    weights = torch.rand(routing.shape, generator=gen) * routing
    probs = weights / weights.sum(dim=1, keepdim=True).clamp(min=1e-6)
    return x, probs, routing


def dense_reference(x: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """[T, H] float32: x[t] * sum_e p[t, e] * scale_E[e] (what dispatch + experts + combine
    give)."""
    coef_T = (probs * routing * expert_scales(probs.shape[1])).sum(dim=1)
    return x.float() * coef_T.unsqueeze(1)


def digest(t: torch.Tensor) -> str:
    """Short hash of a tensor's bytes (bitwise equality across paths)."""
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class _Rank:
    """What one rank keeps across exchanges: groups, inputs, the reference."""

    def __init__(self, ctx: WorkerContext, *, num_experts: int) -> None:
        groups = make_groups(ctx)
        self.ctl = make_control_group(ctx)
        self.ctx = ctx
        self.num_experts = num_experts
        self.scale_E = expert_scales(num_experts)
        self.topo = RailTopology(
            num_nodes=ctx.spec.nodes,
            gpus_per_node=ctx.spec.gpus_per_node,
            rail_gbps=ctx.spec.rail_mbit / 1000.0,
            name=ctx.spec.name,
        )
        self.groups = rank_groups(
            self.topo,
            ctx.rank,
            ep_handle=self.ctl,
            node_handle=groups.node,
            rail_handle=groups.rail,
        )

    def exchange(
        self,
        windows: list[list[list[int]]] | None,
        *,
        topo: RailTopology | None = None,
        timeout_s: float | None = None,
        streamed: bool = False,
    ) -> TorchDistExchange:
        topo = topo or self.topo
        options = PlanOptions(
            windows=schedule_from_windows(topo.num_nodes, windows) if windows else None,
            streamed=streamed,
        )
        return TorchDistExchange(
            topo, self.groups, num_experts=self.num_experts, options=options, timeout_s=timeout_s
        )

    def expert_step(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> torch.Tensor:
        first = self.ctx.rank * (self.num_experts // self.ctx.spec.world_size)
        expert_N = torch.repeat_interleave(
            torch.arange(tokens_per_expert.numel()), tokens_per_expert
        )
        coef = probs * self.scale_E[first + expert_N]
        return (tokens.float() * coef.unsqueeze(1)).to(tokens.dtype)


def _timed_exchange(
    rk: _Rank, ex: TorchDistExchange, inputs: tuple, path: str, *, phase: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """One gather -> plan -> dispatch -> (expert) -> combine between two control barriers."""
    x, probs, routing = inputs
    ifname = rk.ctx.rail_ifname
    dist.barrier(group=rk.ctl)
    tx0, rx0 = nic_bytes(ifname)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    # A min-max plan reads every rank's copies per destination GPU (the delivery counts).
    layer = ex.gather_demand(x, probs, routing, delivery_counts=parse_route(path).min_max)
    t1 = time.perf_counter()
    plan = ex.plan(layer, path, phase=phase)
    handle = ex.prepare(layer, plan, x, probs)
    t2 = time.perf_counter()
    d = ex.dispatch(x, probs, routing, handle)
    t3 = time.perf_counter()
    y = rk.expert_step(d.tokens, d.tokens_per_expert, d.probs)
    t4 = time.perf_counter()
    out = ex.combine(y, d.handle)
    t5 = time.perf_counter()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier(group=rk.ctl)  # every rank's receives are done: the counters hold the whole block
    tx1, rx1 = nic_bytes(ifname)
    wall = (t5 - t0) - (t4 - t3)
    rec = {
        "total_s": wall,
        "gather_s": t1 - t0,
        "plan_s": t2 - t1,
        "dispatch_s": t3 - t2,
        "combine_s": t5 - t4,
        "user_s": ru1.ru_utime - ru0.ru_utime,
        "sys_s": ru1.ru_stime - ru0.ru_stime,
        "cpu_s": ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime,
        "tx": tx1 - tx0,
        "rx": rx1 - rx0,
    }
    return rec, out


def _check(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| relative to max |ref|."""
    scale = float(ref.abs().max()) or 1.0
    return float((out.float() - ref).abs().max()) / scale


def study_worker(
    ctx: WorkerContext,
    *,
    workloads: list[dict[str, Any]],
    paths: list[str],
    warmup: int,
    samples: int,
    hidden: int,
    dtype: str,
    seed: int,
    num_experts: int,
    recv_first: bool = True,
) -> dict[str, Any]:
    """Warm-ups, then ``samples`` rounds, each running every path once (round-robin, the start
    rotating per round); for every workload in turn.

    Returns:
        ``{"rank", "records": [...], "digests": {...}, "errors": {...}}``; a record per
        (workload, path, sample) with this rank's times (s), CPU time and NIC byte deltas.

    Collective: yes (every rank runs the same sequence).
    """
    torch.set_num_threads(1)
    rk = _Rank(ctx, num_experts=num_experts)
    records: list[dict[str, Any]] = []
    digests: dict[str, dict[str, list[str]]] = {}
    errors: dict[str, float] = {}
    with torch.no_grad(), receives_first(recv_first):
        for wl in workloads:
            # One exchange per relay kind: 'joint+streamed' is JOINT with a streamed relay.
            exchanges = {flag: rk.exchange(wl["windows"], streamed=flag) for flag in (False, True)}
            inputs = make_inputs(
                ctx.rank,
                wl["ids_WTK"],
                num_experts=num_experts,
                hidden=hidden,
                dtype=dtype,
                seed=seed,
            )
            ref = dense_reference(*inputs)
            name = wl["name"]
            digests[name] = {p: [] for p in paths}
            for it in range(warmup + samples):
                shift = it % len(paths)
                for path in paths[shift:] + paths[:shift]:
                    route, streamed = parse_candidate(path)
                    rec, out = _timed_exchange(rk, exchanges[streamed], inputs, route, phase=0)
                    digests[name][path].append(digest(out))
                    errors[f"{name}/{path}"] = max(
                        errors.get(f"{name}/{path}", 0.0), _check(out, ref)
                    )
                    if it >= warmup:
                        records.append(
                            {"workload": name, "path": path, "sample": it - warmup, **rec}
                        )
    return {"rank": ctx.rank, "records": records, "digests": digests, "errors": errors}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def fault_worker(
    ctx: WorkerContext,
    *,
    workload: dict[str, Any],
    paths: list[str],
    fail: list[int],
    samples: int,
    exchange_timeout_s: float,
    unaware_path: str,
    state_dir: str,
    hidden: int,
    dtype: str,
    seed: int,
    num_experts: int,
    recv_first: bool = True,
) -> dict[str, Any]:
    """Healthy exchanges, then NIC ``fail = [node, rail]`` goes down mid-run, then:

    1. aware: the topology lists the failed rail; ``samples`` rounds over ``paths``; every result
       must equal the healthy NATIVE result bitwise. This rank's records go to
       ``state_dir/rank<r>.json`` before step 2.
    2. unaware: the healthy topology and ``timeout_s=exchange_timeout_s``; the exchange must raise
       ``ExchangeTimeoutError`` naming the rail. The error goes to ``state_dir/error<r>.json`` and
       is raised again, so the worker exits non-zero and the launcher stops the others.

    Collective: yes.
    """
    torch.set_num_threads(1)
    rk = _Rank(ctx, num_experts=num_experts)
    state = Path(state_dir)
    inputs = make_inputs(
        ctx.rank,
        workload["ids_WTK"],
        num_experts=num_experts,
        hidden=hidden,
        dtype=dtype,
        seed=seed,
    )
    ref = dense_reference(*inputs)
    out_state: dict[str, Any] = {"rank": ctx.rank, "healthy": {}, "aware": [], "errors": {}}
    with torch.no_grad(), receives_first(recv_first):
        ex = rk.exchange(workload["windows"])
        for path in paths:
            rec, out = _timed_exchange(rk, ex, inputs, path, phase=0)
            out_state["healthy"][path] = {"digest": digest(out), "error": _check(out, ref), **rec}
        reference_digest = out_state["healthy"]["native"]["digest"] if "native" in paths else None
        # Mid-run fault: one rank of the failing node takes its NIC down; the others wait on the
        # control group (management network), which does not use the rails.
        node, rail = fail
        if ctx.node == node and ctx.local == 0:
            fail_rail(ctx.spec, node, rail)
        dist.barrier(group=rk.ctl)
        fault_t = time.time()
        ex_aware = rk.exchange(workload["windows"], topo=rk.topo.with_failed_rails({(node, rail)}))
        for it in range(samples):
            shift = it % len(paths)
            for path in paths[shift:] + paths[:shift]:
                rec, out = _timed_exchange(rk, ex_aware, inputs, path, phase=0)
                out_state["aware"].append(
                    {
                        "path": path,
                        "sample": it,
                        "digest": digest(out),
                        "error": _check(out, ref),
                        "equal_to_healthy_native": digest(out) == reference_digest,
                        **rec,
                    }
                )
        _write_json(state / f"rank{ctx.rank}.json", out_state)
        dist.barrier(group=rk.ctl)
        ex_unaware = rk.exchange(workload["windows"], timeout_s=exchange_timeout_s)
        t0 = time.time()
        try:
            _timed_exchange(rk, ex_unaware, inputs, unaware_path, phase=0)
        except BaseException as exc:
            _write_json(
                state / f"error{ctx.rank}.json",
                {
                    "rank": ctx.rank,
                    "node": ctx.node,
                    "local": ctx.local,
                    "type": type(exc).__name__,
                    "is_exchange_timeout": isinstance(exc, ExchangeTimeoutError),
                    "message": str(exc),
                    "after_s": time.time() - t0,
                    "since_fault_s": time.time() - fault_t,
                },
            )
            raise
    out_state["unaware"] = "completed without error"
    return out_state


def _timed_online(
    rk: _Rank, ex: TorchDistExchange, inputs: tuple, selector: Any, state: dict[str, Any]
) -> tuple[dict[str, Any], torch.Tensor]:
    """One layer call under the online selector, as the dispatcher makes it, between the same two
    control barriers as ``_timed_exchange``: the previous call's exchange time (this rank's clock)
    rides on the count exchange, then observe -> descriptors -> decide -> plan -> dispatch ->
    (expert, not timed) -> combine. ``state["last_s"]``: this rank's time of the layer's previous
    online call (plan + dispatch + combine, what the dispatcher times)."""
    from megatron_railwave.selector.online import encode_timing, fast_descriptors

    x, probs, routing = inputs
    dist.barrier(group=rk.ctl)
    t0 = time.perf_counter()
    word = encode_timing(state.get("last_s"), expected=selector.expects_timing())
    layer = ex.gather_demand(x, probs, routing, timing_word=word)
    t1 = time.perf_counter()
    selector.observe(layer.timing_W)
    rec_bytes = x.shape[-1] * x.element_size()
    decision = selector.decide(
        "train",
        fast_descriptors(
            layer.demand.records_WN, ex.topo, record_bytes=rec_bytes, scales=selector.scales
        ),
    )
    t2 = time.perf_counter()
    plan = ex.plan(layer, str(decision.path), phase=0)
    handle = ex.prepare(layer, plan, x, probs)
    d = ex.dispatch(x, probs, routing, handle)
    t3 = time.perf_counter()
    y = rk.expert_step(d.tokens, d.tokens_per_expert, d.probs)
    t4 = time.perf_counter()
    out = ex.combine(y, d.handle)
    t5 = time.perf_counter()
    dist.barrier(group=rk.ctl)
    state["last_s"] = (t3 - t2) + (t5 - t4)
    rec = {
        "total_s": (t5 - t0) - (t4 - t3),
        "gather_s": t1 - t0,
        "decision_s": t2 - t1,
        "timed_s": state["last_s"],
        "path": str(decision.path),
        "mode": decision.mode,
        "neighbourhood": decision.neighbourhood,
    }
    return rec, out


def online_worker(
    ctx: WorkerContext,
    *,
    workloads: list[dict[str, Any]],
    paths: list[str],
    steps: int,
    warmup: int,
    hidden: int,
    dtype: str,
    seed: int,
    num_experts: int,
    recv_first: bool = True,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``steps`` training steps over the workloads as MoE layers (one ``OnlineSelector`` per
    workload, sharing what they learn as the dispatcher's do); in every step and layer the online
    call and one call of each fixed path in ``paths``, in an order rotating per (step, layer), each
    timed like ``_timed_exchange``. The online selector sees only its own calls' times. First,
    ``warmup`` untimed rounds of every fixed path on every layer (connections, allocator), so
    that no policy pays them.

    Returns:
        ``{"rank", "records": [...], "digests_equal": bool, "errors": {...}}``: a record per
        (workload, step, policy) with this rank's times; ``policy`` 'online' or the path.

    Collective: yes (every rank runs the same sequence and takes the same decisions).
    """
    from megatron_railwave.config import OnlineSettings
    from megatron_railwave.selector.online import OnlineSelector, SharedNeighbourhoods
    from megatron_railwave.traffic import SelectorScales

    torch.set_num_threads(1)
    rk = _Rank(ctx, num_experts=num_experts)
    scales = SelectorScales().resolve(rk.topo)
    shared = SharedNeighbourhoods()
    online = OnlineSettings.from_dict(settings) if settings else OnlineSettings()
    records: list[dict[str, Any]] = []
    errors: dict[str, float] = {}
    digests_equal = True
    with torch.no_grad(), receives_first(recv_first):
        layers = []
        for li, wl in enumerate(workloads):
            inputs = make_inputs(
                ctx.rank,
                wl["ids_WTK"],
                num_experts=num_experts,
                hidden=hidden,
                dtype=dtype,
                seed=seed,
            )
            layers.append(
                {
                    "name": wl["name"],
                    "ex": rk.exchange(wl["windows"]),
                    "inputs": inputs,
                    "ref": dense_reference(*inputs),
                    "state": {},
                    "digest": None,
                    "selector": OnlineSelector(online, scales=scales, layer=li, shared=shared),
                }
            )
        for _ in range(warmup):
            for lay in layers:
                for path in paths:
                    _timed_exchange(rk, lay["ex"], lay["inputs"], path, phase=0)
        policies = ["online"] + list(paths)
        for step in range(steps):
            for li, lay in enumerate(layers):
                shift = (step + li) % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    if policy == "online":
                        rec, out = _timed_online(
                            rk, lay["ex"], lay["inputs"], lay["selector"], lay["state"]
                        )
                    else:
                        rec, out = _timed_exchange(rk, lay["ex"], lay["inputs"], policy, phase=0)
                        rec = {
                            "total_s": rec["total_s"],
                            "gather_s": rec["gather_s"],
                            "path": policy,
                        }
                    d = digest(out)
                    digests_equal = digests_equal and (lay["digest"] is None or d == lay["digest"])
                    lay["digest"] = lay["digest"] or d
                    key = f"{lay['name']}/{policy}"
                    errors[key] = max(errors.get(key, 0.0), _check(out, lay["ref"]))
                    records.append({"workload": lay["name"], "step": step, "policy": policy, **rec})
    return {"rank": ctx.rank, "records": records, "digests_equal": digests_equal, "errors": errors}
