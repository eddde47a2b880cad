"""Incast goodput model for receiver ports, and its calibration.

Shape letters: L links, S samples (calibration points).

A flow-level max-min model lets a receiver port that k senders hit at once deliver its full
capacity C, shared k ways. On real fabrics that is optimistic: with k > 1 synchronized
senders the port's queue builds up, and a lossless RDMA fabric answers with PFC pauses
(pause/resume gaps, head-of-line blocking of the paused upstream queues) and DCQCN rate
cuts after ECN marks; a lossy TCP fabric answers with drops and retransmission timeouts.
The paper measures the effect directly: same demand, only the overlap of node pairs
changed, and dispatch+combine time grows by 67.1% (REFERENCE.md section 1); section 6
notes that a flow-level model shows no gain from waves unless such a penalty is modelled.

Model (stated, one free parameter):

    C_eff(k) = C / (1 + alpha * min(max(0, k - k_free), k_sat))

(``k_sat`` = None: the linear law without saturation, kept for the closed-form fits and
tests; the calibrated configs saturate, see "Saturation" below and docs/netmodel.md.)

where k is the number of distinct senders with an active flow into the port (each flow is
its own sender unless sender ids are given) and k_free is the number of senders the port
absorbs without loss (its buffer covers their bursts). Equivalently, the time to deliver a
byte through the port grows linearly with each extra concurrent sender:
``t(k) = t(1) * (1 + alpha * (k - k_free))``. This is the first-order term of any smooth
per-sender overhead (pause time, marked fraction, retransmitted fraction all grow about
linearly with the number of senders that overrun the buffer at once), it is 1 for
one-to-one traffic (the permutation waves), and it keeps C_eff > 0 for any k. Limits: the
penalty hits only the flows into that port (PFC back-pressure that slows victim flows
elsewhere is not modelled), and it depends on the count of senders, not on their rates.

Saturation. Without it the law gives a port with 255 senders 1 / (1 + 254 alpha) of its
capacity (3% at alpha 0.13): goodput collapse without end. Measured fabrics do not do that.
TCP incast (Chen et al., "Understanding TCP Incast Throughput Collapse", WREN 2009; Vasudevan
et al., SIGCOMM 2009) collapses within the first few senders and then levels off or partly
recovers as k grows further; on lossless RoCE with DCQCN (Zhu et al., SIGCOMM 2015) the
receiver link stays near line rate for 2:1 to 20:1 incast, the cost moving to queueing
delay and PFC spreading. The penalty here therefore stops growing after ``k_sat`` excess
senders. The paper's incast experiment has at most 3 senders per port (EXTREME, [3, 3, 2]),
so it fixes alpha for k <= 3 and says nothing about k_sat beyond 2: k_sat is stated, not
fitted (docs/netmodel.md).

The engine (`maxmin.simulate`) recomputes k, and so C_eff, at every event. ``alpha`` is
fitted to measurements: `alpha_from_slowdowns` from k-to-1 slowdowns (closed form), and
`fit_incast_alpha` from whole-phase times through any predictor (e.g. the engine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_railwave.lab.workloads.fit import golden_section_min

__all__ = ["IncastModel", "alpha_from_slowdowns", "fit_incast_alpha"]


@dataclass(frozen=True, kw_only=True, slots=True)
class IncastModel:
    """Goodput of receiver ports shared by concurrent senders, plus per-phase latency.

    ``IncastModel.off()`` is the pure max-min model (no penalty, no latency).
    """

    alpha: float = 0.0
    """Fractional slowdown per concurrent sender beyond ``k_free``; >= 0 (0 = no incast)."""

    k_free: int = 1
    """Number of concurrent senders a receiver port absorbs without penalty; >= 1."""

    k_sat: int | None = None
    """Saturation: the penalty stops growing after ``k_sat`` senders beyond ``k_free`` (goodput
    levels off at ``C / (1 + alpha * k_sat)``); None = the linear law without saturation."""

    per_phase_latency_s: float = 0.0
    """Fixed latency (seconds) between a phase's dependencies completing and its flows
    starting (launch, notify and synchronisation cost); >= 0. Added to every phase,
    including phases without dependencies (they start at this time, not at 0)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and self.alpha >= 0.0):
            raise ValueError(f"IncastModel.alpha must be a finite number >= 0, got {self.alpha!r}")
        if isinstance(self.k_free, bool) or not isinstance(self.k_free, int) or self.k_free < 1:
            raise ValueError(f"IncastModel.k_free must be an int >= 1, got {self.k_free!r}")
        if self.k_sat is not None and (
            isinstance(self.k_sat, bool) or not isinstance(self.k_sat, int) or self.k_sat < 1
        ):
            raise ValueError(
                f"IncastModel.k_sat must be an int >= 1 or None (no saturation), got {self.k_sat!r}"
            )
        if not (math.isfinite(self.per_phase_latency_s) and self.per_phase_latency_s >= 0.0):
            raise ValueError(
                "IncastModel.per_phase_latency_s must be a finite number >= 0, "
                f"got {self.per_phase_latency_s!r}"
            )

    @classmethod
    def off(cls) -> IncastModel:
        """The pure max-min fair model: alpha = 0 and no per-phase latency."""
        return cls()

    @property
    def penalizes(self) -> bool:
        """True when some sender count reduces a port's capacity (alpha > 0)."""
        return self.alpha > 0.0

    def capacity_factor(self, num_senders: np.ndarray | float) -> np.ndarray:
        """C_eff / C for the given sender counts.

        Args:
            num_senders: [L] or scalar, float or int, number of concurrent senders (>= 0).

        Returns:
            Same shape, float64 in (0, 1]: ``1 / (1 + alpha * min(max(0, k - k_free), k_sat))``.
        """
        excess = np.maximum(np.asarray(num_senders, dtype=np.float64) - self.k_free, 0.0)
        if self.k_sat is not None:
            excess = np.minimum(excess, float(self.k_sat))
        return 1.0 / (1.0 + self.alpha * excess)

    def slowdown(self, num_senders: np.ndarray | float) -> np.ndarray:
        """Time factor of a port hit by k senders: ``1 + alpha * min(max(0, k - k_free),
        k_sat)``."""
        return 1.0 / self.capacity_factor(num_senders)


