"""Transports under the exchange: how one rank's program reaches its peers.

The exchange is written as *rank programs*: Python generators that yield communication
requests and get the results sent back. A driver connects a program to a transport:

* ``TorchDistTransport`` (``drive``): torch.distributed point-to-point batches and
  collectives (NCCL on GPUs, gloo on CPU), for real multi-process jobs;
* ``exchange.virtual.VirtualCluster``: every rank's program in one process on one device,
  moving buffers by local copies, phase by phase (tests and ``railwave simulate-exchange``).

Requests:
    ``Post(tag, group, sends, recvs)``: post the sends and receives of one phase (contiguous
        per-peer buffers; non-blocking); the answer is a ticket.
    ``Wait(ticket)``: the phase's buffers are complete for all work that follows (receives
        written in place): gloo waits on the host; NCCL makes the current stream wait, no host
        sync (``TorchDistTransport._wait_work``).
    ``Collective(kind, group, send, recv)``: a blocking all-gather or all-to-all.
Peers are group ranks. A program never posts to itself: it copies its own chunk.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "GroupRef",
    "FlatBlocks",
    "Post",
    "Wait",
    "Collective",
    "Program",
    "ExchangeError",
    "ExchangeTimeoutError",
    "TorchDistTransport",
    "answer",
    "drive",
    "wait_event",
]


class ExchangeError(RuntimeError):
    """A communication step of the exchange failed; the text names the stage and the peers."""


class ExchangeTimeoutError(ExchangeError):
    """A communication step did not complete within ``timeout_s``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupRef:
    """A communication group of one rank.

    Attributes:
        kind: 'ep' (the whole expert-parallel group, for the count exchange), 'node' or 'rail'.
        index: node index (node group), rail index (rail group), 0 for 'ep'.
        ranks: railwave ranks (node * G + local; ``exchange.placement``) of the members, in the
            order the rank programs index them (node group: local GPU; rail group: node).
        handle: the ``torch.distributed`` process group (None in the virtual cluster).
    """

    kind: Literal["ep", "node", "rail"]
    index: int
    ranks: tuple[int, ...]
    handle: Any = None
    label: str = ""
    """How errors name the group (e.g. 'rail 1 (GPU 1 of every node)')."""
    group_ranks: tuple[int, ...] | None = None
    """torch.distributed group rank of each member (``ranks`` order); None: the same order.
    ``torch.distributed.new_group`` orders members by global rank, which differs from the
    railwave order when the launcher numbers ranks another way (``exchange.placement``)."""

    def peer(self, index: int) -> int:
        """The torch.distributed group rank of member ``index``."""
        return index if self.group_ranks is None else self.group_ranks[index]

    def describe(self) -> str:
        if self.label:
            return self.label
        return "the EP group" if self.kind == "ep" else f"{self.kind} group {self.index}"


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatBlocks:
    """The same phase as one buffer per direction: ``send`` holds the blocks for every group
    peer in peer order (the own block included), ``send_rows[p]`` rows each; ``recv`` likewise.
    A transport may then move the phase as one all-to-all (``TorchDistTransport``)."""

    send: torch.Tensor
    send_rows: list[int]
    recv: torch.Tensor
    recv_rows: list[int]


@dataclass(kw_only=True, slots=True)
class Post:
    """Start one phase: ``sends[p]`` to group peer p, ``recvs[p]`` preallocated from peer p
    (None or zero rows: nothing).

    ``flat`` (optional) describes the same phase as contiguous blocks. Programs set it from the
    schedule alone (phase kind, number of waves), so every member of the group sets it for the
    same phases: a transport that turns such phases into collectives needs exactly that."""

    tag: int
    stage: str
    group: GroupRef
    sends: list[torch.Tensor | None]
    recvs: list[torch.Tensor | None]
    flat: FlatBlocks | None = None
    hold: bool = False
    """The program posts another phase with ``flat`` on this group before it waits for this one
    (set from the schedule alone, so on every member alike): a transport that moves flat phases
    as collectives may hold this one and move both as one all-to-all."""


