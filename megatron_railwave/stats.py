"""Per-layer communication statistics (what the dispatcher logs for every MoE layer and step).

Letters: N nodes, R rails, G GPUs per node.

Everything here is computed from the gathered global counts and the plan, so it costs no extra
host sync and is identical on every rank (except the measured times, which are rank-local).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .planner import PathPlan, WaveSchedule
from .topology import RailTopology
from .traffic import DemandCounts, SelectorScales, TrafficStats, rail_load_NRN, traffic_stats

__all__ = ["LayerCommStats", "demand_stats", "layer_comm_stats", "Stopwatch"]


def demand_stats(demand: DemandCounts | torch.Tensor, topo: RailTopology, *, record_bytes: int,
                 scales: SelectorScales | None = None,
                 windows: WaveSchedule | None = None) -> TrafficStats:
    """Descriptors of the demand as sent natively: owner rails, all node pairs at once.

    These drive the selector: B, rho_g and kappa before any reshaping. Pure function of global
    counts, so every rank computes the same descriptors. Host sync: no (CPU counts).

    Args:
        demand: the gathered ``DemandCounts`` or ``records_NGN`` [N_src, G, N_dst] int64.
        windows: the input's sending windows (a replay arrangement); None = all pairs at once,
            which is what a training step sends.
    """
    records_NGN = demand.records_NGN() if isinstance(demand, DemandCounts) else demand
    rail_load = rail_load_NRN(records_NGN, topo)
    n = topo.num_nodes
    if windows is None:
        pair_window_NN = torch.zeros(n, n, dtype=torch.int64)
        pair_window_NN.fill_diagonal_(-1)
    else:
        pair_window_NN = windows.pair_wave_NN()
    return traffic_stats(records_NGN, rail_load, pair_window_NN, topo, record_bytes=record_bytes,
                         scales=scales)


@dataclass(kw_only=True, slots=True)
class LayerCommStats:
    """One MoE layer's communication in one step (one JSONL record)."""

    layer: int
    step: int
    path: str
    B_mean_bytes: float
    B_max_bytes: float
    rho_g: float
    kappa: float
    coords: list[float]
    rho_g_exec: float
    kappa_exec: float
    rail_shares: list[list[float]]
    """[N][R] share of each rail in its node's remote egress under the executed plan."""
    records_total: int
    remote_records: int
    relayed_records: int
    num_waves: int
    peak_fanin: int
    plan_ms: float
    dispatch_ms: float = 0.0
    combine_ms: float = 0.0
    timers: dict[str, Stopwatch] = field(default_factory=dict, repr=False)
    """Stopwatches whose times are not read yet ('dispatch', 'combine'); not serialised."""

    def to_dict(self) -> dict[str, Any]:
        """The JSONL record (pending times are resolved first; see ``resolve_times``)."""
        self.resolve_times()
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "timers"}  # type: ignore[attr-defined]
        return {k: _json_value(v) for k, v in out.items()}

    def set_timers(self, **timers: Stopwatch) -> None:
        """Attach the phase stopwatches; times already readable (CPU) are read at once.

        On CUDA the times stay pending until ``resolve_times``, so the dispatcher never waits
        for an event on the critical path.
        """
        self.timers.update(timers)
        if self.times_ready():
            self.resolve_times()

    def times_ready(self) -> bool:
        """True when every pending time can be read without waiting. Host sync: no."""
        return all(t.ready() for t in self.timers.values())

    def resolve_times(self) -> None:
        """Fill ``dispatch_ms`` / ``combine_ms`` from the stopwatches (waits for CUDA events)."""
        for name, timer in list(self.timers.items()):
            setattr(self, f"{name}_ms", timer.elapsed_ms())
            del self.timers[name]


def layer_comm_stats(*, layer: int, step: int, plan: PathPlan, demand_descr: TrafficStats,
                     record_bytes: int, plan_ms: float) -> LayerCommStats:
    """Statistics of one planned phase (times of dispatch/combine are filled in later)."""
    executed = plan.stats(record_bytes=record_bytes)
    load = plan.rail_load_NRN().to(torch.float64)
    n = plan.topology.num_nodes
    local = torch.eye(n, dtype=torch.bool).unsqueeze(1)
    egress_NR = load.masked_fill(local, 0).sum(-1)
    totals = egress_NR.sum(-1, keepdim=True).clamp(min=1)
    return LayerCommStats(
        layer=layer,
        step=step,
        path=str(plan.path),
        B_mean_bytes=demand_descr.B_mean_bytes,
        B_max_bytes=demand_descr.B_max_bytes,
        rho_g=demand_descr.rho_g,
        kappa=demand_descr.kappa,
        coords=list(demand_descr.coords),
        rho_g_exec=executed.rho_g,
        kappa_exec=executed.kappa,
        rail_shares=(egress_NR / totals).tolist(),
        records_total=demand_descr.records_total,
        remote_records=demand_descr.remote_records,
        relayed_records=plan.relayed_records(),
        num_waves=plan.num_waves,
        peak_fanin=plan.schedule.max_fanin(),
        plan_ms=plan_ms,
    )


def _json_value(value: Any) -> Any:
    """A JSON-ready copy of a field value (lists and dicts copied, tuples as lists; a float that
    is not finite, e.g. the payload coordinate log2(0) of a layer with no remote bytes, as None)."""
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Stopwatch:
    """Wall time of a region: CUDA events on GPU tensors, a monotonic clock on CPU.

    ``elapsed_ms()`` on CUDA synchronises the end event; call it when the value is needed
    (logging), not on the critical path.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
            self._t1 = self._t0

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def ready(self) -> bool:
        """True when ``elapsed_ms`` would not wait (CPU: always). Host sync: no."""
        return not self._cuda or bool(self._end.query())

    def elapsed_ms(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        return (self._t1 - self._t0) * 1e3
