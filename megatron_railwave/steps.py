"""Which training step a dispatcher call belongs to, and what kind of pass it is.

A training step is Megatron's iteration, not a dispatcher call: one iteration runs every MoE layer
once per micro-batch (gradient accumulation, pipeline schedules), a recompute (full or selective
activation checkpointing) runs a layer's forward again inside the backward pass, and RL
frameworks run forward-only passes (log-probs) under ``torch.no_grad`` in eval mode.

* ``current_step()``: the step set with ``set_step`` (hand-written loops), else Megatron-LM's
  ``args.curr_iteration`` (set by its training loop every iteration), else None (the dispatcher
  then counts the layer's training forwards itself).
* ``pass_kind(training)``: ``recompute`` when autograd is running a backward pass (the
  checkpointed forward is replayed there), ``forward_only`` in eval mode, else ``train``.
"""

from __future__ import annotations

import sys
from enum import StrEnum

import torch

__all__ = ["PassKind", "set_step", "current_step", "pass_kind"]


class PassKind(StrEnum):
    TRAIN = "train"
    RECOMPUTE = "recompute"
    FORWARD_ONLY = "forward_only"


_EXPLICIT: list[int | None] = [None]


def set_step(step: int | None) -> None:
    """Declare the current training step (hand-written loops; None: back to Megatron's iteration).

    Must be the same on every rank of an EP group (it drives the plans' rotation).
    """
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"step={step!r} must be an integer >= 0, or None")
    _EXPLICIT[0] = step


def current_step() -> int | None:
    """``set_step``'s value, else Megatron-LM's ``args.curr_iteration``, else None. Host only."""
    if _EXPLICIT[0] is not None:
        return _EXPLICIT[0]
    global_vars = sys.modules.get("megatron.training.global_vars")  # never imported from here
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    iteration = getattr(args, "curr_iteration", None)
    return int(iteration) if isinstance(iteration, int) else None


def pass_kind(training: bool) -> PassKind:
    """The kind of the pass running now (host only, no sync).

    Args:
        training: the MoE layer's ``training`` flag.
    """
    if torch._C._current_graph_task_id() != -1:  # inside autograd's backward: a checkpoint replays
        return PassKind.RECOMPUTE
    return PassKind.TRAIN if training else PassKind.FORWARD_ONLY