@dataclass(kw_only=True, slots=True)
class Wait:
    ticket: Any


@dataclass(kw_only=True, slots=True)
class Collective:
    """A blocking collective on ``group``: 'all_gather' (recv [P * n] <- send [n]) or
    'all_to_all' (send [P, k] -> recv [P, k])."""

    kind: Literal["all_gather", "all_to_all"]
    stage: str
    group: GroupRef
    send: torch.Tensor
    recv: torch.Tensor
    host_read: bool = False
    """The program reads ``recv`` on the host right after (the count exchange). On NCCL the
    transport then waits for it itself, bounded by ``timeout_s`` (``wait_event``; aborting the
    groups past it and naming the stage), so the read never blocks until the NCCL watchdog. It
    adds no host sync: the program's read is that sync, one copy later."""


Program = Generator[Any, Any, Any]
"""A rank program: yields ``Post`` / ``Wait`` / ``Collective``, returns its result."""


def _nonempty(t: torch.Tensor | None) -> bool:
    return t is not None and t.numel() > 0


@dataclass(kw_only=True, slots=True)
class _Ticket:
    post: Post
    works: list[Any]
    peers: list[int]
    started: float
    finish: Callable[[], None] | None = None
    """Runs after the works complete (reorders an all-to-all's blocks for rare rank orders)."""
    held: bool = False
    """Not started yet: a held flat phase (``Post.hold``), waiting for the next one on its group."""
    joined: _Ticket | None = None
    """The ticket of the all-to-all that moves this held phase together with the next one."""


