"""An in-process virtual cluster: every rank's exchange program in one process, on one device.

The rank programs are the ones ``TorchDistExchange`` runs over torch.distributed; here a
driver steps all W of them in lockstep and moves each posted buffer into its receiver's
buffer by a local copy when the receiver waits. Nothing is simulated: the same index maps,
packing, reductions and phase order run, so the virtual cluster shows on one device (CPU
here, CUDA on a GPU machine) that the four paths give bitwise-identical results, and how
many host syncs a layer makes.

A deadlock (no rank can advance) raises ``ExchangeError`` with every rank's pending request:
that is a bug in the schedule or the programs, never a property of the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_railwave.exchange.transport import (
    Collective,
    ExchangeError,
    GroupRef,
    Post,
    Program,
    Wait,
)

__all__ = ["VirtualCluster", "PhaseEvent"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseEvent:
    """One step of one rank, in the order the driver saw it."""

    rank: int
    stage: str
    event: str
    """'post', 'complete' (a Wait returned) or 'collective'."""


@dataclass(kw_only=True, slots=True)
class _Ticket:
    rank: int
    post: Post


def _group_key(group: GroupRef) -> tuple[str, int]:
    return group.kind, group.index


@dataclass(kw_only=True)
class VirtualCluster:
    """Runs one rank program per rank to completion (see module docstring).

    Attributes:
        events: every post / completion / collective, in driver order (for dependency checks).
        bytes_sent / bytes_received: per rank and stage, bytes posted to / received from peers.
    """

    world_size: int
    events: list[PhaseEvent] = field(default_factory=list)
    bytes_sent: list[dict[str, int]] = field(default_factory=list)
    bytes_received: list[dict[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bytes_sent = [{} for _ in range(self.world_size)]
        self.bytes_received = [{} for _ in range(self.world_size)]

    def run(self, programs: Sequence[Program]) -> list[Any]:
        """Step ``programs[r]`` (rank r's program) until all return; their results by rank."""
        if len(programs) != self.world_size:
            raise ValueError(f"expected {self.world_size} rank programs, got {len(programs)}")
        mailbox: dict[tuple, torch.Tensor] = {}
        self._registered: dict[int, tuple] = {}
        self._completed: set[tuple] = set()
        arrivals: dict[tuple, dict[int, Collective]] = {}
        collective_seq = [dict() for _ in programs]  # per rank: group key -> collectives posted
        done = [False] * len(programs)
        results: list[Any] = [None] * len(programs)
        pending: list[Any] = [None] * len(programs)
        for r, prog in enumerate(programs):
            pending[r], done[r], results[r] = self._advance(prog, None, r, first=True)
        while not all(done):
            progress = False
            for r, prog in enumerate(programs):
                while not done[r]:
                    answer, ready = self._try(r, pending[r], mailbox, arrivals, collective_seq)
                    if not ready:
                        break
                    pending[r], done[r], results[r] = self._advance(prog, answer, r)
                    progress = True
            if not progress:
                stuck = {r: _describe(pending[r]) for r in range(len(programs)) if not done[r]}
                raise ExchangeError(
                    f"virtual cluster deadlock: no rank can advance; pending: {stuck}"
                )
        return results

    @staticmethod
    def _advance(
        prog: Program, answer: Any, rank: int, *, first: bool = False
    ) -> tuple[Any, bool, Any]:
        """Resume ``prog`` with ``answer``: (next request, finished, result)."""
        try:
            request = next(prog) if first else prog.send(answer)
        except StopIteration as stop:
            return None, True, stop.value
        except ExchangeError:
            raise
        except (ValueError, RuntimeError) as exc:
            raise type(exc)(f"[virtual rank {rank}] {exc}") from exc
        return request, False, None

    def _try(
        self, rank: int, request: Any, mailbox: dict, arrivals: dict, collective_seq: list
    ) -> tuple[Any, bool]:
        if isinstance(request, Post):
            group = request.group
            me = group.ranks.index(rank)
            for peer, buf in enumerate(request.sends):
                if buf is not None and buf.numel() and peer != me:
                    mailbox[(_group_key(group), request.tag, me, peer)] = buf
                    sent = self.bytes_sent[rank]
                    sent[request.stage] = (
                        sent.get(request.stage, 0) + buf.numel() * buf.element_size()
                    )
            self.events.append(PhaseEvent(rank=rank, stage=request.stage, event="post"))
            return _Ticket(rank=rank, post=request), True
        if isinstance(request, Wait):
            post: Post = request.ticket.post
            group = post.group
            me = group.ranks.index(rank)
            keys = [
                (_group_key(group), post.tag, peer, me)
                for peer, buf in enumerate(post.recvs)
                if buf is not None and buf.numel() and peer != me
            ]
            if not all(k in mailbox for k in keys):
                return None, False
            for key in keys:
                buf = post.recvs[key[2]]
                src = mailbox.pop(key)
                if src.shape != buf.shape or src.dtype != buf.dtype:
                    raise ExchangeError(
                        f"virtual cluster: stage '{post.stage}': rank {group.ranks[key[2]]} sent "
                        f"{tuple(src.shape)} {src.dtype}, rank {rank} expected {tuple(buf.shape)} "
                        f"{buf.dtype}"
                    )
                buf.copy_(src)
                got = self.bytes_received[rank]
                got[post.stage] = got.get(post.stage, 0) + buf.numel() * buf.element_size()
            self.events.append(PhaseEvent(rank=rank, stage=post.stage, event="complete"))
            return None, True
        if isinstance(request, Collective):
            key = self._registered.get(id(request))
            if key is None:
                gkey = _group_key(request.group)
                seq = collective_seq[rank].get(gkey, 0)
                collective_seq[rank][gkey] = seq + 1
                key = (gkey, seq)
                self._registered[id(request)] = key
                arrivals.setdefault(key, {})[rank] = request
            members = arrivals[key]
            if len(members) < len(request.group.ranks):
                return None, False
            if key not in self._completed:
                self._complete_collective([members[r] for r in request.group.ranks])
                self._completed.add(key)
            del self._registered[id(request)]
            self.events.append(PhaseEvent(rank=rank, stage=request.stage, event="collective"))
            return None, True
        raise TypeError(f"rank program yielded {type(request).__name__}")

    @staticmethod
    def _complete_collective(reqs: list[Collective]) -> None:
        if reqs[0].kind == "all_gather":
            gathered = torch.cat([r.send.reshape(-1) for r in reqs])
            for r in reqs:
                r.recv.copy_(gathered.view_as(r.recv))
        else:
            p = len(reqs)
            for dst, r in enumerate(reqs):
                r.recv.copy_(
                    torch.stack([reqs[src].send.view(p, -1)[dst] for src in range(p)]).view_as(
                        r.recv
                    )
                )


def _describe(request: Any) -> str:
    if isinstance(request, Wait):
        return f"wait {request.ticket.post.stage}"
    if isinstance(request, Collective):
        return f"collective {request.stage}"
    if isinstance(request, Post):
        return f"post {request.stage}"
    return repr(request)
