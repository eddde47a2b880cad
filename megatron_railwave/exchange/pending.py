"""The asynchronous exchange: start a rank program, let the caller compute, finish it later.

What Megatron's ``flex`` dispatcher gets from DeepEP's ``async_finish`` and
``allocate_on_comm_stream`` (the shared expert's fc1 / fc2 and the 1F1B EP-overlap schedule
compute while dispatch / combine travel), for RailWave's rank programs:

* ``start(program, transport)`` runs the program until it would block, and returns.

  - gloo (CPU tensors): up to the first ``Wait`` whose phase is still in flight
    (``TorchDistTransport.in_flight``; a held flat phase is started there). The posted works
    progress on gloo's own threads while the caller computes on the host.
  - CUDA (``comm_stream`` given): the communication stream first waits on the current stream
    (the inputs are ready), then the whole program is driven on it with stream waits
    (``TorchDistTransport.device_waits``: no timeout argument, which on NCCL would block the
    host), so the host returns once every phase is enqueued; the phases are then bounded by the
    groups' timeout (NCCL's watchdog) rather than by a named ``ExchangeTimeoutError``. An event
    is recorded at the end and the inputs are marked as used on the communication stream.

* ``finish(pending)`` returns the program's result.

  - gloo: drives the rest of the program; every wait is bounded by ``timeout_s`` as in ``drive``
    and a failure raises the same ``ExchangeError`` naming the stage and the peers.
  - CUDA: the current stream waits on the event (no host sync) and the output tensors, made on
    the communication stream, are marked as used on the current stream.

A started program must be finished exactly once, in program order per group on every rank (as
``drive`` would have run it): the rank programs of one layer's dispatch and combine are never
interleaved with another program on the same groups between ``start`` and ``finish``.

The CUDA half has not yet run on hardware (no GPU lent so far); the prepared check is
``tests/unit/exchange/test_async_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_railwave.exchange.transport import Program, TorchDistTransport, Wait, answer, drive

__all__ = [
    "PendingProgram",
    "start",
    "finish",
    "stream_for",
    "copy_to_host_after",
    "comm_stream_for",
    "run_on_comm_stream",
]

_STREAMS: dict[tuple[str, torch.device], Any] = {}


def stream_for(device: torch.device, purpose: str, *, high_priority: bool = False) -> Any:
    """A CUDA stream of its own per ``purpose`` and device (one per process, created on first
    use): work on it queues behind that purpose's work only. None for any other device.

    ``high_priority``: created with the device's highest stream priority
    (``torch.cuda.Stream.priority_range()``: (least, greatest), the greatest the lowest number),
    so its kernels are scheduled ahead of compute kernels waiting for SMs, as DeepEP's
    communication stream is (``getStreamFromPool(true)``). Not yet run on hardware."""
    if device.type != "cuda":
        return None
    key = (
        purpose,
        torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        ),
    )
    stream = _STREAMS.get(key)
    if stream is None:
        priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0
        stream = torch.cuda.Stream(device=key[1], priority=priority)
        _STREAMS[key] = stream
    return stream


def copy_to_host_after(work: Any, tensor: torch.Tensor, purpose: str) -> tuple[torch.Tensor, Any]:
    """(pinned host copy, event): ``tensor`` (CUDA) copied to pinned host memory on the side stream
    of ``purpose`` once the collective ``work`` is done, and the event recorded after the copy.

    A stream wait, not a host wait: the host reads the copy once ``event.query()`` says so
    (``status.StatusWatch``) or after a bounded wait (``transport.wait_event``). A stream of its
    own, not the exchange's communication stream, whose programs it would queue behind."""
    side = stream_for(tensor.device, purpose)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        work.wait()  # the side stream waits for NCCL's; the host does not
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    tensor.record_stream(side)
    return host, event


def comm_stream_for(device: torch.device) -> Any:
    """The exchange's communication stream of a CUDA ``device`` (high priority, see
    ``stream_for``); None for any other device."""
    return stream_for(device, "exchange", high_priority=True)


