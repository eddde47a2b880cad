"""The online selector's timing word in fixed-capacity mode: one small asynchronous all-reduce.

Fixed-capacity mode (``max_tokens_per_rank``) has no count exchange for the word to ride on
(``exchange.layer.gather_demand`` carries it in the normal mode), so each rank's word goes on its
own all-reduce (MAX) over the EP count group of the int64 pair [word, -word]: every rank gets the
largest word (the slowest rank's time) and minus the smallest (a bad code < 0, or 0 for a rank
without a time), which is all ``selector.online.slowest_reduced_timing`` needs. 16 bytes per rank.

The dispatcher posts it at the second call of an epoch of ``online.capacity_sync_every`` calls and
reads it at the next epoch's first call, so the read waits on something posted that many - 1
calls earlier: the mode's one host wait per epoch, off the critical path.

* gloo (CPU): the work progresses on gloo's threads; ``result`` waits for it, up to ``timeout_s``
  (``ExchangeTimeoutError`` naming the group), and reads the two numbers.
* CUDA (NCCL): after posting, a side stream waits for the work (a stream wait), copies the pair
  into pinned host memory (non-blocking) and records an event; ``result`` waits on that event
  (long complete by then) up to ``timeout_s`` (``exchange.status.wait_event``: past it the
  groups are aborted, so the peers' NCCL work ends too, and ``ExchangeTimeoutError`` names the
  reduce; no wait for the NCCL watchdog) and reads the host copy. Not yet run on hardware.

Nothing here depends on the other traffic of the EP group: in fixed-capacity mode the dispatch
and combine phases use the node and rail groups only, and every rank posts its reduces in the same
order (the same layer calls), as a collective requires.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave.exchange.pending import copy_to_host_after
from megatron_railwave.exchange.status import abort_groups, wait_event
from megatron_railwave.exchange.transport import ExchangeError, ExchangeTimeoutError, GroupRef

__all__ = ["PostedTimingReduce", "post_timing_reduce", "TIMING_REDUCE_BYTES"]

TIMING_REDUCE_BYTES = 16
"""Bytes each rank contributes to one reduce: the int64 pair [word, -word]."""


@dataclass(kw_only=True, slots=True)
class PostedTimingReduce:
    """An all-reduce of the timing pair in flight (``post_timing_reduce``); ``result`` once.

    Attributes:
        pair: [2] int64 on the input's device, reduced in place: [max word, -min word].
        work: the collective's ``Work`` (None without torch.distributed: one rank).
        group: the EP count group it runs on (names it on a timeout).
        timeout_s: gloo: the bound of ``result``'s wait (None: the group's own timeout).
        host: CUDA: the pinned host copy the side stream fills; None on CPU.
        event: CUDA: recorded on the side stream after the copy; None on CPU.
        abort: CUDA: what ``result`` calls when the event is late (aborts the process groups;
            None: the EP group's).
    """

    pair: torch.Tensor
    work: Any
    group: GroupRef
    timeout_s: float | None
    host: torch.Tensor | None = None
    event: Any = None
    abort: Callable[[], None] | None = None

    def result(self) -> tuple[int, int]:
        """(largest word, smallest word) over the EP group, the same on every rank.

        Host sync: yes, the mode's one: CUDA waits on the event (the copy, posted an epoch ago),
        gloo on the work; both bounded by ``timeout_s``.

        Raises:
            ExchangeTimeoutError: the reduce did not complete within ``timeout_s`` (CUDA: after
                aborting the process groups).
            ExchangeError: gloo, the wait failed (a peer's connection closed).
        """
        if self.event is not None:
            group = self.group
            wait_event(
                self.event,
                timeout_s=self.timeout_s,
                what=(
                    f"the online selector's timing all-reduce on {group.describe()} (posted one "
                    "epoch of online.capacity_sync_every calls ago)"
                ),
                abort=self.abort or (lambda: abort_groups([group])),
            )
            values = self.host.tolist()
        else:
            if self.work is not None:
                what = (
                    f"the online selector's timing all-reduce on {self.group.describe()} (posted "
                    f"one epoch "
                    "of online.capacity_sync_every calls ago)"
                )
                try:
                    done = (
                        self.work.wait(datetime.timedelta(seconds=self.timeout_s))
                        if self.timeout_s
                        else self.work.wait()
                    )
                except RuntimeError as exc:
                    raise ExchangeError(f"{what} failed: {exc}; see the peers' own errors") from exc
                if done is False:
                    raise ExchangeTimeoutError(
                        f"{what} did not complete within {self.timeout_s} s: a peer "
                        "stopped running this layer; see the peers' own errors"
                    )
            values = self.pair.tolist()
        return int(values[0]), -int(values[1])


def post_timing_reduce(
    word: int,
    group: GroupRef,
    *,
    device: torch.device,
    timeout_s: float | None = None,
    abort: Callable[[], None] | None = None,
) -> PostedTimingReduce:
    """Post the all-reduce (MAX) of this rank's timing word over ``group`` (the EP count group).

    Args:
        word: this rank's ``selector.online.encode_timing`` word (ns > 0, 0 none, < 0 a code).
        group: ``RankGroups.ep``; a group without a handle (no torch.distributed) reduces over
            this rank alone.
        device: the layer input's device (CUDA: NCCL reduces device memory).
        timeout_s: bound of ``result``'s wait (gloo: the work; CUDA: the event).
        abort: CUDA: called when that wait runs out (None: abort ``group``).

    Collective: yes (EP group, asynchronous). Host sync: no.
    """
    pair = torch.tensor([word, -word], dtype=torch.int64)
    if group.handle is None:
        return PostedTimingReduce(pair=pair, work=None, group=group, timeout_s=timeout_s)
    if device.type != "cuda":
        work = dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group.handle, async_op=True)
        return PostedTimingReduce(pair=pair, work=work, group=group, timeout_s=timeout_s)
    pair = pair.pin_memory().to(device, non_blocking=True)
    work = dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group.handle, async_op=True)
    host, event = copy_to_host_after(work, pair, "timing reduce")
    return PostedTimingReduce(
        pair=pair,
        work=work,
        group=group,
        timeout_s=timeout_s,
        host=host,
        event=event,
        abort=abort,
    )
