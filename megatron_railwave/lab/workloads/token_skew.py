"""Token skew of captured routing: how unequal the ranks' token counts were, in the generator's
units.

Letters: W ranks, T tokens of one rank, K top-k, S captured steps (dispatcher calls).

The GLM-4.5-Air generator (``workloads.glm``) draws per-rank token counts ``T_w = T * m_w`` with
``log m_w ~ N(-s^2 / 2, s^2)``; ``s`` is its ``token_skew``. The same number measured on a capture
is the spread of ``log T_w`` over the ranks of one dispatcher call: ``s_hat^2`` is the sample
variance (ddof 1) of ``log T_w``, unbiased for ``s^2`` under that law, and several calls pool as
``sqrt(mean s_hat^2)`` (each call has its own mean, as each generator step has its own draw).

A rank's token count is the number of its trace rows with at least one expert id: the capture pads
the shorter ranks of a step with empty (-1) rows (``merge_captures``), and a routed token always
has K ids. Every MoE layer of one call carries the same tokens, so the layers must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megatron_railwave.telemetry.capture import NO_EXPERT, Trace, read_trace

__all__ = [
    "trace_tokens_per_rank",
    "token_skew",
    "token_skew_report",
    "read_capture_steps",
    "capture_token_skew",
]


def trace_tokens_per_rank(trace: Trace) -> np.ndarray:
    """[W] int64 tokens each rank routed in the traced call (rows with any expert id).

    Raises ``ValueError`` when the trace has no layer or its layers disagree (one call of one
    micro-batch passes the same tokens through every MoE layer).
    """
    if not trace.layers:
        raise ValueError("the trace has no layers: nothing was captured for this step")
    counts = [
        (lt.layer, (lt.topk_ids_WTK != NO_EXPERT).any(axis=2).sum(axis=1).astype(np.int64))
        for lt in trace.layers
    ]
    first_layer, first = counts[0]
    for layer, c in counts[1:]:
        if not np.array_equal(c, first):
            raise ValueError(
                f"layers {first_layer} and {layer} of the trace (step {trace.meta.step}) routed "
                f"different "
                f"per-rank token counts ({first.tolist()} vs {c.tolist()}); one capture step must "
                f"be one "
                "micro-batch: capture the first micro-batch only (the dispatcher does) or one "
                "call per step"
            )
    return first


def token_skew(tokens_W: np.ndarray | list[int]) -> float:
    """The generator's ``token_skew`` estimated from one call's per-rank token counts:
    the standard deviation (ddof 1) of ``log T_w`` over the W ranks."""
    t = np.asarray(tokens_W, dtype=np.float64)
    if t.ndim != 1 or t.size < 2:
        raise ValueError(
            f"token_skew needs the token counts of >= 2 ranks, got shape {list(t.shape)}"
        )
    if (t <= 0).any():
        raise ValueError(
            f"token_skew needs every rank to route >= 1 token (log of 0), got counts "
            f"{t.astype(int).tolist()}; "
            "a rank with no tokens at all is outside the lognormal law the generator uses"
        )
    return float(np.std(np.log(t), ddof=1))


def token_skew_report(tokens_SW: np.ndarray | list[list[int]]) -> dict[str, Any]:
    """Per-call and pooled token skew of S calls' [S, W] per-rank token counts.

    Returns ``steps`` (S), ``world`` (W), ``token_skew`` (pooled ``sqrt(mean s_hat^2)``),
    ``token_skew_per_step`` [S], ``max_over_mean`` (per call, the busiest rank's tokens over the
    mean: what the slowest rank waits for), ``cv`` (per call, std / mean of T_w, ddof 0) and
    ``mean_tokens`` (per call).
    """
    t = np.asarray(tokens_SW, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] < 1:
        raise ValueError(
            f"token_skew_report needs [S >= 1, W] token counts, got shape {list(t.shape)}"
        )
    per_step = [token_skew(row) for row in t]
    mean = t.mean(axis=1)
    return {
        "steps": int(t.shape[0]),
        "world": int(t.shape[1]),
        "token_skew": float(np.sqrt(np.mean(np.square(per_step)))),
        "token_skew_per_step": per_step,
        "max_over_mean": (t.max(axis=1) / mean).tolist(),
        "cv": (t.std(axis=1) / mean).tolist(),
        "mean_tokens": mean.tolist(),
    }


def read_capture_steps(capture_dir: str | Path) -> list[Trace]:
    """Every complete captured step of a recorder directory (``step*/rank*.npz``), in step order."""
    capture_dir = Path(capture_dir)
    if not capture_dir.is_dir():
        raise ValueError(f"capture directory {str(capture_dir)!r} does not exist")
    steps = sorted(p for p in capture_dir.glob("step*") if p.is_dir() and any(p.glob("rank*.npz")))
    if not steps:
        raise ValueError(
            f"capture directory {str(capture_dir)!r} holds no step*/rank*.npz parts; was the run "
            f"started "
            "with --railwave-capture-dir (config capture_dir) and the railwave dispatcher?"
        )
    return [read_trace(p) for p in steps]


def capture_token_skew(capture_dir: str | Path) -> dict[str, Any]:
    """The token skew of one capture directory (``railwave workloads token-skew``): its
    ``token_skew_report``, the tokens per rank of every captured step and the step numbers."""
    traces = read_capture_steps(capture_dir)
    tokens = [trace_tokens_per_rank(t).tolist() for t in traces]
    return {
        **token_skew_report(tokens),
        "tokens_per_rank": tokens,
        "capture_steps": [t.meta.step for t in traces],
    }
