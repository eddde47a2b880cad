"""Calibration of the selector anchors and their validation on unseen requests.

Letters: N nodes, G GPUs per node.

A *backend* times one path on one replay request (``MeasureBackend.measure``); everything else
(warm-ups, interleaving, medians, the keep rule, validation) is backend-independent here, so a new
backend is one class with a ``measure`` method. The only backend is ``netmodel`` (the flow model);
a backend that times real exchanges does not exist yet.

Profiling one request: ``warmups`` discarded calls per path, then ``repeats`` rounds; each round
measures every path once, in an order that rotates with the round, so a slow drift of the machine
hits every path alike. Latencies are summarised by median, p10 and p90.

Keep rule of an anchor (paper): the fastest path by median must not be JOINT (JOINT is the
fallback anyway), both it and JOINT must be repeatable (p90 / p10 <= ``max_spread``, 1.2), and it
must beat JOINT conservatively: its slow quantile against JOINT's fast one,
``p90(best) <= (1 - min_gain) * p10(JOINT)`` with ``min_gain`` 5%.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .anchors import Anchor, AnchorSet, CalibrationContext, PathLatency
from .planner import Path, PathPlan, PlanOptions, WaveSchedule, build_plan
from .selector import AnchorSelector
from .stats import demand_stats
from .topology import RailTopology
from .traffic import SelectorScales, TrafficStats

__all__ = [
    "ALL_PATHS",
    "ReplayRequest",
    "MeasureBackend",
    "NetmodelBackend",
    "make_backend",
    "request_plan",
    "request_stats",
    "profile_request",
    "summarize",
    "keep_anchor",
    "CalibrationRow",
    "CalibrationResult",
    "calibrate",
    "ValidationRow",
    "ValidationResult",
    "validate",
    "synthetic_requests",
    "resampled_requests",
    "glm_requests",
    "ARRANGEMENTS",
    "calibration_requests",
    "validation_requests",
]

ALL_PATHS: tuple[Path, ...] = (Path.NATIVE, Path.RAIL, Path.PERM, Path.JOINT)
BACKENDS = ("netmodel",)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayRequest:
    """One layer's demand to replay on every path (a calibration or validation point).

    Attributes:
        name: unique within a run (backends may cache by it).
        records_NGN: [N_src, G, N_dst] int64, CPU, global: records owned by GPU (s, g) for node d.
        record_bytes: payload bytes of one record (hidden size x element size).
        windows: the input's sending windows (replay arrangement) kept by NATIVE / RAIL and used
            for the descriptors; None = all node pairs at once.
        meta: where the request came from (workload, seed, payload scale), for reports.
    """

    name: str
    records_NGN: torch.Tensor
    record_bytes: int
    windows: WaveSchedule | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class MeasureBackend(Protocol):
    """Times execution paths on replay requests."""

    name: str

    def measure(self, request: ReplayRequest, path: Path, repeats: int) -> list[float]:
        """``repeats`` latencies in seconds of ``path`` on ``request`` (slowest rank per sample)."""
        ...


def request_plan(request: ReplayRequest, topo: RailTopology, path: Path,
                 options: PlanOptions | None = None) -> PathPlan:
    """The plan a backend executes for ``request`` on ``path`` (windows kept by NATIVE / RAIL)."""
    base = options or PlanOptions()
    opts = PlanOptions(policy=base.policy, rail_mask_NG=base.rail_mask_NG, fanin=base.fanin,
                       windows=request.windows if request.windows is not None else base.windows)
    return build_plan(request.records_NGN, topo, path, options=opts)


def request_stats(request: ReplayRequest, topo: RailTopology,
                  scales: SelectorScales | None = None) -> TrafficStats:
    """The selector's descriptors of ``request`` (as the dispatcher computes them)."""
    return demand_stats(request.records_NGN, topo, record_bytes=request.record_bytes,
                        scales=scales, windows=request.windows)


class NetmodelBackend:
    """Latencies from the flow-level network model (``netmodel.simulate_plan``, default
    ``NetModelConfig``): deterministic, one simulation per (request, path)."""

    name = "netmodel"

    def __init__(self, topo: RailTopology, options: PlanOptions | None = None) -> None:
        from .netmodel import simulate_plan

        self._simulate: Callable[..., float] = simulate_plan
        self.topo = topo
        self.options = options
        self._cache: dict[tuple[str, int, int, str], float] = {}

    def measure(self, request: ReplayRequest, path: Path, repeats: int) -> list[float]:
        key = (request.name, int(request.records_NGN.sum()), request.record_bytes, str(path))
        if key not in self._cache:
            plan = request_plan(request, self.topo, path, self.options)
            self._cache[key] = float(self._simulate(plan, record_bytes=request.record_bytes))
        return [self._cache[key]] * repeats


