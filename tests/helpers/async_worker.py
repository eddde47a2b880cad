"""Workers for the asynchronous exchange tests (``exchange.pending``; spawned gloo ranks)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_railwave.exchange import ExchangeTimeoutError, TorchDistExchange, build_rail_groups
from megatron_railwave.topology import RailTopology
from tests.helpers.exchange_worker import expert_weights, make_inputs

_KW = dict(tokens=[10, 7, 12, 9], experts=8, topk=3, hidden=16, seed=3)


def _layer(
    ex: TorchDistExchange,
    rank: int,
    world: int,
    path: str,
    *,
    asynchronous: bool,
    between: Any = None,
) -> dict[str, np.ndarray]:
    """One layer forward + backward with linear experts; ``asynchronous``: start / finish with
    ``between()`` called while each direction's phases are in flight."""
    x, probs, routing = make_inputs(rank, **_KW)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    per_rank = _KW["experts"] // world
    w = expert_weights(_KW["experts"], _KW["hidden"], _KW["seed"])[
        rank * per_rank : (rank + 1) * per_rank
    ]
    layer = ex.gather_demand(x, probs, routing)
    handle = ex.prepare(layer, ex.plan(layer, path), x, probs)
    if asynchronous:
        pending = ex.start_dispatch(x, probs, routing, handle)
        info = {"dispatch_in_flight": pending.program.request is not None}
        if between is not None:
            between("dispatch")
        d = ex.finish_dispatch(x, probs, routing, pending)
    else:
        info, d = {}, ex.dispatch(x, probs, routing, handle)
    outs = [t @ w[e] for e, t in enumerate(d.tokens.split(d.tokens_per_expert.tolist()))]
    y = torch.cat(outs) * d.probs.unsqueeze(1)
    if asynchronous:
        pending_c = ex.start_combine(y, d.handle)
        info["combine_in_flight"] = pending_c.program.request is not None
        if between is not None:
            between("combine")
        out = ex.finish_combine(y, pending_c)
    else:
        out = ex.combine(y, d.handle)
    (out * out).sum().backward()
    return {
        "out": out.detach().numpy(),
        "x_grad": x.grad.numpy(),
        "probs_grad": probs.grad.numpy(),
        **info,
    }


def run_async_matches_sync(rank: int, world: int, paths: list[str]) -> dict[str, Any]:
    """Every path synchronously, then asynchronously with the other ranks held back until rank 0's
    ``start_*`` has returned (through the job's store): rank 0 can only get past ``start`` if it
    returns before its phases complete; a blocking ``start`` would hang until the timeout."""
    topo = RailTopology(num_nodes=world // 2, gpus_per_node=2)
    ex = TorchDistExchange(
        topo,
        build_rail_groups(None, topo, timeout_s=60.0),
        num_experts=_KW["experts"],
        timeout_s=60.0,
    )
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    for path in paths:
        sync = _layer(ex, rank, world, path, asynchronous=False)

        def between(direction: str, path: str = path) -> None:
            key = f"async/{path}/{direction}"
            if rank == 0:  # the others may post only now
                store.set(key, "posted")

        def held_back(direction: str, path: str = path) -> None:
            store.wait([f"async/{path}/{direction}"], datetime.timedelta(seconds=60))

        if rank == 0:
            asy = _layer(ex, rank, world, path, asynchronous=True, between=between)
        else:
            # Ranks 1.. start only after rank 0's start returned: block before their own start.
            original = ex.start_dispatch, ex.start_combine

            def start_dispatch(*a, _f=original[0], **k):
                held_back("dispatch")
                return _f(*a, **k)

            def start_combine(*a, _f=original[1], **k):
                held_back("combine")
                return _f(*a, **k)

            ex.start_dispatch, ex.start_combine = start_dispatch, start_combine
            try:
                asy = _layer(ex, rank, world, path, asynchronous=True)
            finally:
                del ex.start_dispatch, ex.start_combine
        out[path] = {"sync": sync, "async": asy}
    return out


def run_async_timeout(rank: int, world: int) -> str:
    """Rank 1 takes part in the count exchange and then never dispatches: rank 0's
    ``start_dispatch`` returns, and ``finish_dispatch`` raises ``ExchangeTimeoutError``."""
    topo = RailTopology(num_nodes=world // 2, gpus_per_node=2)
    ex = TorchDistExchange(
        topo,
        build_rail_groups(None, topo, timeout_s=3.0),
        num_experts=_KW["experts"],
        timeout_s=3.0,
    )
    x, probs, routing = make_inputs(rank, **_KW)
    layer = ex.gather_demand(x, probs, routing)
    handle = ex.prepare(layer, ex.plan(layer, "joint"), x, probs)
    if rank == 1:  # alive but silent past the others' timeout (an exit would close its connections)
        time.sleep(8.0)
        return "silent"
    pending = ex.start_dispatch(x, probs, routing, handle)
    try:
        ex.finish_dispatch(x, probs, routing, pending)
    except ExchangeTimeoutError as exc:
        return f"ExchangeTimeoutError: {exc}"
    return "completed"
