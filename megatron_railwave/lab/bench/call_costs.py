"""Per-call costs of the exchange, measured on CPU: what a layer pays besides moving bytes.

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens per rank, E experts, H hidden.

The flow model needs, per layer call, the cost of the count exchange, a fixed cost per phase
(launch, notify, host wait) and the cost of RailBalance's planning steps. This module measures
them on the exchange as it exists, two ways:

* gloo (``call_cost_worker``, W processes on loopback, one gloo group): every rank times, after a
  barrier, with the slowest rank per sample kept by the parent:

  - ``count_exchange``: ``TorchDistExchange.gather_demand`` (this rank's record count, one
    all-to-all of fixed-size int64 counts on the EP group, one device-to-host copy);
  - ``empty_phase_rail`` / ``empty_phase_node``: one ``Post`` + ``Wait`` of a one-element buffer
    with the ring partner on the rail group / node group: launch, notify and host wait of a phase
    with no payload;
  - ``timing_reduce_post`` / ``timing_reduce_read``: fixed-capacity mode's online-selector
    reduce (``TorchDistExchange.post_timing``: one asynchronous all-reduce of 16 bytes per rank on
    the EP group): the host time to post it, and the host wait of ``result()`` on a reduce posted
    one sample earlier (as the dispatcher reads it an epoch later);
  - ``node_barrier``: a barrier on the node group. The reference kernels run RailBalance's
    node-local barrier before their quota step; this exchange has no such barrier (the count
    all-to-all orders the layer), so the number is what one would cost here;
  - per path, at the spec's (small) payload: ``plan`` (``build_plan``: RailBalance quotas and
    relay matrix for RAIL / JOINT), ``prepare`` (schedule + index maps), ``dispatch`` and
    ``combine`` wall times, and the phases the rank posts per call (a counting transport).
    A least-squares line ``dispatch + combine = fixed + per_phase x phases`` over the paths gives
    the per-phase cost as the exchange pays it.

* virtual (``virtual_call_costs``): the same rank programs on the in-process virtual cluster
  (``exchange.VirtualCluster``), every rank's host work with buffers moved by local copies and
  no transport at all; per rank = cluster time / W. The posted phases per rank per path come from
  the cluster's events, a cross-check of the gloo count. ``plan_us``: one ``build_plan`` in this
  process (no other rank competing), so RAIL - NATIVE is RailBalance's quota step on the host.

Loopback has neither rails nor NVLink and the ranks share this machine's cores, so these are
software costs of the CPU exchange, not GPU / NCCL / DeepEP numbers (not yet run on hardware).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_railwave.exchange import (
    RankContext,
    TorchDistExchange,
    TorchDistTransport,
    VirtualCluster,
    build_rail_groups,
    combine_forward,
    dispatch_forward,
    gather_demand,
    prepare_layer,
    virtual_rank_groups,
)
from megatron_railwave.exchange.transport import Post
from megatron_railwave.lab.workloads import synthetic_routing_maps
from megatron_railwave.names import PAPER_ROUTES
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology

__all__ = [
    "CallCostSpec",
    "call_cost_worker",
    "reduce_call_costs",
    "fit_per_phase",
    "virtual_call_costs",
    "measure_call_costs",
    "SCHEMA",
]

SCHEMA = "railwave.call_costs/1"
_PATHS = tuple(map(str, PAPER_ROUTES))  # the fitted per-phase costs are the paper paths'
_STEPS = ("plan", "prepare", "dispatch", "combine")


@dataclass(frozen=True, kw_only=True, slots=True)
class CallCostSpec:
    """One measurement (picklable; every rank gets the same spec)."""

    num_nodes: int = 4
    gpus_per_node: int = 2
    tokens: int = 128
    """T per rank: decode-like by default, so the payload is small next to the fixed costs."""
    hidden: int = 64
    experts: int = 32
    topk: int = 8
    seed: int = 0
    warmups: int = 5
    samples: int = 30

    def __post_init__(self) -> None:
        for name in (
            "num_nodes",
            "gpus_per_node",
            "tokens",
            "hidden",
            "experts",
            "topk",
            "samples",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CallCostSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_nodes < 2:
            raise ValueError(
                f"CallCostSpec.num_nodes must be >= 2 (rail phases need two nodes), got "
                f"{self.num_nodes}"
            )
        if self.warmups < 0:
            raise ValueError(f"CallCostSpec.warmups must be >= 0, got {self.warmups}")
        if self.experts % (self.num_nodes * self.gpus_per_node):
            raise ValueError(
                f"--experts {self.experts} is not a multiple of W = "
                f"{self.num_nodes * self.gpus_per_node}"
            )
        if self.topk > self.experts:
            raise ValueError(f"--topk {self.topk} exceeds --experts {self.experts}")

    def topology(self) -> RailTopology:
        return RailTopology(
            num_nodes=self.num_nodes,
            gpus_per_node=self.gpus_per_node,
            name=f"{self.num_nodes}x{self.gpus_per_node}",
        )

    def routing_maps(self) -> list[np.ndarray]:
        """W seeded routing maps [T, E] bool (the same on every rank)."""
        maps = synthetic_routing_maps(
            self.topology(),
            num_tokens=self.tokens,
            num_experts=self.experts,
            topk=self.topk,
            seed=self.seed,
        )
        return [m.numpy() for m in maps]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class _PhaseCountingTransport(TorchDistTransport):
    """The exchange's transport, counting the phases it posts."""

    posts: int = 0

    def post(self, req: Post):  # type: ignore[override]
        self.posts += 1
        return super().post(req)


