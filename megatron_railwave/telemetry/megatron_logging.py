"""RailWave per-layer metrics in Megatron's TensorBoard / W&B logs, the Megatron way.

Megatron-Core 0.19 records MoE metrics per layer into a ``MoEMetricsTracker`` during forward and
reports them once per step (``tracker.report``: all-reduce over PP, average over DP, write
``<name>`` layer averages and, with ``--moe-per-layer-logging``, ``moe/<name>_layer_<i>``).
RailWave does the same with the tracker class, names ``railwave_<metric>``:

  * ``MegatronMetricsSink`` (a dispatcher stats sink) adds each layer's host-side values
    (computed from the gathered counts, so already on the host) into per-layer sums: no device
    work and no host sync per layer. Dispatch/combine CUDA times wait in a queue until their
    events have completed (non-blocking check).
  * ``report_railwave_metrics`` (called once per step) turns the sums into per-layer means, moves
    them into the tracker's entries (one copy per metric, on the device Megatron's collectives
    need), and lets ``MoEMetricsTracker.report`` sync and write them at ``log_interval``.
  * ``attach_to_megatron_report`` (done by ``install``) hooks Megatron's own per-step MoE report
    (``training_log`` calls ``get_moe_metrics_tracker().report`` every iteration with the writers):
    right after it, ``report_railwave_metrics`` runs with the same writers, iteration,
    ``per_layer_logging`` and layer counts, and its console string is appended to Megatron's.
    A Megatron-LM job therefore needs no change to its training loop.

The tracker is a RailWave-owned instance of Megatron's class, not Megatron's global one: that
one's ``report`` zeroes every entry after writing only the names the training loop asks for, so
sharing it would make either report wipe the other's values. Its sync is skipped when
torch.distributed is not initialised (single process).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from megatron_railwave.names import ROUTES
from megatron_railwave.telemetry.stats import LayerCommStats
from megatron_railwave.traffic import MiB

__all__ = [
    "METRICS",
    "MegatronMetricsSink",
    "get_railwave_metrics_tracker",
    "default_metrics_sink",
    "report_railwave_metrics",
    "attach_to_megatron_report",
    "detach_from_megatron_report",
]

PREFIX = "railwave_"


def _rail_share_max(s: LayerCommStats) -> float:
    return max((max(row) for row in s.rail_shares if row), default=0.0)


METRICS: dict[str, Callable[[LayerCommStats], float | None]] = {
    "B_mean_MiB": lambda s: s.B_mean_bytes / MiB,
    "B_max_MiB": lambda s: s.B_max_bytes / MiB,
    "rho_g": lambda s: s.rho_g,
    "kappa": lambda s: s.kappa,
    "rho_g_exec": lambda s: s.rho_g_exec,
    "kappa_exec": lambda s: s.kappa_exec,
    "rail_share_max": _rail_share_max,
    "relayed_records": lambda s: float(s.relayed_records),
    "num_waves": lambda s: float(s.num_waves),
    "peak_fanin": lambda s: float(s.peak_fanin),
    "plan_ms": lambda s: s.plan_ms,
    "tokens_per_expert_min": lambda s: float(s.tokens_per_expert_min),
    "tokens_per_expert_max": lambda s: float(s.tokens_per_expert_max),
    "tokens_per_expert_std": lambda s: s.tokens_per_expert_std,
    "overload_factor": lambda s: s.overload_factor,
    **{f"path_{r}": (lambda s, r=str(r): float(s.path == r)) for r in ROUTES},
    # The online selector's state (None: another selector; such calls add nothing).
    "selector_probe": lambda s: (
        float(s.selector_mode in ("probe", "reprobe")) if s.selector_mode else None
    ),
    "selector_fallback": lambda s: (
        float(s.selector_mode == "fallback") if s.selector_mode else None
    ),
    **{f"measured_{p}_ms": (lambda s, p=p: s.measured_ms.get(p)) for p in map(str, ROUTES)},
}
"""Metric name (without the ``railwave_`` prefix) -> value of one layer call.

