"""The asynchronous exchange's stream and event ordering on one CUDA GPU (``exchange.pending``).

Prepared for ``make gpu-check``; NOT yet run on hardware (no GPU has been lent so far). Run:

    python -m pytest tests/unit/exchange/test_async_gpu.py -m gpu -q

1. Virtual cluster (every rank of a 4 x 2 topology in this process): dispatch, linear experts and
   combine, each direction run on the exchange's communication stream by ``run_on_comm_stream``
   and joined by ``finish``, exactly as ``TorchDistExchange.start_*`` / ``finish_*`` do. Both
   races are provoked: the inputs are written on the current stream behind a ~50 ms spin kernel
   (a communication stream that did not wait would read them unwritten), and the communication
   stream itself starts with a spin kernel (a consumer that did not wait on the event would read
   the outputs unwritten). The results must equal the synchronous run bit for bit, every path.
2. ``TorchDistExchange`` on a one-rank NCCL group: ``start_dispatch`` / ``finish_dispatch`` and
   ``start_combine`` / ``finish_combine`` against ``dispatch`` / ``combine``, bitwise, with the
   same delayed inputs.
3. Fixed-capacity mode's online timing reduce (``exchange.timing_reduce``) on that group: posted
   behind a spin kernel, it does not wait on the host; its result is read from the pinned copy.
"""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.exchange import (
    RankContext,
    VirtualCluster,
    combine_forward,
    dispatch_forward,
    gather_demand,
    prepare_layer,
    virtual_rank_groups,
)
from megatron_railwave.exchange.pending import comm_stream_for, finish, run_on_comm_stream
from megatron_railwave.names import ROUTES
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.topology import RailTopology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PATHS = list(map(str, ROUTES))
_SPIN_CYCLES = 100_000_000  # ~50 ms at 2 GHz: far longer than the host needs to enqueue a layer


def _inputs(w: int, t: int, h: int, e: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(w):
        idx = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
        rm = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
        p = torch.softmax(torch.randn(t, e, generator=gen), dim=1) * rm
        out.append((torch.randn(t, h, generator=gen).cuda(), p.cuda(), rm.cuda()))
    return out


def _delayed(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` written on the current stream behind a spin kernel."""
    y = torch.empty_like(x)
    torch.cuda._sleep(_SPIN_CYCLES)
    y.copy_(x)
    return y


def _virtual_layer(topo: RailTopology, inputs, path: str, *, asynchronous: bool):
    w, e = topo.world_size, inputs[0][1].shape[1]
    ctxs = [
        RankContext(
            topo=topo, groups=virtual_rank_groups(topo, r), num_experts=e, options=PlanOptions()
        )
        for r in range(w)
    ]
    cluster = VirtualCluster(world_size=w)
    layers = cluster.run([gather_demand(ctxs[r], *inputs[r]) for r in range(w)])
    handles = [
        prepare_layer(
            ctxs[r],
            layers[r],
            build_plan(layers[r].demand, topo, path),
            hidden_dtype=torch.float32,
            probs_dtype=torch.float32,
            hidden_size=inputs[r][0].shape[1],
        )
        for r in range(w)
    ]
    hidden = [_delayed(inputs[r][0]) if asynchronous else inputs[r][0] for r in range(w)]

    def dispatch():
        if asynchronous:
            torch.cuda._sleep(_SPIN_CYCLES)  # the consumer must wait for this stream's event
        return cluster.run(
            [
                dispatch_forward(ctxs[r], handles[r], hidden[r], inputs[r][1], inputs[r][2])
                for r in range(w)
            ]
        )

    if asynchronous:
        stream = comm_stream_for(hidden[0].device)
        dispatched = finish(run_on_comm_stream(dispatch, stream, inputs=tuple(hidden)))
    else:
        dispatched = dispatch()
    ys = [
        (d[0] * d[1].unsqueeze(1)) * 0.5 + 1.0 for d in dispatched
    ]  # consumed on the current stream

    def combine():
        if asynchronous:
            torch.cuda._sleep(_SPIN_CYCLES)
        return cluster.run(
            [combine_forward(ctxs[r], handles[r], dispatched[r][2], ys[r]) for r in range(w)]
        )

    outs = (
        finish(run_on_comm_stream(combine, stream, inputs=tuple(ys))) if asynchronous else combine()
    )
    outs = [o.clone() for o in outs]  # read on the current stream right after finish
    torch.cuda.synchronize()
    return [d[0].cpu() for d in dispatched], [o.cpu() for o in outs]


@pytest.mark.parametrize("path", PATHS)
def test_virtual_cluster_on_comm_stream_matches_sync_bitwise(path):
    topo = RailTopology(num_nodes=4, gpus_per_node=2)
    inputs = _inputs(topo.world_size, t=512, h=1024, e=32, k=4)
    ref_tokens, ref_out = _virtual_layer(topo, inputs, path, asynchronous=False)
    tokens, out = _virtual_layer(topo, inputs, path, asynchronous=True)
    for r in range(topo.world_size):
        assert torch.equal(tokens[r], ref_tokens[r]), f"rank {r}: dispatched tokens differ"
        assert torch.equal(out[r], ref_out[r]), f"rank {r}: combined output differs"


def test_torch_dist_start_finish_on_one_rank_nccl(tmp_path):
    import torch.distributed as dist

    from megatron_railwave.exchange import TorchDistExchange, build_rail_groups

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        topo = RailTopology(num_nodes=1, gpus_per_node=1)
        ex = TorchDistExchange(topo, build_rail_groups(None, topo), num_experts=4, timeout_s=60.0)
        ((x, probs, routing),) = _inputs(1, t=256, h=512, e=4, k=2, seed=1)
        layer = ex.gather_demand(x, probs, routing)
        handle = ex.prepare(layer, ex.plan(layer, "joint"), x, probs)
        ref = ex.dispatch(x, probs, routing, handle)
        ref_out = ex.combine(ref.tokens * 2.0, ref.handle).clone()
        xd = _delayed(x)
        got = ex.finish_dispatch(xd, probs, routing, ex.start_dispatch(xd, probs, routing, handle))
        y = got.tokens * 2.0
        out = ex.finish_combine(y, ex.start_combine(y, got.handle)).clone()
        torch.cuda.synchronize()
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.probs, ref.probs)
        assert torch.equal(out, ref_out)
    finally:
        dist.destroy_process_group()


def test_timing_reduce_on_one_rank_nccl_does_not_wait_on_the_host(tmp_path):
    """Fixed-capacity mode's online timing reduce (``exchange.timing_reduce``) on CUDA: posted
    behind a spin kernel on the current stream, it returns before the spin ends (its event is
    not complete right after posting: the host did not wait), and ``result`` then reads the
    pair from the pinned copy: (word, word) on one rank."""
    import torch.distributed as dist

    from megatron_railwave.exchange import build_rail_groups, post_timing_reduce

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        topo = RailTopology(num_nodes=1, gpus_per_node=1)
        # timeout_s 61: a key of its own in build_rail_groups' cache (the groups another test
        # cached died with its process group).
        groups = build_rail_groups(None, topo, timeout_s=61.0)
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize()
        torch.cuda._sleep(_SPIN_CYCLES)
        posted = post_timing_reduce(123_456, groups.ep, device=device, timeout_s=60.0)
        assert posted.event is not None and not posted.event.query()
        assert posted.result() == (123_456, 123_456)
    finally:
        dist.destroy_process_group()