@dataclass(kw_only=True)
class TorchDistTransport:
    """Drives rank programs over torch.distributed.

    Args:
        rank: this rank's railwave rank.
        ep_rank_of: Megatron EP rank of each railwave rank, for messages (None: the same).
        timeout_s: limit of every wait (None: the process groups' own timeouts). The groups
            are created with the same timeout (``groups.build_rail_groups``). How a wait is
            bounded depends on the group's backend (``_wait_work``): gloo waits on the host,
            polling up to ``timeout_s`` and raising ``ExchangeTimeoutError``; NCCL waits on the
            stream (``Work.wait()``: no host sync) and the group's own timeout, enforced by
            NCCL's watchdog, bounds it (the watchdog aborts the communicator: torch's error,
            not ours).
        survey: on a failure, ``survey(stage, group)`` returns the group's members that did not
            report reaching the stage (``groups.survey_unresponsive``); None names no one.
        explain: on a failure, ``explain()`` returns text naming what peers reported about the
            layer (``groups.reported_failures``: e.g. a peer's capacity overflow); None: nothing.
            abort: aborts the exchange's process groups (``exchange.status.abort_groups``), called
            when a bounded device wait (``Collective.host_read``) runs out; None: no abort.
        bytes_sent / bytes_received: per stage, bytes this rank handed to sends and receives.
    """

    rank: int
    timeout_s: float | None = None
    ep_rank_of: tuple[int, ...] | None = None
    survey: Callable[[str, GroupRef], list[int]] | None = None
    explain: Callable[[], str] | None = None
    abort: Callable[[], None] | None = None
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    flat_collectives: bool = True
    """Run phases given as ``FlatBlocks`` as one all-to-all where the group is gloo (see
    ``_flat_collectives``); False: always point-to-point. Programs give no ``FlatBlocks`` for a
    rail group with a failed member (``moves._flat``): an all-to-all would wait on it forever.
    A rail failing without being listed raises ``ExchangeTimeoutError`` after ``timeout_s`` in
    both forms (the 2 x 2 testbed fault test)."""
    device_waits: bool = False
    """Wait for phases without a timeout argument on every backend (``exchange.pending`` sets it
    while it drives a program on a CUDA communication stream). NCCL never gets a timed wait
    (``_wait_work``); this also drops gloo's host-polling wait there. The phases are then
    bounded by the groups' own timeout (the same ``timeout_s``, enforced by NCCL's watchdog), not
    by an ``ExchangeTimeoutError`` naming the stage."""
    _orders: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )
    _backend_is_gloo: dict[int, bool] = field(default_factory=dict, repr=False)
    _held: dict[int, _Ticket] = field(default_factory=dict, repr=False)
    """Held flat phase per group (key: id of the process group), at most one."""

    def post(self, req: Post) -> _Ticket:
        group = req.group
        held = self._held.pop(id(group.handle), None)
        if req.flat is not None and self._flat_collectives(group):
            self._count_flat(req)
            if held is not None and _joinable(held.post.flat, req.flat):
                return self._post_joined(held, req)
            if held is not None:
                self._start_held(held)
            if req.hold:
                ticket = _Ticket(post=req, works=[], peers=[], started=time.monotonic(), held=True)
                self._held[id(group.handle)] = ticket
                return ticket
            return self._post_all_to_all(req.stage, group, req.flat)
        if held is not None:  # collectives of a group start in program order on every member
            self._start_held(held)
        ops, peers = [], []
        # Receives first: on gloo's TCP pairs, two ranks exchanging both ways otherwise take turns.
        for peer, buf in enumerate(req.recvs):
            if _nonempty(buf) and peer != self._me(group):
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        buf,
                        group=group.handle,
                        group_peer=group.peer(peer),
                        tag=req.tag,
                    )
                )
                peers.append(peer)
                self.bytes_received[req.stage] = self.bytes_received.get(req.stage, 0) + _nbytes(
                    buf
                )
        for peer, buf in enumerate(req.sends):
            if _nonempty(buf) and peer != self._me(group):
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        buf,
                        group=group.handle,
                        group_peer=group.peer(peer),
                        tag=req.tag,
                    )
                )
                peers.append(peer)
                self.bytes_sent[req.stage] = self.bytes_sent.get(req.stage, 0) + _nbytes(buf)
        started = time.monotonic()
        try:
            works = list(dist.batch_isend_irecv(ops)) if ops else []
        except Exception as exc:  # noqa: BLE001 - a failed post names the stage too
            raise self._error(req.stage, group, peers, started, exc) from exc
        return _Ticket(post=req, works=works, peers=peers, started=started)

    def _is_gloo(self, group: GroupRef) -> bool:
        """Whether ``group``'s backend is gloo (cached per process group)."""
        key = id(group.handle)
        if key not in self._backend_is_gloo:
            self._backend_is_gloo[key] = dist.get_backend(group.handle) == "gloo"
        return self._backend_is_gloo[key]

    def _wait_work(self, work: Any, group: GroupRef) -> Any:
        """Wait for one ``Work``. gloo: on the host, up to ``timeout_s`` (False or an exception
        when it runs out). Any other backend (NCCL): ``work.wait()`` without a timeout, which
        makes the current stream wait for the communication and returns at once: on torch >= 2.4
        ``wait(timeout)`` on NCCL polls on the host until the work completes (a host sync per
        phase) and on timeout aborts the communicator. The process group's own timeout bounds
        the NCCL work instead (the groups are created with ``timeout_s``)."""
        if self.timeout_s and not self.device_waits and self._is_gloo(group):
            return work.wait(datetime.timedelta(seconds=self.timeout_s))
        return work.wait()

    def _flat_collectives(self, group: GroupRef) -> bool:
        """Whether phases with ``FlatBlocks`` run as one all-to-all on ``group``: on gloo, where
        one alltoallv costs about what one point-to-point message does and a phase would
        otherwise post up to 2 (P - 1) of them; NCCL runs both as the same grouped send/recv
        calls, so it keeps the point-to-point batch. The same on every member (the group's
        backend), as a collective requires."""
        if not self.flat_collectives or group.handle is None:
            return False
        return self._is_gloo(group)

    def _count_flat(self, req: Post) -> None:
        """Bytes of a flat phase, like the point-to-point form: all blocks but the own one."""
        flat, me = req.flat, self._me(req.group)
        assert flat is not None
        sent = (sum(flat.send_rows) - flat.send_rows[me]) * _row_nbytes(flat.send)
        received = (sum(flat.recv_rows) - flat.recv_rows[me]) * _row_nbytes(flat.recv)
        if sent:
            self.bytes_sent[req.stage] = self.bytes_sent.get(req.stage, 0) + sent
        if received:
            self.bytes_received[req.stage] = self.bytes_received.get(req.stage, 0) + received

    def _start_held(self, ticket: _Ticket) -> None:
        """Start a held phase alone (the program waits for it, or posts something else first)."""
        assert ticket.post.flat is not None
        started = self._post_all_to_all(ticket.post.stage, ticket.post.group, ticket.post.flat)
        ticket.works, ticket.peers, ticket.finish, ticket.started = (
            started.works,
            started.peers,
            started.finish,
            started.started,
        )
        ticket.held = False

    def _post_joined(self, held: _Ticket, req: Post) -> _Ticket:
        """One all-to-all for a held phase and the next flat phase of its group: each peer's
        block is the held phase's block, then this phase's; the received blocks are split back
        into both phases' buffers when the all-to-all completes."""
        a, b = held.post.flat, req.flat
        assert a is not None and b is not None
        a_send, b_send = a.send.split(a.send_rows), b.send.split(b.send_rows)
        send = torch.cat([t for pair in zip(a_send, b_send) for t in pair])
        send_rows = [x + y for x, y in zip(a.send_rows, b.send_rows)]
        recv_rows = [x + y for x, y in zip(a.recv_rows, b.recv_rows)]
        recv = b.recv.new_empty((sum(recv_rows),) + tuple(b.recv.shape[1:]))
        stage = f"{held.post.stage}+{req.stage}"
        ticket = self._post_all_to_all(
            stage,
            req.group,
            FlatBlocks(send=send, send_rows=send_rows, recv=recv, recv_rows=recv_rows),
        )
        reorder = ticket.finish

        def finish(recv=recv, a=a, b=b) -> None:
            if reorder is not None:
                reorder()
            parts = recv.split([r for pair in zip(a.recv_rows, b.recv_rows) for r in pair])
            torch.cat(parts[0::2], out=a.recv)
            torch.cat(parts[1::2], out=b.recv)

        ticket.finish = finish
        held.held, held.joined = False, ticket
        return ticket

    def _post_all_to_all(self, stage: str, group: GroupRef, flat: FlatBlocks) -> _Ticket:
        me = self._me(group)
        order = group.group_ranks
        send_rows, recv_rows = flat.send_rows, flat.recv_rows
        send, recv = flat.send, flat.recv
        if order is not None and list(order) != sorted(order):
            # Blocks in member order -> torch group-rank order (rare launcher orders): copies.
            by_group = sorted(range(len(order)), key=order.__getitem__)
            send = torch.cat([b for b in (send.split(send_rows)[m] for m in by_group)])
            send_rows = [send_rows[m] for m in by_group]
            recv = recv.new_empty(recv.shape)
            recv_rows_g = [recv_rows[m] for m in by_group]
        else:
            by_group, recv_rows_g = None, recv_rows
        peers = [p for p in range(len(group.ranks)) if p != me]
        started = time.monotonic()
        try:
            work = dist.all_to_all_single(
                recv, send, recv_rows_g, send_rows, group=group.handle, async_op=True
            )
        except Exception as exc:  # noqa: BLE001 - a failed post names the stage too
            raise self._error(stage, group, peers, started, exc) from exc
        finish = None
        if by_group is not None:

            def finish(
                recv=recv, by_group=by_group, recv_rows_g=recv_rows_g, out=flat.recv
            ) -> None:
                blocks = dict(zip(by_group, recv.split(recv_rows_g)))
                out.copy_(torch.cat([blocks[m] for m in range(len(by_group))]))

        post = Post(tag=-1, stage=stage, group=group, sends=[], recvs=[], flat=flat)
        return _Ticket(post=post, works=[work], peers=peers, started=started, finish=finish)

    def in_flight(self, ticket: _Ticket) -> bool:
        """Whether ``wait(ticket)`` would block now. Starts a held phase (as ``wait`` would), so
        that it travels while the caller computes (``exchange.pending``). Never blocks."""
        if ticket.held:
            self._held.pop(id(ticket.post.group.handle), None)
            self._start_held(ticket)
        if ticket.joined is not None:
            ticket = ticket.joined
        return not all(work.is_completed() for work in ticket.works)

    def wait(self, ticket: _Ticket) -> None:
        if ticket.held:
            self._held.pop(id(ticket.post.group.handle), None)
            self._start_held(ticket)
        if ticket.joined is not None:
            ticket = ticket.joined
        for work in ticket.works:
            try:
                done = self._wait_work(work, ticket.post.group)
            except Exception as exc:  # noqa: BLE001 - any failure of a wait names the stage
                raise self._error(
                    ticket.post.stage, ticket.post.group, ticket.peers, ticket.started, exc
                ) from exc
            if done is False:
                raise self._error(
                    ticket.post.stage, ticket.post.group, ticket.peers, ticket.started, None
                )
        ticket.works = []
        if ticket.finish is not None:
            ticket.finish()
            ticket.finish = None

    def collective(self, req: Collective) -> None:
        started = time.monotonic()
        order = req.group.group_ranks
        send, recv = req.send, req.recv
        if (
            order is not None
        ):  # rows in member order <-> rows in torch group-rank order (device, no sync)
            to_group, from_group = self._row_orders(order, send.device)
            if req.kind == "all_to_all":
                send = send.index_select(0, from_group)
            recv = torch.empty_like(recv)
        try:
            if req.kind == "all_gather":
                work = dist.all_gather_into_tensor(
                    recv, send, group=req.group.handle, async_op=True
                )
            else:
                work = dist.all_to_all_single(recv, send, group=req.group.handle, async_op=True)
            done = self._wait_work(work, req.group)
            if done is not False and req.host_read and self.timeout_s and not self.device_waits:
                event = self._device_event(recv)
                if event is not None:
                    wait_event(event, timeout_s=self.timeout_s, what=req.stage, abort=self.abort)
        except ExchangeTimeoutError:  # the bounded device wait ran out (groups aborted)
            raise self._error(
                req.stage, req.group, list(range(len(req.group.ranks))), started, None
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise self._error(
                req.stage, req.group, list(range(len(req.group.ranks))), started, exc
            ) from exc
        if done is False:
            raise self._error(
                req.stage, req.group, list(range(len(req.group.ranks))), started, None
            )
        if order is not None:
            rows = recv.view(len(order), -1).index_select(0, to_group)
            req.recv.copy_(rows.view_as(req.recv))

    def _device_event(self, recv: torch.Tensor) -> Any:
        """CUDA: an event recorded on the current stream after the collective's stream wait
        (what the host read would wait for); None for host tensors."""
        if not recv.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(recv.device))
        return event

    def _row_orders(
        self, order: tuple[int, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(member -> group rank, group rank -> member) index tensors, made once per device."""
        key = (order, device)
        if key not in self._orders:
            with torch.inference_mode(
                False
            ):  # a cache: no inference tensors (see dispatcher._to_railwave)
                to_group = torch.tensor(order, dtype=torch.int64, device=device)
                from_group = torch.empty_like(to_group).index_copy_(
                    0, to_group, torch.arange(len(order), device=device)
                )
            self._orders[key] = (to_group, from_group)
        return self._orders[key]

    def _me(self, group: GroupRef) -> int:
        return group.ranks.index(self.rank)

    def _error(
        self,
        stage: str,
        group: GroupRef,
        peers: list[int],
        started: float,
        exc: BaseException | None,
    ) -> ExchangeError:
        waited = time.monotonic() - started
        timed_out = self.timeout_s is not None and waited >= 0.9 * self.timeout_s
        ep = (lambda r: r) if self.ep_rank_of is None else self.ep_rank_of.__getitem__
        ranks = sorted({ep(group.ranks[p]) for p in peers if group.ranks[p] != self.rank})
        me = group.ranks.index(self.rank)
        others = sorted({p for p in peers if p != me})
        if group.kind == "rail" and others:  # group ranks of a rail group are node indices
            link = f"{group.describe()} between node {me} and " + ", ".join(
                f"node {p}" for p in others
            )
        else:
            link = group.describe()
        unresponsive = (
            sorted(ep(r) for r in self.survey(stage, group)) if self.survey is not None else []
        )
        who = (
            f"unresponsive: EP rank(s) {unresponsive}"
            if unresponsive
            else f"peers of this step: EP rank(s) {ranks}"
        )
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        reported = self.explain() if self.explain is not None else ""
        if reported:
            who = f"{who}; {reported}"
        if timed_out or exc is None:
            return ExchangeTimeoutError(
                f"RailWave exchange, EP rank {ep(self.rank)}: stage '{stage}' on {link} did not "
                f"complete within {self.timeout_s} s; {who}{cause}. If a rail is down, list it in "
                "failed_rails (RailWaveConfig) so that no traffic is planned on it; if a rank is "
                "slow "
                "or stuck, see its own log."
            )
        return ExchangeError(
            f"RailWave exchange, EP rank {ep(self.rank)}: stage '{stage}' on {link} failed after "
            f"{waited:.1f} s; {who}{cause}"
        )


def wait_event(
    event: Any,
    *,
    timeout_s: float | None,
    what: str,
    abort: Callable[[], None] | None = None,
    poll_s: float = 0.0005,
) -> None:
    """Wait for a CUDA ``event`` (anything with ``query()``), at most ``timeout_s``.

    Host sync: yes (the wait). Past ``timeout_s``: ``abort()`` (the groups whose work the event
    follows: NCCL work in flight then ends on this rank and its peers, rather than at the
    watchdog's timeout), then ``ExchangeTimeoutError`` naming ``what``. ``timeout_s`` None:
    waits as long as it takes (the groups' own timeout bounds it).
    """
    if event.query():
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not event.query():
        if deadline is not None and time.monotonic() >= deadline:
            if abort is not None:
                abort()
            raise ExchangeTimeoutError(
                f"{what} did not complete within timeout_s={timeout_s} s: a peer stopped "
                "taking part (see its own error); this rank's process groups were aborted so "
                "that the job ends now rather than at the NCCL watchdog's timeout"
            )
        time.sleep(poll_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _joinable(a: FlatBlocks | None, b: FlatBlocks | None) -> bool:
    """Whether two flat phases can travel as one all-to-all: rows of one dtype and width."""
    return (
        a is not None
        and b is not None
        and a.send.dtype == b.send.dtype == a.recv.dtype == b.recv.dtype
        and a.send.shape[1:] == b.send.shape[1:] == a.recv.shape[1:] == b.recv.shape[1:]
        and len(a.send_rows) == len(b.send_rows)
    )


def _row_nbytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def answer(request: Any, transport: TorchDistTransport) -> Any:
    """Carry out one request of a rank program over ``transport``; returns what the program gets
    back."""
    if isinstance(request, Post):
        return transport.post(request)
    if isinstance(request, Wait):
        return transport.wait(request.ticket)
    if isinstance(request, Collective):
        return transport.collective(request)
    raise TypeError(
        f"rank program yielded {type(request).__name__}"
    )  # pragma: no cover - programming error


def drive(program: Program, transport: TorchDistTransport) -> Any:
    """Run one rank program to completion over ``transport``; returns its result."""
    try:
        request = next(program)
        while True:
            request = program.send(answer(request, transport))
    except StopIteration as stop:
        return stop.value
