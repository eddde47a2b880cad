"""``exchange.pending`` in one gloo process (world 1): start / finish equal the synchronous
exchange bit for bit, and the CUDA branch's bookkeeping (driven on CPU with stream stand-ins:
the stream / event ordering itself is tests/unit/exchange/test_async_gpu.py, GPU only)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import megatron_railwave.exchange.driver as driver
from megatron_railwave.exchange import TorchDistExchange, build_rail_groups
from megatron_railwave.exchange.pending import finish
from megatron_railwave.topology import RailTopology


class _Stream:
    """Records what the CUDA protocol asks of a stream (CPU stand-in)."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.calls: list[str] = []

    def wait_stream(self, stream: object) -> None:
        self.calls.append("wait_stream")

    def wait_event(self, event: object) -> None:
        self.calls.append("wait_event")

    def record_event(self) -> str:
        self.calls.append("record_event")
        return "event"


@pytest.fixture(scope="module")
def exchange():
    # One process group for the module: build_rail_groups caches the groups per membership.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    topo = RailTopology(num_nodes=1, gpus_per_node=1)
    try:
        yield TorchDistExchange(topo, build_rail_groups(None, topo), num_experts=4, timeout_s=30.0)
    finally:
        dist.destroy_process_group()


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=gen, requires_grad=True)
    routing = torch.zeros(16, 4, dtype=torch.bool).scatter_(
        1, torch.rand(16, 4, generator=gen).topk(2, dim=1).indices, True
    )
    probs = (torch.rand(16, 4, generator=gen) * routing).requires_grad_(True)
    return x, probs, routing


def _layer(ex: TorchDistExchange, asynchronous: bool):
    x, probs, routing = _inputs()
    layer = ex.gather_demand(x, probs, routing)
    handle = ex.prepare(layer, ex.plan(layer, "joint"), x, probs)
    if asynchronous:
        d = ex.finish_dispatch(x, probs, routing, ex.start_dispatch(x, probs, routing, handle))
        y = d.tokens * d.probs.unsqueeze(1)
        out = ex.finish_combine(y, ex.start_combine(y, d.handle))
    else:
        d = ex.dispatch(x, probs, routing, handle)
        out = ex.combine(d.tokens * d.probs.unsqueeze(1), d.handle)
    (out * out).sum().backward()
    return out.detach(), x.grad, probs.grad


@pytest.mark.parametrize("cuda_branch", [False, True], ids=["gloo", "cuda-bookkeeping"])
def test_start_finish_equals_dispatch_combine_bitwise(exchange, monkeypatch, cuda_branch):
    ref = _layer(exchange, asynchronous=False)
    streams: list[_Stream] = []
    current = _Stream()
    waits_seen: list[bool] = []
    if cuda_branch:
        original_wait, original_start, in_start = exchange.transport.wait, driver.start, [False]

        def wait(ticket):  # (inside start, stream wait) of every phase wait
            waits_seen.append((in_start[0], exchange.transport.device_waits))
            return original_wait(ticket)

        def start(*args, **kwargs):
            in_start[0] = True
            try:
                return original_start(*args, **kwargs)
            finally:
                in_start[0] = False

        monkeypatch.setattr(exchange.transport, "wait", wait)
        monkeypatch.setattr(driver, "start", start)
        monkeypatch.setattr(
            driver, "comm_stream_for", lambda device: streams.append(_Stream()) or streams[-1]
        )
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    got = _layer(exchange, asynchronous=True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    if cuda_branch:
        assert len(streams) == 2  # dispatch, combine
        assert all(s.calls == ["wait_stream", "record_event"] for s in streams)
        assert current.calls == ["wait_event", "wait_event"]  # finish_dispatch, finish_combine
        # The forward programs' waits (inside start, on the comm stream) are stream waits; the
        # backward programs (autograd, synchronous) keep the bounded host waits.
        assert (True, True) in waits_seen and (False, False) in waits_seen
        assert all(inside == stream_wait for inside, stream_wait in waits_seen)
        assert not exchange.transport.device_waits


def test_finish_twice_raises(exchange):
    x, probs, routing = _inputs()
    layer = exchange.gather_demand(x, probs, routing)
    pending = exchange.start_dispatch(
        x, probs, routing, exchange.prepare(layer, exchange.plan(layer, "joint"), x, probs)
    )
    finish(pending.program)
    with pytest.raises(RuntimeError, match="finished twice"):
        finish(pending.program)


def test_comm_stream_is_created_with_the_highest_priority(monkeypatch):
    """The exchange's communication stream asks CUDA for its greatest priority (the lowest
    number, as DeepEP's comm stream); other purposes keep the default. Fake CUDA streams: no GPU
    here (not yet run on hardware)."""
    from megatron_railwave.exchange import pending

    made = []

    class FakeStream:
        def __init__(self, device=None, priority=0):
            made.append((device, priority))

        @staticmethod
        def priority_range():
            return (0, -5)  # (least, greatest), as cudaDeviceGetStreamPriorityRange on H100

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(pending, "_STREAMS", {})
    dev = torch.device("cuda", 0)
    comm = pending.comm_stream_for(dev)
    assert pending.comm_stream_for(dev) is comm  # one per device
    pending.stream_for(dev, "timing reduce")
    assert made == [(dev, -5), (dev, 0)]
    assert pending.comm_stream_for(torch.device("cpu")) is None
