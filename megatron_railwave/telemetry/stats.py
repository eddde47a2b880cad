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

from megatron_railwave.planner import PathPlan, WaveSchedule
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import (
    DemandCounts,
    SelectorScales,
    TrafficStats,
    rail_load_NRN,
    traffic_stats,
)

__all__ = ["LayerCommStats", "demand_stats", "layer_comm_stats", "expert_load_stats", "Stopwatch"]


def demand_stats(
    demand: DemandCounts | torch.Tensor,
    topo: RailTopology,
    *,
    record_bytes: int,
    scales: SelectorScales | None = None,
    windows: WaveSchedule | None = None,
) -> TrafficStats:
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
    return traffic_stats(
        records_NGN, rail_load, pair_window_NN, topo, record_bytes=record_bytes, scales=scales
    )


@dataclass(kw_only=True, slots=True)
class LayerCommStats:
    """One MoE layer's communication in one step (one JSONL record)."""

    layer: int
    step: int
    """Megatron's iteration (``steps.current_step``), else this layer's training forwards."""
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
    microbatch: int = 0
    """Index of this forward among the layer's forwards of the same step (gradient accumulation)."""
    pass_kind: str = "train"
    """'train' (a training forward; its recompute is not logged again) or 'forward_only' (eval)."""
    rail_bytes: list[list[int]] = field(default_factory=list)
    """[N][R] dispatch bytes (wire rows: payload, probs, metadata) each node sends on each rail."""
    rail_chunks: int = 1
    """Rail chunks per wave of the executed plan (``PathPlan.chunks``): num_waves x rail_chunks rail
    phases ran."""
    streamed: bool = False
    """The executed plan streamed its relay into the rail phases (``PathPlan.streamed``)."""
    tokens_per_expert_min: int = 0
    tokens_per_expert_max: int = 0
    tokens_per_expert_std: float = 0.0
    overload_factor: float = 0.0
    """Busiest expert's tokens over the mean tokens per expert (1 = perfectly even; 0 = no
    tokens)."""
    dispatch_ms: float = 0.0
    combine_ms: float = 0.0
    selector_mode: str = ""
    """Online selector only: 'probe', 'exploit', 'reprobe', 'fallback', 'replay' or 'idle'
    (``selector.online.OnlineDecision.mode``); '' for the other selectors."""
    selector_neighbourhood: int = -1
    """Online selector: the neighbourhood (of this layer and pass kind) the call fell in."""
    measured_ms: dict[str, float | None] = field(default_factory=dict)
    """Online selector: median measured exchange ms per path in that neighbourhood (slowest rank;
    None: not measured there yet)."""
    last_exchange_ms: float | None = None
    """Online selector: the slowest rank's exchange ms of this layer's previous call (None: none or
    bad)."""
    bad_timings: int = 0
    """Online selector: bad timings (NaN, negative, stalled, missing) this layer has dropped so
    far."""
    timers: dict[str, Stopwatch] = field(default_factory=dict, repr=False)
    """Stopwatches whose times are not read yet ('dispatch', 'combine'); not serialised."""

    def to_dict(self) -> dict[str, Any]:
        """The JSONL record (pending times are resolved first; see ``resolve_times``)."""
        self.resolve_times()
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "timers"}  # type: ignore[attr-defined]
        return {k: _json_value(v) for k, v in out.items()}

    def set_online(self, snapshot: dict[str, Any]) -> None:
        """The online selector's state behind this call (``OnlineSelector.snapshot``)."""
        self.selector_mode = str(snapshot["mode"])
        self.selector_neighbourhood = int(snapshot["neighbourhood"])
        self.measured_ms = dict(snapshot["measured_ms"])
        self.last_exchange_ms = snapshot["last_ms"]
        self.bad_timings = int(snapshot["bad_timings"])

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


def expert_load_stats(tokens_per_expert_E: torch.Tensor | None) -> dict[str, float | int]:
    """min / max / std of tokens per expert and the overload factor (max / mean). Host only.

    Args:
        tokens_per_expert_E: [E] int64 (host), the layer's global tokens per expert; None: zeros.
    """
    if tokens_per_expert_E is None or tokens_per_expert_E.numel() == 0:
        return {}
    load = tokens_per_expert_E.to(torch.float64)
    mean = float(load.mean())
    return {
        "tokens_per_expert_min": int(tokens_per_expert_E.min()),
        "tokens_per_expert_max": int(tokens_per_expert_E.max()),
        "tokens_per_expert_std": float(load.std(unbiased=False)),
        "overload_factor": float(load.max()) / mean if mean > 0 else 0.0,
    }


def layer_comm_stats(
    *,
    layer: int,
    step: int,
    plan: PathPlan,
    demand_descr: TrafficStats,
    record_bytes: int,
    plan_ms: float,
    wire_row_bytes: int | None = None,
    tokens_per_expert_E: torch.Tensor | None = None,
    microbatch: int = 0,
    pass_kind: str = "train",
) -> LayerCommStats:
    """Statistics of one planned phase (times of dispatch/combine are filled in later).

    Args:
        record_bytes: payload bytes of one record (the descriptors' unit).
        wire_row_bytes: bytes of one dispatch row on the wire (``rail_bytes``); default
            ``record_bytes``.
        tokens_per_expert_E: [E] int64 host, global tokens per expert (the expert-load fields).
    """
    executed = plan.stats(record_bytes=record_bytes)
    load = plan.rail_load_NRN().to(torch.float64)
    n = plan.topology.num_nodes
    local = torch.eye(n, dtype=torch.bool).unsqueeze(1)
    egress_NR = load.masked_fill(local, 0).sum(-1)
    totals = egress_NR.sum(-1, keepdim=True).clamp(min=1)
    row_bytes = wire_row_bytes if wire_row_bytes is not None else record_bytes
    return LayerCommStats(
        layer=layer,
        step=step,
        microbatch=microbatch,
        pass_kind=pass_kind,
        rail_bytes=(egress_NR * row_bytes).round().to(torch.int64).tolist(),
        **expert_load_stats(tokens_per_expert_E),
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
        rail_chunks=plan.chunks,
        streamed=plan.streamed,
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
