"""Worker functions for multi-process exchange tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_railwave.exchange import TorchDistExchange, build_rail_groups
from megatron_railwave.planner import PlanOptions
from megatron_railwave.topology import RailTopology


def make_inputs(
    rank: int,
    *,
    tokens: list[int],
    experts: int,
    topk: int,
    hidden: int,
    seed: int,
    skip_nodes: dict[int, list[int]] | None = None,
    gpus_per_node: int = 2,
):
    """Deterministic per-rank inputs: (hidden [T, H], probs [T, E], routing_map [T, E])."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    t = tokens[rank]
    x = torch.randn(t, hidden, generator=gen, dtype=torch.float64).float()
    scores = torch.rand(t, experts, generator=gen)
    if skip_nodes and rank in skip_nodes:
        world = len(tokens)
        per_node = experts // (world // gpus_per_node)
        for node in skip_nodes[rank]:
            scores[:, node * per_node : (node + 1) * per_node] = -1.0
    idx = scores.topk(topk, dim=1).indices
    routing = torch.zeros(t, experts, dtype=torch.bool)
    routing.scatter_(1, idx, True)
    probs = torch.softmax(torch.randn(t, experts, generator=gen), dim=1) * routing
    return x, probs, routing


def expert_weights(experts: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randn(experts, hidden, hidden, generator=gen) / hidden**0.5


def dense_reference(rank: int, world: int, **kw):
    """out[t] = sum_e p[t, e] * x[t] @ W_e, computed densely on one rank."""
    x, probs, routing = make_inputs(rank, **kw)
    w = expert_weights(kw["experts"], kw["hidden"], kw["seed"])
    x = x.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    out = torch.einsum("th,ehk,te->tk", x, w, p * routing)
    (out * out).sum().backward()
    return out.detach(), x.grad, p.grad


def run_exchange(rank: int, world: int, topo_kwargs: dict, paths: list[str], kw: dict) -> dict:
    """Every path forward + backward. ``kw['point_to_point_too']``: also run each path with the
    transport's flat collectives off (results keyed '<path>/p2p'); ``kw['chunks']``: rail chunks
    per wave (PERM / JOINT)."""
    kw = dict(kw)
    modes = [True, False] if kw.pop("point_to_point_too", False) else [True]
    options = PlanOptions(chunks=kw.pop("chunks", 1), streamed=kw.pop("streamed", False))
    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo)
    ex = TorchDistExchange(topo, groups, num_experts=kw["experts"], options=options)
    w = expert_weights(kw["experts"], kw["hidden"], kw["seed"])
    per_rank = kw["experts"] // world
    local_w = w[rank * per_rank : (rank + 1) * per_rank]
    results, wire, a2a_calls = {}, {}, {}
    real_all_to_all = dist.all_to_all_single

    def counting_all_to_all(*args, **kwargs):
        a2a_calls[key] = a2a_calls.get(key, 0) + 1
        return real_all_to_all(*args, **kwargs)

    dist.all_to_all_single = counting_all_to_all
    for flat, path in [(f, p) for f in modes for p in paths]:
        ex.transport.flat_collectives = flat
        key = path if flat else f"{path}/p2p"
        ex.transport.bytes_sent.clear()
        ex.transport.bytes_received.clear()
        x, probs, routing = make_inputs(rank, **kw)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        layer = ex.gather_demand(x, probs, routing)
        plan = ex.plan(layer, path)
        d = ex.dispatch(x, probs, routing, ex.prepare(layer, plan, x, probs))
        outs = []
        for e, rows in enumerate(d.tokens.split(d.tokens_per_expert.tolist())):
            outs.append(rows @ local_w[e])
        y = torch.cat(outs) * d.probs.unsqueeze(1) if outs else d.tokens[:0]
        out = ex.combine(y, d.handle)
        (out * out).sum().backward()
        results[key] = (out.detach().numpy(), x.grad.numpy(), probs.grad.numpy())
        # Bytes handed to sends / receives per phase, against the schedule (forward + backward).
        sched = d.handle.layer.schedule
        fwd, bwd = sched.rank_bytes(rank), sched.rank_bytes(rank, backward=True)
        wire[key] = {
            "measured": (
                {k: v for k, v in ex.transport.bytes_sent.items() if v},
                {k: v for k, v in ex.transport.bytes_received.items() if v},
            ),
            "schedule": (
                {
                    p.name: fwd["sent"][p.index] + bwd["sent"][p.index]
                    for p in sched.phases
                    if fwd["sent"][p.index] + bwd["sent"][p.index]
                },
                {
                    p.name: fwd["received"][p.index] + bwd["received"][p.index]
                    for p in sched.phases
                    if fwd["received"][p.index] + bwd["received"][p.index]
                },
            ),
        }
    dist.all_to_all_single = real_all_to_all
    ref = tuple(t.numpy() for t in dense_reference(rank, world, **kw))
    dist.barrier()
    # numpy, not tensors: torch tensors cross process queues via shared-memory handles that die
    # with the worker process.
    return {"paths": results, "ref": ref, "wire": wire, "all_to_all_calls": a2a_calls}