def make_backend(name: str, topo: RailTopology, *, options: PlanOptions | None = None) -> MeasureBackend:
    """The backend called ``name`` (``--backend``)."""
    if name == "netmodel":
        return NetmodelBackend(topo, options)
    raise ValueError(f"--backend {name!r} is unknown; choose one of {list(BACKENDS)}")


# ---------------------------------------------------------------------- profiling
def profile_request(backend: MeasureBackend, request: ReplayRequest,
                    paths: Sequence[Path] = ALL_PATHS, *, warmups: int = 5, repeats: int = 10,
                    on_measure: Callable[[], None] | None = None) -> dict[Path, list[float]]:
    """Warm-ups, then ``repeats`` interleaved rounds; returns the samples per path (seconds)."""
    if repeats < 1 or warmups < 0:
        raise ValueError(f"need repeats >= 1 and warmups >= 0, got repeats={repeats}, warmups={warmups}")
    paths = list(paths)
    if warmups:
        for path in paths:
            backend.measure(request, path, warmups)
            if on_measure:
                on_measure()
    samples: dict[Path, list[float]] = {p: [] for p in paths}
    for r in range(repeats):
        for path in paths[r % len(paths):] + paths[:r % len(paths)]:
            got = backend.measure(request, path, 1)
            if len(got) != 1 or not all(math.isfinite(t) and t >= 0 for t in got):
                raise ValueError(f"backend {backend.name!r} returned {got!r} for one sample of "
                                 f"{path} on {request.name!r}; expected one finite time >= 0")
            samples[path].extend(float(t) for t in got)
            if on_measure:
                on_measure()
    return samples


def summarize(samples: Sequence[float]) -> PathLatency:
    """Median, p10 and p90 (linear interpolation) of latency samples."""
    arr = np.asarray(samples, dtype=np.float64)
    p10, med, p90 = np.percentile(arr, [10, 50, 90])
    return PathLatency(median=float(med), p10=float(min(p10, med)), p90=float(max(p90, med)),
                       samples=int(arr.size))