@dataclass(kw_only=True, slots=True)
class PendingProgram:
    """A started rank program (``start``): what ``finish`` needs to complete it.

    Attributes:
        program: the generator, positioned at ``request`` (None once it has returned).
        transport: the transport it runs over.
        request: the request to answer next (gloo: the ``Wait`` that would have blocked).
        result: the program's return value once it has returned.
        event: CUDA: recorded on ``stream`` after the program's last kernel; None on gloo.
        stream: CUDA: the communication stream the program ran on; None on gloo.
        finished: set by ``finish`` (a second ``finish`` raises).
    """

    program: Program | None
    transport: TorchDistTransport | None
    request: Any = None
    result: Any = None
    event: Any = None
    stream: Any = None
    finished: bool = False


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a result: the value itself, or those inside (nested) tuples / lists. Tensors
    inside other objects (an ``ExchangeHandle``'s index maps) are read later only by work that is
    ordered after the next ``start``'s ``wait_stream``, so the allocator may not reuse them
    early."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _advance(pending: PendingProgram, reply: Any, *, until_blocked: bool) -> None:
    """Send ``reply`` and answer requests until the program returns (or, with ``until_blocked``,
    until a ``Wait`` on a phase still in flight, which is kept unanswered in ``request``)."""
    program = pending.program
    assert program is not None
    try:
        request = program.send(reply)
        while True:
            if (
                until_blocked
                and isinstance(request, Wait)
                and pending.transport.in_flight(request.ticket)
            ):
                pending.request = request
                return
            request = program.send(answer(request, pending.transport))
    except StopIteration as stop:
        pending.result, pending.program, pending.request = stop.value, None, None


def start(
    program: Program,
    transport: TorchDistTransport,
    *,
    comm_stream: Any = None,
    inputs: tuple[torch.Tensor, ...] = (),
) -> PendingProgram:
    """Start ``program`` (see the module docstring); returns what ``finish`` takes.

    Args:
        program: a rank program (generator of ``Post`` / ``Wait`` / ``Collective``).
        transport: the rank's ``TorchDistTransport``.
        comm_stream: CUDA: the communication stream (``comm_stream_for``); None: gloo behaviour.
        inputs: CUDA: the tensors the program reads, made on the current stream (marked as used
            on ``comm_stream`` so that the allocator does not reuse them while it runs).

    Collective: whatever the program posts. Host sync: none of its own.
    """
    if comm_stream is not None:

        def work() -> Any:
            saved, transport.device_waits = transport.device_waits, True
            try:
                return drive(program, transport)
            finally:
                transport.device_waits = saved

        return run_on_comm_stream(work, comm_stream, inputs=inputs, transport=transport)
    pending = PendingProgram(program=program, transport=transport)
    _advance(pending, None, until_blocked=True)
    return pending


def run_on_comm_stream(
    work: Any, comm_stream: Any, *, inputs: tuple[torch.Tensor, ...] = (), transport: Any = None
) -> PendingProgram:
    """CUDA: run ``work()`` (a driver of rank programs) on ``comm_stream`` after it waited on the
    current stream; ``finish`` then joins it (the stream and event protocol of ``start``, also
    for the in-process virtual cluster in the GPU check). No host sync."""
    current = torch.cuda.current_stream(comm_stream.device)
    comm_stream.wait_stream(current)
    for t in inputs:
        if t.is_cuda:
            t.record_stream(comm_stream)
    with torch.cuda.stream(comm_stream):
        result = work()
        event = comm_stream.record_event()
    return PendingProgram(
        program=None, transport=transport, result=result, event=event, stream=comm_stream
    )


def finish(pending: PendingProgram) -> Any:
    """Complete a started program and return its result (see the module docstring).

    Raises:
        ExchangeError / ExchangeTimeoutError: a phase failed or did not complete in ``timeout_s``.
        RuntimeError: ``pending`` was already finished.
    """
    if pending.finished:
        raise RuntimeError("internal: an exchange program was finished twice")
    pending.finished = True
    if pending.stream is not None:
        current = torch.cuda.current_stream(pending.stream.device)
        current.wait_event(pending.event)
        for t in _tensors(pending.result):
            if t.is_cuda:
                t.record_stream(current)
        return pending.result
    if pending.program is not None:
        request, pending.request = pending.request, None
        _advance(pending, answer(request, pending.transport), until_blocked=False)
    return pending.result