def run_bad_input(rank: int, world: int, topo_kwargs: dict) -> str:
    """Rank 1 passes a float routing map; every rank must raise the same InputError."""
    from megatron_railwave.exchange import InputError

    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo)
    ex = TorchDistExchange(topo, groups, num_experts=8)
    x, probs, routing = make_inputs(rank, tokens=[8] * world, experts=8, topk=2, hidden=4, seed=0)
    if rank == 1:
        routing = routing.float()
    try:
        ex.gather_demand(x, probs, routing)
    except InputError as exc:
        if rank == 0:
            raise
        return str(exc)
    raise AssertionError(f"rank {rank} did not raise")


class _Leave(Exception):
    """The victim rank leaves the job (its process ends)."""


def run_fault(
    rank: int, world: int, topo_kwargs: dict, victim: int, stage: str, mode: str, timeout_s: float
) -> dict:
    """One layer (path 'rail') where ``victim`` stalls or leaves right before ``stage``.

    mode 'stall': the victim sleeps 3 x timeout_s before posting that stage; 'leave': it returns
    from the job there (its process exits, closing its connections). Every other rank reports
    the error it raised and how long after the layer's start.
    """
    import time

    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo, timeout_s=timeout_s)
    ex = TorchDistExchange(topo, groups, num_experts=8, timeout_s=timeout_s)
    x, probs, routing = make_inputs(rank, tokens=[12] * world, experts=8, topk=3, hidden=4, seed=4)
    x.requires_grad_(True)
    if rank == victim:
        for name in ("post", "collective"):
            original = getattr(ex.transport, name)

            def faulty(req, _original=original):
                if req.stage == stage:
                    if mode == "leave":
                        raise _Leave()
                    time.sleep(3 * timeout_s)
                return _original(req)

            setattr(ex.transport, name, faulty)
    t0 = time.monotonic()
    try:
        layer = ex.gather_demand(x, probs, routing)
        plan = ex.plan(layer, "rail")
        d = ex.dispatch(x, probs, routing, ex.prepare(layer, plan, x, probs))
        out = ex.combine(d.tokens * d.probs.unsqueeze(1), d.handle)
        out.sum().backward()
    except _Leave:
        return {"left": True}
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
        return {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - t0}
    return {"ok": True, "after_s": time.monotonic() - t0}


def _blocked_experts(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    spans: list[tuple[int, int]],
    weights: torch.Tensor,
    block: int = 32,
) -> torch.Tensor:
    """y = (x @ W_e) * p over every span's rows, each GEMM on a fresh [block, H] tensor: a GEMM's
    rounding can depend on its row count, so both modes give a row the same call and position."""
    pieces = []
    for e, (start, rows) in enumerate(spans):
        for b0 in range(0, rows, block):
            r = min(block, rows - b0)
            x = torch.nn.functional.pad(
                tokens[start + b0 : start + b0 + r], (0, 0, 0, block - r)
            ).clone()
            pieces.append((x @ weights[e])[:r])
    y = torch.cat(pieces) if pieces else tokens[:0]
    return y * probs.unsqueeze(1)


