"""How TorchDistTransport waits, by backend, with fake process groups and Work objects on CPU.

On NCCL (torch >= 2.4) ``Work.wait(timeout)`` polls on the host until the work completes and, on
timeout, aborts the communicator; ``Work.wait()`` makes the current stream wait. The transport
therefore waits on the stream on NCCL (the groups' own timeout bounds the work) and keeps the
host-side, bounded wait for gloo. The old transport gave every wait the timeout: a host sync per
phase on NCCL (32 per layer for JOINT at 4 x 8).
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_railwave.exchange import groups as groups_module
from megatron_railwave.exchange.transport import (
    Collective,
    GroupRef,
    Post,
    TorchDistTransport,
    Wait,
    drive,
)


class FakeWork:
    """A Work that records how it was waited for."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.log.append(timeout)
        return True


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed's calls the transport makes, faked; ``backend`` is settable."""
    state = SimpleNamespace(backend="nccl", waits=[], posted=0)

    def batch_isend_irecv(ops):
        state.posted += 1
        return [FakeWork(state.waits) for _ in ops]

    monkeypatch.setattr(dist, "get_backend", lambda group=None: state.backend)
    monkeypatch.setattr(
        dist, "P2POp", lambda op, tensor, group=None, group_peer=None, tag=0: (op, tensor)
    )
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(
        dist,
        "all_gather_into_tensor",
        lambda recv, send, group=None, async_op=False: FakeWork(state.waits),
    )
    return state


def _program(group: GroupRef, phases: int):
    """A rank program: one count all-gather, then ``phases`` point-to-point phases, each waited."""
    counts = torch.zeros(2, dtype=torch.int64)
    yield Collective(
        kind="all_gather",
        stage="counts",
        group=group,
        send=torch.zeros(1, dtype=torch.int64),
        recv=counts,
    )
    for k in range(phases):
        ticket = yield Post(
            tag=k,
            stage=f"phase {k}",
            group=group,
            sends=[None, torch.ones(3)],
            recvs=[None, torch.empty(3)],
        )
        yield Wait(ticket=ticket)
    return "done"


def _group() -> GroupRef:
    return GroupRef(kind="rail", index=0, ranks=(0, 1), handle=object(), label="rail 0")


def test_nccl_waits_are_stream_waits_no_host_bounded_wait_per_phase(fake_dist):
    fake_dist.backend = "nccl"
    transport = TorchDistTransport(rank=0, timeout_s=30.0)
    assert drive(_program(_group(), phases=6), transport) == "done"
    assert fake_dist.posted == 6
    assert len(fake_dist.waits) == 6 * 2 + 1  # a send and a receive per phase, the all-gather
    assert fake_dist.waits == [None] * len(fake_dist.waits)  # Work.wait(): the stream waits


def test_gloo_keeps_the_bounded_host_wait(fake_dist):
    fake_dist.backend = "gloo"
    transport = TorchDistTransport(rank=0, timeout_s=30.0, flat_collectives=False)
    drive(_program(_group(), phases=3), transport)
    assert fake_dist.waits == [datetime.timedelta(seconds=30.0)] * (3 * 2 + 1)


def test_gloo_wait_that_runs_out_reports_the_stage(fake_dist, monkeypatch):
    fake_dist.backend = "gloo"

    class Late(FakeWork):
        def wait(self, timeout=None):
            super().wait(timeout)
            return False

    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [Late(fake_dist.waits) for _ in ops])
    monkeypatch.setattr(
        dist, "all_gather_into_tensor", lambda recv, send, group=None, async_op=False: FakeWork([])
    )
    transport = TorchDistTransport(rank=0, timeout_s=0.01, flat_collectives=False)
    with pytest.raises(
        Exception, match="stage 'phase 0' on rail 0 .* did not complete within 0.01 s"
    ):
        drive(_program(_group(), phases=1), transport)


def test_group_creation_lifts_a_bound_default_group_so_no_world_split_is_needed(monkeypatch):
    # With the default group bound to a device, torch makes each new NCCL group by splitting the
    # world communicator: every world rank must take part, which member-only creation
    # (use_local_synchronization=True) never gives, so the job hangs. build_rail_groups creates
    # its groups with the binding lifted (member-only communicators) and restores it after.
    default = SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    seen = []

    def new_group(ranks, timeout=None, use_local_synchronization=False):
        seen.append((tuple(ranks), default.bound_device_id, use_local_synchronization, timeout))
        return SimpleNamespace(ranks=tuple(ranks))

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(
        dist, "get_process_group_ranks", lambda g: list(g.ranks) if g is not None else [0, 1, 2, 3]
    )
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: None)
    from megatron_railwave.topology import RailTopology

    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    groups_module._CACHE.clear()
    built = groups_module.build_rail_groups(None, topo, timeout_s=42.0)
    groups_module._CACHE.clear()
    assert [s[0] for s in seen] == [(0, 1, 2, 3), (2, 3), (1, 3)]  # EP, node 1, rail 1 of rank 3
    assert all(bound is None for _, bound, _, _ in seen)  # no split of the world communicator
    assert all(local for _, _, local, _ in seen)  # only members take part
    assert all(
        t == datetime.timedelta(seconds=42.0) for *_, t in seen
    )  # the groups carry timeout_s
    assert default.bound_device_id == torch.device("cuda", 0)  # restored
    assert built.railwave_rank == 3


def _count_program(group: GroupRef, *, host_read: bool):
    yield Collective(
        kind="all_gather",
        stage="count exchange",
        group=group,
        send=torch.zeros(1, dtype=torch.int64),
        recv=torch.zeros(2, dtype=torch.int64),
        host_read=host_read,
    )
    return "done"


class _Event:
    def __init__(self, done: bool) -> None:
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_nccl_count_exchange_read_is_bounded_and_aborts_past_timeout_s(fake_dist, monkeypatch):
    """A peer that never joins the count exchange: on NCCL the host read would block until the
    watchdog; the transport waits on an event up to timeout_s, aborts the groups and names the
    stage. Not yet run on hardware (fake events)."""
    fake_dist.backend = "nccl"
    aborted = []
    transport = TorchDistTransport(rank=0, timeout_s=0.2, abort=lambda: aborted.append(1))
    monkeypatch.setattr(transport, "_device_event", lambda recv: _Event(done=False))
    with pytest.raises(
        Exception, match="stage 'count exchange' on rail 0 .* did not complete within 0.2 s"
    ):
        drive(_count_program(_group(), host_read=True), transport)
    assert aborted == [1]


def test_nccl_count_exchange_read_waits_on_the_event_only_when_read(fake_dist, monkeypatch):
    fake_dist.backend = "nccl"
    events = []

    def device_event(recv):
        events.append(_Event(done=True))
        return events[-1]

    transport = TorchDistTransport(rank=0, timeout_s=5.0, abort=lambda: pytest.fail("aborted"))
    monkeypatch.setattr(transport, "_device_event", device_event)
    assert drive(_count_program(_group(), host_read=True), transport) == "done"
    assert len(events) == 1 and events[0].queries == 1
    assert drive(_count_program(_group(), host_read=False), transport) == "done"
    assert len(events) == 1  # no read, no event: the stream wait alone