def _inputs(
    spec: CallCostSpec, rank: int, routing: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    routing_TE = torch.from_numpy(routing)
    hidden_TH = torch.randn(spec.tokens, spec.hidden, generator=gen)
    probs_TE = torch.rand(spec.tokens, spec.experts, generator=gen) * routing_TE
    return hidden_TH, probs_TE, routing_TE


def _timed(fn, samples: int, warmups: int) -> list[float]:
    """Microseconds of ``fn()`` per call, each call after a barrier of the whole group."""
    for _ in range(warmups):
        dist.barrier()
        fn()
    out = []
    for _ in range(samples):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def call_cost_worker(
    rank: int, world: int, spec: CallCostSpec, routing_maps: list[np.ndarray]
) -> dict[str, Any]:
    """One rank of the gloo measurement (module docstring). Returns per-sample microseconds
    (``samples_us``: name -> list) and the phases posted per path call (``phases``)."""
    topo = spec.topology()
    groups = build_rail_groups(None, topo)
    exchange = TorchDistExchange(topo, groups, num_experts=spec.experts, options=PlanOptions())
    transport = _PhaseCountingTransport(rank=groups.railwave_rank)
    exchange.transport = transport
    hidden, probs, routing = _inputs(spec, rank, routing_maps[rank])
    samples: dict[str, list[float]] = {}

    samples["count_exchange"] = _timed(
        lambda: exchange.gather_demand(hidden, probs, routing), spec.samples, spec.warmups
    )

    for kind, group in (("rail", groups.rail), ("node", groups.node)):
        size = len(group.ranks)
        me = group.ranks.index(groups.railwave_rank)
        send = torch.ones(1, dtype=torch.int64)
        recv = torch.zeros(1, dtype=torch.int64)
        sends: list[torch.Tensor | None] = [None] * size
        recvs: list[torch.Tensor | None] = [None] * size
        sends[(me + 1) % size], recvs[(me - 1) % size] = send, recv

        def phase(group=group, sends=sends, recvs=recvs) -> None:
            transport.wait(
                transport.post(
                    Post(tag=7, stage="empty phase", group=group, sends=sends, recvs=recvs)
                )
            )

        samples[f"empty_phase_{kind}"] = _timed(phase, spec.samples, spec.warmups)
    samples["node_barrier"] = _timed(
        lambda: dist.barrier(group=groups.node.handle), spec.samples, spec.warmups
    )
    posted: list[Any] = []
    samples["timing_reduce_post"] = _timed(
        lambda: posted.append(exchange.post_timing(rank + 1, hidden.device)),
        spec.samples,
        spec.warmups,
    )
    reads = iter(posted)  # each read after a barrier, one sample after its post
    samples["timing_reduce_read"] = _timed(lambda: next(reads).result(), spec.samples, spec.warmups)

    layer = exchange.gather_demand(hidden, probs, routing)
    phases: dict[str, int] = {}
    for path in _PATHS:
        steps: dict[str, list[float]] = {s: [] for s in _STEPS}
        for i in range(spec.warmups + spec.samples):
            dist.barrier()
            t = [time.perf_counter()]
            plan = exchange.plan(layer, path, phase=i)
            t.append(time.perf_counter())
            handle = exchange.prepare(layer, plan, hidden, probs)
            t.append(time.perf_counter())
            posts0 = transport.posts
            out = exchange.dispatch(hidden, probs, routing, handle)
            t.append(time.perf_counter())
            exchange.combine(out.tokens * out.probs.unsqueeze(1), out.handle)
            t.append(time.perf_counter())
            phases[path] = transport.posts - posts0
            if i >= spec.warmups:
                for name, a, b in zip(_STEPS, t, t[1:]):
                    steps[name].append((b - a) * 1e6)
        for name, values in steps.items():
            samples[f"{path}.{name}"] = values
    return {"samples_us": samples, "phases": phases}


def fit_per_phase(phases: dict[str, int], move_us: dict[str, float]) -> dict[str, float]:
    """Least squares ``move_us = fixed_us + per_phase_us x phases`` over the paths.

    Args:
        phases: phases posted per call (dispatch + combine) of each path.
        move_us: median dispatch + combine time of each path.

    Returns:
        ``per_phase_us``, ``fixed_us`` and ``r2`` (1.0 when the points lie on the line; 0.0 when
        every path posts the same number of phases, where no slope can be fitted).
    """
    names = sorted(phases)
    x = np.array([phases[n] for n in names], dtype=np.float64)
    y = np.array([move_us[n] for n in names], dtype=np.float64)
    if len(names) < 2 or np.ptp(x) == 0:
        return {"per_phase_us": 0.0, "fixed_us": float(y.mean()) if y.size else 0.0, "r2": 0.0}
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return {"per_phase_us": float(slope), "fixed_us": float(intercept), "r2": r2}


def _summary(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    p10, med, p90 = np.percentile(arr, [10, 50, 90])
    return {
        "median_us": float(med),
        "p10_us": float(p10),
        "p90_us": float(p90),
        "samples": int(arr.size),
    }


def reduce_call_costs(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per sample the slowest rank, then median / p10 / p90 per name; the phase fit; RailBalance's
    planning cost (RAIL - NATIVE and JOINT - PERM plan times)."""
    names = per_rank[0]["samples_us"].keys()
    slowest = {
        n: [max(vals) for vals in zip(*(r["samples_us"][n] for r in per_rank))] for n in names
    }
    summary = {n: _summary(v) for n, v in slowest.items()}
    phase_counts = {p: max(r["phases"][p] for r in per_rank) for p in _PATHS}
    move = {
        p: statistics.median(
            d + c for d, c in zip(slowest[f"{p}.dispatch"], slowest[f"{p}.combine"])
        )
        for p in _PATHS
    }
    med = {n: s["median_us"] for n, s in summary.items()}
    return {
        "steps": summary,
        "phases_per_call": phase_counts,
        "move_us": move,
        "per_phase_fit": fit_per_phase(phase_counts, move),
        "railbalance_us": {
            "quota_rail_minus_native": med["rail.plan"] - med["native.plan"],
            "quota_joint_minus_perm": med["joint.plan"] - med["perm.plan"],
            "prepare_rail_minus_native": med["rail.prepare"] - med["native.prepare"],
            "node_barrier": med["node_barrier"],
        },
    }


def virtual_call_costs(spec: CallCostSpec) -> dict[str, Any]:
    """Host work per rank on the in-process virtual cluster (module docstring)."""
    topo = spec.topology()
    w = topo.world_size
    maps = spec.routing_maps()
    inputs = [_inputs(spec, r, maps[r]) for r in range(w)]
    ctxs = [
        RankContext(
            topo=topo,
            groups=virtual_rank_groups(topo, r),
            num_experts=spec.experts,
            options=PlanOptions(),
        )
        for r in range(w)
    ]
    counts: list[float] = []
    layers = None
    for i in range(spec.warmups + spec.samples):
        cluster = VirtualCluster(world_size=w)
        t0 = time.perf_counter()
        layers = cluster.run([gather_demand(ctxs[r], *inputs[r]) for r in range(w)])
        if i >= spec.warmups:
            counts.append((time.perf_counter() - t0) * 1e6 / w)
    assert layers is not None
    per_path: dict[str, Any] = {}
    for path in _PATHS:
        move: list[float] = []
        plan_us: list[float] = []
        for i in range(
            spec.warmups + spec.samples
        ):  # one rank's plan: every rank computes the same
            t0 = time.perf_counter()
            build_plan(layers[0].demand, topo, path, phase=i)
            if i >= spec.warmups:
                plan_us.append((time.perf_counter() - t0) * 1e6)
        posts = 0
        for i in range(spec.warmups + spec.samples):
            handles = [
                prepare_layer(
                    ctxs[r],
                    layers[r],
                    build_plan(layers[r].demand, topo, path, phase=i),
                    hidden_dtype=inputs[r][0].dtype,
                    probs_dtype=inputs[r][1].dtype,
                    hidden_size=spec.hidden,
                )
                for r in range(w)
            ]
            cluster = VirtualCluster(world_size=w)
            t0 = time.perf_counter()
            out = cluster.run([dispatch_forward(ctxs[r], handles[r], *inputs[r]) for r in range(w)])
            cluster.run(
                [
                    combine_forward(
                        ctxs[r], handles[r], out[r][2], out[r][0] * out[r][1].unsqueeze(1)
                    )
                    for r in range(w)
                ]
            )
            if i >= spec.warmups:
                move.append((time.perf_counter() - t0) * 1e6 / w)
            posts = sum(e.event == "post" for e in cluster.events)
        per_path[path] = {
            "move_us_per_rank": statistics.median(move),
            "phases_per_rank": posts / w,
            "plan_us": statistics.median(plan_us),
        }
    return {
        "count_exchange_us_per_rank": statistics.median(counts),
        "paths": per_path,
        "quota_rail_minus_native_us": per_path["rail"]["plan_us"] - per_path["native"]["plan_us"],
        "quota_joint_minus_perm_us": per_path["joint"]["plan_us"] - per_path["perm"]["plan_us"],
    }


def measure_call_costs(
    spec: CallCostSpec, *, timeout_s: float = 600.0, virtual: bool = True
) -> dict[str, Any]:
    """The gloo measurement on W spawned processes, reduced, plus the virtual one; JSON-ready."""
    from megatron_railwave.lab.bench.launch import run_gloo_processes

    topo = spec.topology()
    per_rank = run_gloo_processes(
        call_cost_worker, topo.world_size, spec, spec.routing_maps(), timeout_s=timeout_s
    )
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "spec": spec.to_dict(),
        "topology": topo.to_dict(),
        "transport": "gloo on loopback (CPU), one process per rank",
        "gloo": reduce_call_costs(per_rank),
    }
    if virtual:
        result["virtual"] = virtual_call_costs(spec)
    return result