``path_<p>`` averaged over calls and layers is the share of layer calls that ran path p.
``selector_probe`` (share of calls that probed), ``selector_fallback`` and ``measured_<p>_ms`` (the
online selector's median measured time of path p where the call fell) come from the online
selector only: a function returning None adds nothing for that call.
``dispatch_ms`` and ``combine_ms`` are added when their times are readable."""
TIME_METRICS = ("dispatch_ms", "combine_ms")
_NAMES = tuple(METRICS) + TIME_METRICS


def _make_tracker() -> Any:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    class RailWaveMetricsTracker(MoEMetricsTracker):
        """Megatron's tracker; it reduces only where Megatron's groups exist.

        No collectives without torch.distributed, nor without Megatron's parallel state when no
        ``pg_collection`` is given (a loop outside Megatron-LM): the values stay rank-local then
        (the descriptors and paths are global anyway; the times are this rank's).
        """

        def _sync_metrics(self, metric_names, pg_collection=None):  # noqa: ANN001
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                return
            if pg_collection is None and not parallel_state.model_parallel_is_initialized():
                return
            super()._sync_metrics(metric_names, pg_collection)

    return RailWaveMetricsTracker()


_TRACKER: Any = None
_DEFAULT_SINK: MegatronMetricsSink | None = None


def get_railwave_metrics_tracker() -> Any:
    """The process-wide RailWave ``MoEMetricsTracker`` (created on first use)."""
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = _make_tracker()
    return _TRACKER


class MegatronMetricsSink:
    """Dispatcher stats sink that accumulates per-layer sums for ``report_railwave_metrics``.

    Args:
        tracker: the ``MoEMetricsTracker`` to report into (default the RailWave one).
    """

    def __init__(self, tracker: Any = None) -> None:
        self.tracker = tracker
        self._sums: dict[str, dict[int, float]] = {n: {} for n in _NAMES}
        self._counts: dict[str, dict[int, int]] = {n: {} for n in _NAMES}
        self._pending: deque[LayerCommStats] = deque()

    def _add(self, name: str, layer: int, value: float) -> None:
        self._sums[name][layer] = self._sums[name].get(layer, 0.0) + value
        self._counts[name][layer] = self._counts[name].get(layer, 0) + 1

    def _add_times(self, stats: LayerCommStats) -> None:
        stats.resolve_times()
        self._add("dispatch_ms", stats.layer, stats.dispatch_ms)
        self._add("combine_ms", stats.layer, stats.combine_ms)

    def wants(self, step: int) -> bool:
        """Every training step (the report averages over the steps of its interval)."""
        del step
        return True

    def __call__(self, stats: LayerCommStats) -> None:
        if stats.layer < 1:  # Megatron layer numbers are 1-based; 0 = not set (no tracker slot)
            return
        if stats.pass_kind != "train":  # eval passes do not enter the training step's report
            return
        for name, fn in METRICS.items():
            value = fn(stats)
            if value is not None:
                self._add(name, stats.layer, value)
        self._pending.append(stats)
        while self._pending and self._pending[0].times_ready():
            self._add_times(self._pending.popleft())

    def flush(self) -> None:
        """Read every queued time (waits for the CUDA events; call at step end)."""
        while self._pending:
            self._add_times(self._pending.popleft())

    def means(self) -> dict[str, dict[int, float]]:
        """Per metric, per 1-based layer: the mean over the calls since the last ``reset``."""
        return {
            n: {layer: total / self._counts[n][layer] for layer, total in per.items()}
            for n, per in self._sums.items()
        }

    def reset(self) -> None:
        for name in _NAMES:
            self._sums[name].clear()
            self._counts[name].clear()

    def commit(
        self, *, num_layers: int | None = None, device: torch.device | str | None = None
    ) -> int:
        """Move the per-layer means into the tracker entries; returns the entry size used."""
        self.flush()
        tracker = self.tracker if self.tracker is not None else get_railwave_metrics_tracker()
        means = self.means()
        top = max((layer for per in means.values() for layer in per), default=0)
        size = max(num_layers or 0, top)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        for name, per in means.items():
            if not per and num_layers is None:
                continue
            key = PREFIX + name
            tracker.ensure_initialized(key, size, device=device)
            entry = tracker.metrics[key]
            if entry.values.numel() < size:  # entries created before a bigger layer number appeared
                grown = torch.zeros(size, dtype=entry.values.dtype, device=entry.values.device)
                grown[: entry.values.numel()] = entry.values
                entry.values = grown
            host = torch.zeros(entry.values.numel(), dtype=torch.float64)
            for layer, value in per.items():
                host[layer - 1] = value
            entry.values += host.to(device=entry.values.device, dtype=entry.values.dtype)
            entry.needs_dp_avg = True
        self.reset()
        return size


def default_metrics_sink() -> MegatronMetricsSink:
    """The process-wide sink that ``install`` wires by default."""
    global _DEFAULT_SINK
    if _DEFAULT_SINK is None:
        _DEFAULT_SINK = MegatronMetricsSink()
    return _DEFAULT_SINK


def report_railwave_metrics(
    writer: Any,
    wandb_writer: Any,
    iteration: int,
    per_layer_logging: bool,
    *,
    log_interval: int = 1,
    num_layers: int | None = None,
    moe_layer_freq: int | list[int] | None = None,
    mtp_num_layers: int | None = None,
    pg_collection: Any = None,
    sink: MegatronMetricsSink | None = None,
) -> str:
    """Write RailWave's scalars through Megatron's tracker; call once per training step.

    On steps where ``iteration % log_interval != 0`` nothing is written and the sums keep
    accumulating, so a logged value is the mean over every step of the interval. Otherwise the
    per-layer means enter the tracker and ``MoEMetricsTracker.report`` writes
    ``railwave_<metric>`` (average over MoE layers) and, with ``per_layer_logging``
    (``--moe-per-layer-logging``), ``moe/railwave_<metric>_layer_<i>`` (i = layer number - 1,
    Megatron's convention), to ``writer`` (TensorBoard) and ``wandb_writer``.

    Args:
        num_layers, moe_layer_freq, mtp_num_layers: Megatron's args, for the layer average (and
            equal entry sizes on every pipeline stage). Default: the layers this rank recorded
            (exact without pipeline parallelism).
        pg_collection: process groups for the tracker's reductions (default Megatron's globals).
        sink: the sink holding the sums (default ``default_metrics_sink()``).

    Returns:
        Megatron's console string (``" railwave_<metric>: <value> |"`` per metric), '' when not
        logged. Collective: yes on logged steps with torch.distributed initialised (every rank of
        the PP and DP groups must call it). Host sync: yes, once per logged step.
    """
    if iteration % log_interval:
        return ""
    sink = sink or default_metrics_sink()
    tracker = sink.tracker if sink.tracker is not None else get_railwave_metrics_tracker()
    recorded = {layer for per in sink.means().values() for layer in per}
    size = sink.commit(num_layers=(num_layers + (mtp_num_layers or 0)) if num_layers else None)
    names = [PREFIX + n for n in _NAMES if PREFIX + n in tracker.metrics]
    if not names:
        return ""
    if num_layers is None:
        num_layers = size
        moe_layer_freq = (
            [1 if layer + 1 in recorded else 0 for layer in range(size)] if recorded else None
        )
        mtp_num_layers = None
    return tracker.report(
        loss_scale=1.0,
        iteration=iteration,
        writer=writer,
        wandb_writer=wandb_writer,
        per_layer_logging=per_layer_logging,
        track_names=names,
        num_layers=num_layers,
        moe_layer_freq=moe_layer_freq,
        mtp_num_layers=mtp_num_layers,
        pg_collection=pg_collection,
    )


def _megatron_log_interval() -> int:
    try:
        from megatron.training import get_args

        return int(get_args().log_interval)
    except Exception:  # noqa: BLE001 - no Megatron-LM args (Megatron-Core only, tests): every step
        return 1


def attach_to_megatron_report(
    *, log_interval: int | None = None, sink: MegatronMetricsSink | None = None
) -> bool:
    """Run ``report_railwave_metrics`` after every report of Megatron's global MoE tracker.

    Args:
        log_interval: write every this many iterations; default Megatron-LM's ``--log-interval``
            (read at report time), else every iteration.
        sink: the sums to report (default ``default_metrics_sink()``).

    Returns:
        True when the hook was added, False when it was already there. The hook lives on the
        tracker instance: a tracker replaced by ``set_moe_metrics_tracker`` needs a new call.
    """
    import inspect

    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    if getattr(tracker.report, "_railwave_original", None) is not None:
        return False
    original = tracker.report
    signature = inspect.signature(original)

    def report(*args: Any, **kwargs: Any) -> str:
        out = original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        ours = report_railwave_metrics(
            a["writer"],
            a["wandb_writer"],
            a["iteration"],
            a["per_layer_logging"],
            log_interval=log_interval or _megatron_log_interval(),
            num_layers=a["num_layers"],
            moe_layer_freq=a["moe_layer_freq"],
            mtp_num_layers=a["mtp_num_layers"],
            pg_collection=a["pg_collection"],
            sink=sink,
        )
        return out + ours

    report._railwave_original = original  # type: ignore[attr-defined]
    tracker.report = report
    return True


def detach_from_megatron_report() -> None:
    """Undo ``attach_to_megatron_report`` (tests, ``uninstall``)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    original = getattr(tracker.report, "_railwave_original", None)
    if original is not None:
        del tracker.report  # the instance attribute; the class method shows through again