def keep_anchor(latency: dict[Path, PathLatency], *, max_spread: float = 1.2,
                min_gain: float = 0.05) -> tuple[Path, bool, float, str]:
    """Apply the keep rule. Returns (best path by median, kept, conservative gain, reason)."""
    best = min(ALL_PATHS, key=lambda p: (latency[p].median, p != Path.JOINT))
    joint = latency[Path.JOINT]
    gain = 1.0 - latency[best].p90 / joint.p10 if joint.p10 > 0 else 0.0
    if best == Path.JOINT:
        return best, False, 0.0, "JOINT is fastest"
    for p in (best, Path.JOINT):
        if latency[p].spread > max_spread:
            return best, False, gain, f"{p} not repeatable (p90/p10 {latency[p].spread:.3f} > {max_spread})"
    if gain < min_gain:
        return best, False, gain, f"conservative gain {gain:.1%} < {min_gain:.0%}"
    return best, True, gain, "kept"


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="meas", disable=not enabled, leave=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationRow:
    """One calibration request: descriptors, all four latencies and the keep decision."""

    request: str
    stats: TrafficStats
    coords: tuple[float, float, float]
    latency: dict[Path, PathLatency]
    best: Path
    kept: bool
    gain: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "coords": list(self.coords), "B_mean_bytes": self.stats.B_mean_bytes,
                "rho_g": self.stats.rho_g, "kappa": self.stats.kappa, "best": str(self.best),
                "kept": self.kept, "gain": self.gain, "reason": self.reason,
                "latency_s": {str(p): v.to_dict() for p, v in self.latency.items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationResult:
    anchor_set: AnchorSet
    rows: tuple[CalibrationRow, ...]


def calibrate(backend: MeasureBackend, requests: Sequence[ReplayRequest], topo: RailTopology, *,
              hidden_size: int, dtype: str, warmups: int = 5, repeats: int = 10,
              max_spread: float = 1.2, min_gain: float = 0.05, scales: SelectorScales | None = None,
              settings: dict[str, Any] | None = None, progress: bool = True) -> CalibrationResult:
    """Profile every request on the four paths and keep the anchors that pass the rule."""
    if not requests:
        raise ValueError("calibrate needs at least one request")
    resolved = AnchorSet.scales_for(topo, scales)
    ref, rho_s, kappa_s = resolved
    rows, anchors = [], []
    per_request = len(ALL_PATHS) * (repeats + (1 if warmups else 0))
    with _progress(per_request * len(requests), "calibrate", progress) as bar:
        for req in requests:
            st = request_stats(req, topo, SelectorScales(payload_ref_bytes=ref, rho_scale=rho_s,
                                                         kappa_scale=kappa_s))
            samples = profile_request(backend, req, warmups=warmups, repeats=repeats,
                                      on_measure=lambda: bar.update(1))
            latency = {p: summarize(v) for p, v in samples.items()}
            best, kept, gain, reason = keep_anchor(latency, max_spread=max_spread, min_gain=min_gain)
            if kept and not math.isfinite(st.coords[0]):
                kept, reason = False, "no remote payload"
            rows.append(CalibrationRow(request=req.name, stats=st, coords=st.coords, latency=latency,
                                       best=best, kept=kept, gain=gain, reason=reason))
            if kept:
                anchors.append(Anchor(name=req.name, coords=st.coords, B_mean_bytes=st.B_mean_bytes,
                                      rho_g=st.rho_g, kappa=st.kappa, path=best, latency_s=latency))
    context = CalibrationContext(
        topology=topo.to_dict(), hidden_size=hidden_size, dtype=dtype, backend=backend.name,
        date=CalibrationContext.now(),
        settings={"warmups": warmups, "repeats": repeats, "max_spread": max_spread,
                  "min_gain": min_gain, "num_requests": len(requests), **(settings or {})})
    return CalibrationResult(anchor_set=AnchorSet(anchors=tuple(anchors), scales=resolved, context=context),
                             rows=tuple(rows))


# ---------------------------------------------------------------------- validation
@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationRow:
    """One unseen request: the selector's choice against JOINT and the best fixed path."""

    request: str
    coords: tuple[float, float, float]
    selected: Path
    anchor: str | None
    median_s: dict[Path, float]
    best: Path

    @property
    def selected_s(self) -> float:
        return self.median_s[self.selected]

    @property
    def joint_s(self) -> float:
        return self.median_s[Path.JOINT]

    @property
    def best_s(self) -> float:
        return self.median_s[self.best]

    @property
    def ratio_to_best(self) -> float:
        return self.selected_s / self.best_s if self.best_s > 0 else 1.0

    @property
    def gain_vs_joint(self) -> float:
        """1 - selected / JOINT (positive: the selection is faster than JOINT)."""
        return 1.0 - self.selected_s / self.joint_s if self.joint_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "coords": list(self.coords), "selected": str(self.selected),
                "anchor": self.anchor, "selected_s": self.selected_s, "joint_s": self.joint_s,
                "best_path": str(self.best), "best_s": self.best_s, "ratio_to_best": self.ratio_to_best,
                "gain_vs_joint": self.gain_vs_joint,
                "median_s": {str(p): v for p, v in self.median_s.items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationResult:
    rows: tuple[ValidationRow, ...]

    def summary(self, *, tolerance: float = 0.03) -> dict[str, Any]:
        """Switches away from JOINT and their gains, worst selected/best ratio."""
        switches = [r for r in self.rows if r.selected != Path.JOINT]
        worst = max(self.rows, key=lambda r: r.ratio_to_best) if self.rows else None
        totals = {str(p): sum(r.median_s[p] for r in self.rows) for p in ALL_PATHS}
        policy = min(totals, key=totals.get) if self.rows else str(Path.JOINT)
        selected_total = sum(r.selected_s for r in self.rows)
        return {
            "num_requests": len(self.rows),
            "num_switches": len(switches),
            "num_fallback_joint": len(self.rows) - len(switches),
            "switch_gains_vs_joint": [r.gain_vs_joint for r in switches],
            "switch_paths": {str(p): sum(r.selected == p for r in switches) for p in ALL_PATHS[:3]},
            "worst_ratio_to_best": worst.ratio_to_best if worst else 1.0,
            "worst_request": worst.request if worst else None,
            "num_over_tolerance": sum(r.ratio_to_best > 1 + tolerance for r in self.rows),
            "tolerance": tolerance,
            "num_best_not_joint": sum(r.best != Path.JOINT for r in self.rows),
            "total_selected_s": selected_total,
            "total_fixed_s": totals,
            "best_fixed_policy": policy,
            "selected_vs_best_policy": selected_total / totals[policy] if self.rows and totals[policy] > 0 else 1.0,
            "selected_vs_joint_policy": (selected_total / totals[str(Path.JOINT)]
                                         if self.rows and totals[str(Path.JOINT)] > 0 else 1.0),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [r.to_dict() for r in self.rows]}


def validate(backend: MeasureBackend, selector: AnchorSelector, requests: Sequence[ReplayRequest],
             topo: RailTopology, *, warmups: int = 5, repeats: int = 10,
             progress: bool = True) -> ValidationResult:
    """Select a path for every request and time it against all four fixed paths."""
    scales = SelectorScales(payload_ref_bytes=selector.anchor_set.scales[0],
                            rho_scale=selector.anchor_set.scales[1],
                            kappa_scale=selector.anchor_set.scales[2])
    rows = []
    per_request = len(ALL_PATHS) * (repeats + (1 if warmups else 0))
    with _progress(per_request * len(requests), "validate", progress) as bar:
        for req in requests:
            choice = selector.explain(request_stats(req, topo, scales))
            samples = profile_request(backend, req, warmups=warmups, repeats=repeats,
                                      on_measure=lambda: bar.update(1))
            medians = {p: summarize(v).median for p, v in samples.items()}
            best = min(ALL_PATHS, key=lambda p: (medians[p], p != Path.JOINT))
            rows.append(ValidationRow(request=req.name, coords=choice.coords, selected=choice.path,
                                      anchor=choice.anchor, median_s=medians, best=best))
    return ValidationResult(rows=tuple(rows))


# ---------------------------------------------------------------------- requests
def _default_experts(topo: RailTopology) -> int:
    return topo.world_size * max(1, 128 // topo.world_size)


ARRANGEMENTS = ("none", "ring", "moderate", "extreme")
"""Sending arrangements of a request: 'none' = all node pairs at once (what a training step
sends), else the replay's RING / MODERATE / EXTREME windows (``replay.arrange``)."""


def _variants(name: str, demand: Any, topo: RailTopology, *, arrangements: Sequence[str],
              payload_scales: Sequence[float], record_bytes: int, meta: dict[str, Any]) -> list[ReplayRequest]:
    """``demand`` under every arrangement at every payload scale."""
    from .workloads import scaled_demand

    out = []
    for arr in arrangements:
        if arr not in ARRANGEMENTS:
            raise ValueError(f"arrangement {arr!r} is unknown; choose from {list(ARRANGEMENTS)}")
        windows = None
        arranged = demand
        if arr != "none":
            from .workloads import arrange

            arranged, windows = arrange(demand, arr, topo)
        base = arranged.records_NGN()
        for scale in payload_scales:
            out.append(ReplayRequest(name=f"{name}-{arr}-x{scale:g}", records_NGN=scaled_demand(base, scale),
                                     record_bytes=record_bytes, windows=windows,
                                     meta={**meta, "arrangement": arr, "scale": float(scale)}))
    return out


def synthetic_requests(topo: RailTopology, *, families: Sequence[int], payload_scales: Sequence[float],
                       record_bytes: int, tokens: int = 1024, num_experts: int | None = None,
                       topk: int = 8, arrangements: Sequence[str] = ("none",)) -> list[ReplayRequest]:
    """Requests from ``replay.synthetic_routing_maps``: one routing per family seed (its own
    locality and hot-expert ratio, so rho_g varies), under each arrangement at every payload scale
    (counts x scale).
    """
    from .workloads import synthetic_routing_maps
    from .traffic import DemandCounts

    num_experts = num_experts or _default_experts(topo)
    out = []
    for fam in families:
        rng = np.random.default_rng([int(fam), 0xCA11B])
        locality, hot = float(rng.uniform(0.0, 8.0)), float(rng.uniform(2.0, 10.0))
        maps = synthetic_routing_maps(topo, num_tokens=tokens, num_experts=num_experts, topk=topk,
                                      seed=int(fam), hot_ratio=hot, locality=locality)
        out += _variants(f"syn{fam}", DemandCounts.from_routing_maps(maps, topo), topo,
                         arrangements=arrangements, payload_scales=payload_scales, record_bytes=record_bytes,
                         meta={"workload": "synthetic", "family": int(fam), "locality": locality,
                               "hot_ratio": hot, "tokens": tokens})
    return out


def glm_requests(topo: RailTopology, *, layers: Sequence[int] | None, step: int, seed: int,
                 payload_scales: Sequence[float], record_bytes: int, tokens: int = 1024,
                 arrangements: Sequence[str] = ("none",)) -> list[ReplayRequest]:
    """Requests from the synthetic GLM-4.5-Air routing (``replay.glm``): layers at one step."""
    from .workloads import GlmAirWorkload, glm_air_demands

    work = GlmAirWorkload(num_tokens=tokens, seed=seed, step=step,
                          layers=tuple(layers) if layers else None)
    out = []
    for layer, demand in glm_air_demands(topo, work).items():
        out += _variants(f"glm{seed}-s{step}-l{layer}", demand, topo, arrangements=arrangements,
                         payload_scales=payload_scales, record_bytes=record_bytes,
                         meta={"workload": "glm", "layer": layer, "step": step, "seed": seed})
    return out


def resampled_requests(base: Sequence[ReplayRequest], *, count: int, seed: int,
                       scale_range: tuple[float, float] = (0.85, 1.2)) -> list[ReplayRequest]:
    """Unseen variants of ``base``: Poisson-resampled counts at a jittered payload (another step
    of the same layer: same shape on average, different draws)."""
    rng = np.random.default_rng([int(seed), 0x5A3B])
    out = []
    lo, hi = math.log(scale_range[0]), math.log(scale_range[1])
    for i in range(count):
        src = base[int(rng.integers(len(base)))]
        scale = math.exp(rng.uniform(lo, hi))
        lam = src.records_NGN.to(torch.float64).numpy() * scale
        records = torch.from_numpy(rng.poisson(lam).astype(np.int64))
        out.append(ReplayRequest(name=f"{src.name}~r{seed}.{i}", records_NGN=records,
                                 record_bytes=src.record_bytes, windows=src.windows,
                                 meta={**src.meta, "resampled_from": src.name, "jitter": scale}))
    return out


def calibration_requests(topo: RailTopology, settings: dict[str, Any], *, record_bytes: int) -> list[ReplayRequest]:
    """The requests that ``settings`` (``workload``, ``families`` or ``layers``, ``seed``,
    ``payload_scales``, ``tokens``) describe; stored in the anchors file for validation."""
    scales, arrs = settings["payload_scales"], settings.get("arrangements", ("none",))
    if settings.get("workload", "synthetic") == "glm":
        return glm_requests(topo, layers=settings.get("layers"), step=0, seed=settings["seed"],
                            payload_scales=scales, record_bytes=record_bytes, tokens=settings["tokens"],
                            arrangements=arrs)
    return synthetic_requests(topo, families=settings["families"], payload_scales=scales,
                              record_bytes=record_bytes, tokens=settings["tokens"],
                              num_experts=settings.get("num_experts"), topk=settings.get("topk", 8),
                              arrangements=arrs)


def validation_requests(topo: RailTopology, settings: dict[str, Any], *, count: int, seed: int,
                        record_bytes: int) -> list[ReplayRequest]:
    """``count`` requests not used for calibration.

    glm: the calibrated layers at another training step (``seed + 1``; calibration uses step 0).
    synthetic: half are resampled variants of the calibration requests, half come from routing
    families that calibration never saw, so both anchor reuse and the JOINT fallback are tested.
    """
    scales, arrs = settings["payload_scales"], settings.get("arrangements", ("none",))
    if settings.get("workload", "synthetic") == "glm":
        reqs = glm_requests(topo, layers=settings.get("layers"), step=seed + 1, seed=settings["seed"],
                            payload_scales=scales, record_bytes=record_bytes, tokens=settings["tokens"],
                            arrangements=arrs)
        rng = np.random.default_rng(seed)
        pick = sorted(rng.choice(len(reqs), size=min(count, len(reqs)), replace=False).tolist())
        return [reqs[i] for i in pick]
    seen = calibration_requests(topo, settings, record_bytes=record_bytes)
    near = resampled_requests(seen, count=count - count // 2, seed=seed)
    per_family = len(scales) * len(arrs)
    fresh_families = [1_000_003 * (seed + 1) + i for i in range(max(1, -(-(count // 2) // per_family)))]
    fresh = synthetic_requests(topo, families=fresh_families, payload_scales=scales, record_bytes=record_bytes,
                               tokens=settings["tokens"], num_experts=settings.get("num_experts"),
                               topk=settings.get("topk", 8), arrangements=arrs)
    fresh = [fresh[i] for i in np.random.default_rng([seed, 0xF8E5]).permutation(len(fresh))[: count // 2]]
    return near + fresh