def run_fixed_capacity(
    rank: int, world: int, topo_kwargs: dict, path: str, capacity: int, kw: dict
) -> dict:
    """One layer of ``path`` in the normal mode and in fixed-capacity mode on the same inputs:
    outputs and gradients of both, the bytes each phase moved against the capacity schedule,
    and the host syncs SyncAudit counts in the fixed mode's forward (dispatch + combine)."""
    from megatron_railwave.lab.bench.sync_audit import SyncAudit

    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo)
    w = expert_weights(kw["experts"], kw["hidden"], kw["seed"])
    per_rank = kw["experts"] // world
    local_w = w[rank * per_rank : (rank + 1) * per_rank]
    results = {}
    for mode in ("normal", "fixed"):
        ex = TorchDistExchange(
            topo,
            groups,
            num_experts=kw["experts"],
            max_tokens_per_rank=capacity if mode == "fixed" else None,
        )
        x, probs, routing = make_inputs(rank, **kw)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        with SyncAudit() as audit:
            audit.mark(x, probs, routing)
            if mode == "normal":
                layer = ex.gather_demand(x, probs, routing)
                handle = ex.prepare(layer, ex.plan(layer, path), x, probs)
            else:
                handle = ex.prepare_capacity(x, probs, routing, path)
            d = ex.dispatch(x, probs, routing, handle)
            if mode == "normal":
                counts = d.tokens_per_expert.tolist()
                spans = list(zip([sum(counts[:e]) for e in range(per_rank)], counts))
            else:
                spans = [(e * world * capacity, world * capacity) for e in range(per_rank)]
            out = ex.combine(_blocked_experts(d.tokens, d.probs, spans, local_w), d.handle)
        syncs = audit.count
        (out * out).sum().backward()
        sched = d.handle.layer.schedule
        fwd, bwd = sched.rank_bytes(rank), sched.rank_bytes(rank, backward=True)
        results[mode] = {
            "arrays": (out.detach().numpy(), x.grad.numpy(), probs.grad.numpy()),
            "syncs": syncs,
            "tokens_per_expert": d.tokens_per_expert.tolist(),
            "wire": (
                {k: v for k, v in ex.transport.bytes_sent.items() if v},
                {
                    p.name: fwd["sent"][p.index] + bwd["sent"][p.index]
                    for p in sched.phases
                    if fwd["sent"][p.index] + bwd["sent"][p.index]
                },
            ),
        }
    dist.barrier()
    return results


def run_capacity_overflow(
    rank: int, world: int, topo_kwargs: dict, timeout_s: float, overflow_rank: int = 1
) -> dict:
    """Fixed-capacity mode, ``overflow_rank`` has 13 tokens for a capacity of 12: what every rank
    raised and after how long. The overflowing rank returns at once, so its process exits
    while its peers are still in the layer call."""
    import time

    from megatron_railwave.exchange import CapacityOverflowError

    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo, timeout_s=timeout_s)
    ex = TorchDistExchange(topo, groups, num_experts=8, timeout_s=timeout_s, max_tokens_per_rank=12)
    tokens = [12] * world
    tokens[overflow_rank] = 13
    x, probs, routing = make_inputs(rank, tokens=tokens, experts=8, topk=3, hidden=4, seed=4)
    t0 = time.monotonic()
    try:
        d = ex.dispatch(x, probs, routing, ex.prepare_capacity(x, probs, routing, "rail"))
        ex.combine(d.tokens * d.probs.unsqueeze(1), d.handle)
    except CapacityOverflowError as exc:
        return {
            "error": "CapacityOverflowError",
            "message": str(exc),
            "after_s": time.monotonic() - t0,
        }
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank raised
        return {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - t0}
    return {"ok": True}


def reduce_timing_words(
    rank: int, world: int, words: list[int], posts: int
) -> list[tuple[int, int]]:
    """Post ``posts`` timing reduces back to back (rank r's word k: ``words[r] + k``), read them
    in order afterwards (as the dispatcher reads an epoch later): [(max, min)] per post."""
    from megatron_railwave.exchange import post_timing_reduce

    topo = RailTopology(num_nodes=world // 2, gpus_per_node=2)
    groups = build_rail_groups(None, topo, timeout_s=30.0)
    posted = [
        post_timing_reduce(words[rank] + k, groups.ep, device=torch.device("cpu"), timeout_s=30.0)
        for k in range(posts)
    ]
    return [p.result() for p in posted]