def alpha_from_slowdowns(
    num_senders_S: Sequence[float] | np.ndarray,
    slowdown_S: Sequence[float] | np.ndarray,
    *,
    k_free: int = 1,
    k_sat: int | None = None,
) -> float:
    """Least-squares alpha from measured k-to-1 slowdowns (closed form).

    The slowdown of a k-to-1 pattern is its measured time divided by the max-min time
    (k * bytes / C); the model says ``slowdown - 1 = alpha * max(0, k - k_free)``, a line
    through the origin, so ``alpha = sum(x * y) / sum(x * x)`` (clipped at 0).

    Args:
        num_senders_S: [S] sender counts k of the samples.
        slowdown_S: [S] measured / max-min time, each > 0.
        k_free, k_sat: as in `IncastModel`.

    Returns:
        alpha >= 0.

    Raises:
        ValueError: shapes differ, a slowdown is not positive, or no sample has k > k_free.
    """
    k = np.asarray(num_senders_S, dtype=np.float64)
    s = np.asarray(slowdown_S, dtype=np.float64)
    if k.shape != s.shape or k.ndim != 1:
        raise ValueError(
            f"num_senders_S and slowdown_S must be 1-D of equal length, got {k.shape} and {s.shape}"
        )
    if not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"slowdown_S must be finite and > 0, got {s.tolist()}")
    x = np.maximum(k - k_free, 0.0)
    if k_sat is not None:
        x = np.minimum(x, float(k_sat))
    if not np.any(x > 0):
        raise ValueError(
            f"need at least one sample with num_senders > k_free={k_free}, got {k.tolist()}"
        )
    return max(float(np.dot(x, s - 1.0) / np.dot(x, x)), 0.0)


def fit_incast_alpha(
    predict: Callable[[IncastModel], np.ndarray],
    measured_s: Sequence[float] | np.ndarray,
    *,
    base: IncastModel | None = None,
    bounds: tuple[float, float] = (0.0, 4.0),
    tol: float = 1e-4,
) -> IncastModel:
    """Fit alpha so that predicted times match measured ones (golden-section search).

    Minimises ``sum(log(predicted / measured) ** 2)`` over alpha in ``bounds``; the log
    error weighs short and long phases alike. Every other field is taken from ``base``.

    Args:
        predict: maps a model to [S] predicted times in seconds (e.g. the per-phase
            finish times of `maxmin.simulate` on the calibration flow sets).
        measured_s: [S] measured times in seconds, each > 0.
        base: model whose other fields are kept; default `IncastModel.off()`.
        bounds: search interval (lo, hi) for alpha, 0 <= lo < hi.
        tol: stop when the interval is shorter than ``tol`` (absolute, in alpha units).

    Returns:
        ``base`` with the fitted alpha.

    Raises:
        ValueError: bad bounds, or measured times not all positive, or a prediction of the
            wrong shape.
    """
    base = IncastModel.off() if base is None else base
    lo, hi = bounds
    if not (0.0 <= lo < hi and math.isfinite(hi)):
        raise ValueError(f"bounds must satisfy 0 <= lo < hi < inf, got {bounds!r}")
    measured = np.asarray(measured_s, dtype=np.float64)
    if measured.ndim != 1 or not np.all(np.isfinite(measured) & (measured > 0)):
        raise ValueError(f"measured_s must be 1-D, finite and > 0, got {measured.tolist()}")

    def loss(alpha: float) -> float:
        predicted = np.asarray(predict(replace(base, alpha=alpha)), dtype=np.float64)
        if predicted.shape != measured.shape:
            raise ValueError(
                f"predict returned shape {predicted.shape}, measured_s has {measured.shape}"
            )
        return float(np.sum(np.log(predicted / measured) ** 2))

    best, _ = golden_section_min(loss, lo, hi, tol=tol, include_ends=True)
    return replace(base, alpha=best)
