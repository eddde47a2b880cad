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

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from megatron_railwave.selector.anchors import Anchor, AnchorSet, CalibrationContext, PathLatency
from megatron_railwave.planner import Path, PathPlan, PlanOptions, WaveSchedule, build_plan, parse_path
from megatron_railwave.selector.path_model import FEATURE_NAMES, PathCosts, fit_rail_joint, path_features
from megatron_railwave.selector import AnchorSelector, ModelSelector, Selection, fallback_phases_of, fewer_phases
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import MiB, SelectorScales, TrafficStats, dtype_bytes

__all__ = [
    "ALL_PATHS",
    "PASS_EXCHANGES",
    "ReplayRequest",
    "MeasureBackend",
    "NetmodelBackend",
    "make_backend",
    "request_plan",
    "request_stats",
    "request_windows",
    "request_group",
    "request_seed",
    "SELECTOR_GRID",
    "tune_selector",
    "profile_request",
    "summarize",
    "keep_anchor",
    "CalibrationRow",
    "CalibrationResult",
    "calibrate",
    "MAX_RATIO_TO_BEST",
    "ValidationRow",
    "ValidationResult",
    "count_path_changes",
    "result_from_json",
    "merge_results",
    "validate",
    "synthetic_requests",
    "glm_requests",
    "token_counts",
    "held_out_settings",
    "check_held_out",
    "glm_seeds",
    "ARRANGEMENTS",
    "calibration_requests",
    "validation_requests",
    "PAYLOAD_GATE_MARGIN",
    "PAYLOAD_GATINGS",
    "payload_gate",
    "payload_gates",
    "score_path_model",
    "choose_gating",
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
        demand: the target-mask histograms behind ``records_NGN`` (a ``traffic.DemandCounts`` in
            full form), so a backend moves the exact stage-3 copies (and can run rail chunks);
            None = the model's synthetic delivery fan-out.
    """

    name: str
    records_NGN: torch.Tensor
    record_bytes: int
    windows: WaveSchedule | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    demand: Any = None


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
    opts = dataclasses.replace(base, windows=request.windows if request.windows is not None else base.windows)
    return build_plan(request.records_NGN, topo, path, options=opts)


def request_windows(request: ReplayRequest) -> int:
    """Sending windows of the request's input (1: all node pairs at once)."""
    return request.windows.num_waves if request.windows is not None else 1


def request_group(request: ReplayRequest) -> str:
    """The routing a request replays: workload, seed and layer (glm) or family (synthetic); the
    same for every T, arrangement and scale of it."""
    m = request.meta
    if "layer" in m:
        return f"{m.get('workload', '')}{m.get('seed', '')}-l{m['layer']}"
    if "family" in m:
        return f"{m.get('workload', '')}-f{m['family']}"
    return request.name


def request_seed(request: ReplayRequest) -> str:
    """The generator seed a request comes from: glm's workload seed (one seed sets the token skew
    and payload level of every layer, and a held-out glm request has another seed), synthetic's
    routing family (its own seed), else the request itself."""
    m = request.meta
    if "layer" in m and "seed" in m:
        return f"{m.get('workload', '')}{m['seed']}"
    return request_group(request)


def request_stats(request: ReplayRequest, topo: RailTopology,
                  scales: SelectorScales | None = None) -> TrafficStats:
    """The selector's descriptors of ``request`` (as the dispatcher computes them)."""
    return demand_stats(request.records_NGN, topo, record_bytes=request.record_bytes,
                        scales=scales, windows=request.windows)


def request_features(request: ReplayRequest, topo: RailTopology, costs: PathCosts) -> tuple[float, ...] | None:
    """The path model's features of ``request`` (as the dispatcher computes them from the gathered
    counts, with the calibration's ``costs``), None without its target masks."""
    if request.demand is None:
        return None
    return tuple(float(v) for v in path_features(request.demand, topo, record_bytes=request.record_bytes,
                                                 windows=request.windows, costs=costs))


def path_costs(settings: dict[str, Any], num_ranks: int) -> PathCosts:
    """The fixed costs the path model's estimate charges, from a calibration's settings: the flow
    model's per-call costs (``settings['model']``, a ``NetModelConfig`` dict; its defaults when
    absent) over ``num_ranks`` ranks and the rail chunks (``settings['chunks']``, default 1)."""
    from megatron_railwave.lab.netmodel import NetModelConfig

    raw = settings.get("model")
    model = NetModelConfig.from_dict(raw, source="context.settings.model") if isinstance(raw, dict) else NetModelConfig()
    return PathCosts(rail_phase_s=model.wave_cost_s(num_ranks),
                     layer_s=model.count_exchange_s + model.railbalance_barrier_s + model.railbalance_quota_s,
                     chunks=int(settings.get("chunks", 1)))


class NetmodelBackend:
    """Latencies from the flow-level network model (``netmodel.simulate_plan`` with ``model``, default
    ``NetModelConfig()``): deterministic, one simulation per (request, path)."""

    name = "netmodel"

    def __init__(self, topo: RailTopology, options: PlanOptions | None = None, model: Any = None) -> None:
        from megatron_railwave.lab.netmodel import simulate_plan

        self._simulate: Callable[..., float] = simulate_plan
        self.topo = topo
        self.options = options
        self.model = model
        self._cache: dict[tuple[str, int, int, str], float] = {}

    def measure(self, request: ReplayRequest, path: Path, repeats: int) -> list[float]:
        key = (request.name, int(request.records_NGN.sum()), request.record_bytes, str(path))
        if key not in self._cache:
            plan = request_plan(request, self.topo, path, self.options)
            if plan.chunks != 1 and request.demand is None:
                raise ValueError(f"request {request.name!r}: a plan with {plan.chunks} rail chunks per wave needs the "
                                 "request's target masks (ReplayRequest.demand); build the requests with "
                                 "glm_requests / synthetic_requests, or calibrate with chunks=1")
            self._cache[key] = float(self._simulate(plan, record_bytes=request.record_bytes, model=self.model,
                                                    demand=request.demand))
        return [self._cache[key]] * repeats


def make_backend(name: str, topo: RailTopology, *, options: PlanOptions | None = None,
                 model: Any = None) -> MeasureBackend:
    """The backend called ``name`` (``--backend``); ``model``: the netmodel's ``NetModelConfig``
    (None: its defaults)."""
    if name == "netmodel":
        return NetmodelBackend(topo, options, model)
    raise ValueError(f"--backend {name!r} is unknown; choose one of {list(BACKENDS)}")


def merge_results(results: Sequence[CalibrationResult], sources: Sequence[str]) -> CalibrationResult:
    """One calibration from several runs of the same calibration at different T per GPU (e.g. a
    second run that fills the payload axis between the first's T values).

    Everything but the T values must agree: topology, hidden size, dtype, backend, rail chunks,
    keep-rule settings, model and the request settings (workload, seeds, layers, arrangements,
    payload scales). The merged ``context.settings.requests.tokens`` is the sorted union (so
    ``railwave validate`` holds out requests at every T), rows and anchors keep the runs' order.

    Raises:
        ValueError: the runs differ in another field (named), or share a request.
    """
    if not results:
        raise ValueError("merge_results needs at least one calibration")
    first, ctx = results[0], results[0].anchor_set.context
    skip_settings = {"num_requests", "requests", "selector"}

    def comparable(res: CalibrationResult) -> dict[str, Any]:
        c = res.anchor_set.context
        req = {k: v for k, v in c.settings.get("requests", {}).items() if k != "tokens"}
        return {"context.topology": c.topology, "context.hidden_size": c.hidden_size, "context.dtype": c.dtype,
                "context.backend": c.backend, "scales": list(res.anchor_set.scales),
                **{f"context.settings.{k}": v for k, v in c.settings.items() if k not in skip_settings},
                "context.settings.requests (besides tokens)": req}

    want = comparable(first)
    for res, src in zip(results[1:], sources[1:]):
        got = comparable(res)
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                raise ValueError(f"{src} is another calibration than {sources[0]}: field {key!r} is "
                                 f"{got.get(key)!r} there and {want.get(key)!r} here; only the T values may differ")
    rows = tuple(r for res in results for r in res.rows)
    names = [r.request for r in rows]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:3]
        raise ValueError(f"the calibrations {list(sources)} share requests (e.g. {dup}); merge runs of other T values")
    tokens = sorted({t for res in results for t in token_counts(res.anchor_set.context.settings.get("requests", {}))})
    settings = {**ctx.settings, "num_requests": len(rows),
                "requests": {**ctx.settings.get("requests", {}), "tokens": tokens}}
    context = CalibrationContext(topology=ctx.topology, hidden_size=ctx.hidden_size, dtype=ctx.dtype,
                                 backend=ctx.backend, date=ctx.date, settings=settings)
    anchors = tuple(a for res in results for a in res.anchor_set.anchors)
    return CalibrationResult(anchor_set=AnchorSet(anchors=anchors, scales=first.anchor_set.scales, context=context),
                             rows=rows)


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
    """Apply the keep rule (module docstring). Returns (best path by median, kept, conservative
    gain ``1 - p90(best) / p10(JOINT)``, reason).

    The gain test is the product form ``p90(best) <= (1 - min_gain) * p10(JOINT)``, inclusive:
    a path exactly 5% below JOINT is kept. ``_RULE_RTOL`` absorbs only the rounding of the
    product (1e-12 relative), not a measurable difference.
    """
    best = min(ALL_PATHS, key=lambda p: (latency[p].median, p != Path.JOINT))
    joint = latency[Path.JOINT]
    gain = 1.0 - latency[best].p90 / joint.p10 if joint.p10 > 0 else 0.0
    if best == Path.JOINT:
        return best, False, 0.0, "JOINT is fastest"
    for p in (best, Path.JOINT):
        if latency[p].spread > max_spread:
            return best, False, gain, f"{p} not repeatable (p90/p10 {latency[p].spread:.3f} > {max_spread})"
    if not latency[best].p90 <= (1.0 - min_gain) * joint.p10 * (1.0 + _RULE_RTOL):
        return best, False, gain, f"conservative gain {gain:.2%} < {min_gain:.0%}"
    return best, True, gain, "kept"


_RULE_RTOL = 1e-12


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
    input_windows: int = 1
    group: str = ""
    """The routing the request replays (workload seed and layer or family)."""
    seed: str = ""
    """The generator seed it comes from (``request_seed``): the unit ``tune_selector`` leaves out
    when the calibration spans several."""
    features: tuple[float, ...] | None = None
    """The path model's features of the request (``path_model.path_features``); None without the
    request's target masks (``ReplayRequest.demand``)."""

    def to_dict(self) -> dict[str, Any]:
        out = {"request": self.request, "group": self.group, "seed": self.seed,
               "input_windows": self.input_windows, "coords": list(self.coords), "B_mean_bytes": self.stats.B_mean_bytes,
               "rho_g": self.stats.rho_g, "kappa": self.stats.kappa, "best": str(self.best),
               "kept": self.kept, "gain": self.gain, "reason": self.reason,
               "latency_s": {str(p): v.to_dict() for p, v in self.latency.items()}}
        if self.features is not None:
            out["features"] = list(self.features)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationResult:
    anchor_set: AnchorSet
    rows: tuple[CalibrationRow, ...]


def result_from_json(data: Any, *, source: str = "<json>", topo: RailTopology | None = None) -> CalibrationResult:
    """The ``CalibrationResult`` behind a ``railwave calibrate --json`` file, to re-tune the selector
    without measuring again (``railwave calibrate --retune``).

    The anchors are rebuilt from the rows the keep rule kept (``kept``), so a file whose anchors
    the tuning dropped still yields them; context and scales come from its ``anchors`` block. The
    selector reads only B_mean, rho_g and kappa of a row; B_max and the record counts, which the
    JSON does not hold, are set to B_mean and 0. Row features are kept only when the file's
    ``features`` names this version's (``path_model.FEATURE_NAMES``).

    Args:
        topo: when given, the calibration must have been for this topology.

    Raises:
        ValueError: not such a file (names the field), or another topology.
    """
    from megatron_railwave.selector.anchors import anchors_from_dict

    if not isinstance(data, dict) or not isinstance(data.get("requests"), list) or "anchors" not in data:
        raise ValueError(f"{source}: expected the JSON of `railwave calibrate --json` (fields 'anchors' and "
                         "'requests')")
    # Rows' features are this version's only when the file names the same ones (older files
    # name none): others are dropped, and --retune recomputes them (``with_features``); so is a
    # path model fitted on them (the re-tuning fits its own).
    current = data.get("features") == list(FEATURE_NAMES)
    block = data["anchors"]
    if not current and isinstance(block, dict):
        block = copy.deepcopy(block)
        tuned = ((block.get("context") or {}).get("settings") or {}).get("selector")
        if isinstance(tuned, dict):
            tuned.pop("model", None)
    base = anchors_from_dict(block, source=f"{source}: field 'anchors'", topo=topo)
    rows, anchors = [], []
    for i, row in enumerate(data["requests"]):
        try:
            coords = tuple(-math.inf if c is None else float(c) for c in row["coords"])
            latency = {parse_path(p): PathLatency(**v) for p, v in row["latency_s"].items()}
            st = TrafficStats(B_mean_bytes=float(row["B_mean_bytes"]), B_max_bytes=float(row["B_mean_bytes"]),
                              rho_g=float(row["rho_g"]), kappa=float(row["kappa"]), coords=coords,  # type: ignore[arg-type]
                              records_total=0, remote_records=0)
            out = CalibrationRow(request=str(row["request"]), stats=st, coords=coords, latency=latency,  # type: ignore[arg-type]
                                 best=parse_path(row["best"]), kept=bool(row["kept"]), gain=float(row["gain"]),
                                 reason=str(row["reason"]), input_windows=int(row["input_windows"]),
                                 group=str(row["group"]), seed=str(row["seed"]),
                                 features=None if row.get("features") is None or not current
                                 else tuple(float(v) for v in row["features"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: field 'requests[{i}]' is malformed ({exc!r}); write it with "
                             "`railwave calibrate --json`") from None
        rows.append(out)
        if out.kept:
            anchors.append(Anchor(name=out.request, coords=coords, B_mean_bytes=st.B_mean_bytes,  # type: ignore[arg-type]
                                  rho_g=st.rho_g, kappa=st.kappa, path=out.best, latency_s=latency,
                                  input_windows=out.input_windows))
    return CalibrationResult(anchor_set=AnchorSet(anchors=tuple(anchors), scales=base.scales, context=base.context),
                             rows=tuple(rows))


def with_features(result: CalibrationResult, topo: RailTopology, *, progress: bool = True) -> CalibrationResult:
    """``result`` with the path model's features on every row that lacks them, computed from the
    requests its settings describe (``context.settings.requests``, regenerated: the generators
    are deterministic) with its costs (``path_costs``). For calibrations written before this
    version's features (``--retune``; ``result_from_json`` drops features of other names).

    Raises:
        ValueError: the settings do not regenerate a row's request (names the request).
    """
    missing = {r.request for r in result.rows if r.features is None}
    if not missing:
        return result
    ctx = result.anchor_set.context
    settings = ctx.settings.get("requests")
    if not isinstance(settings, dict):
        raise ValueError("the calibration records no request settings (context.settings.requests): its rows' "
                         "features cannot be computed; re-run `railwave calibrate`")
    record_bytes = ctx.hidden_size * dtype_bytes(ctx.dtype)
    costs = path_costs(ctx.settings, topo.world_size)
    features = {}
    with _progress(len(missing), "features", progress) as bar:
        for req in calibration_requests(topo, settings, record_bytes=record_bytes):
            if req.name in missing:
                features[req.name] = request_features(req, topo, costs)
                bar.update(1)
    lost = sorted(missing - features.keys())
    if lost:
        raise ValueError(f"the calibration's settings do not regenerate request {lost[0]!r} ({len(lost)} in all): "
                         "its features cannot be computed; re-run `railwave calibrate`")
    rows = tuple(dataclasses.replace(r, features=features[r.request]) if r.features is None else r
                 for r in result.rows)
    return CalibrationResult(anchor_set=result.anchor_set, rows=rows)


def calibrate(backend: MeasureBackend, requests: Sequence[ReplayRequest], topo: RailTopology, *,
              hidden_size: int, dtype: str, warmups: int = 5, repeats: int = 10,
              max_spread: float = 1.2, min_gain: float = 0.05, scales: SelectorScales | None = None,
              settings: dict[str, Any] | None = None, progress: bool = True) -> CalibrationResult:
    """Profile every request on the four paths and keep the anchors that pass the rule; every row
    carries the path model's features, computed with the costs ``settings`` name (``path_costs``)."""
    if not requests:
        raise ValueError("calibrate needs at least one request")
    resolved = AnchorSet.scales_for(topo, scales)
    ref, rho_s, kappa_s = resolved
    costs = path_costs(settings or {}, topo.world_size)
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
                                       best=best, kept=kept, gain=gain, reason=reason,
                                       input_windows=request_windows(req), group=request_group(req),
                                       seed=request_seed(req), features=request_features(req, topo, costs)))
            if kept:
                anchors.append(Anchor(name=req.name, coords=st.coords, B_mean_bytes=st.B_mean_bytes,
                                      rho_g=st.rho_g, kappa=st.kappa, path=best, latency_s=latency,
                                      input_windows=request_windows(req)))
    context = CalibrationContext(
        topology=topo.to_dict(), hidden_size=hidden_size, dtype=dtype, backend=backend.name,
        date=CalibrationContext.now(),
        settings={"warmups": warmups, "repeats": repeats, "max_spread": max_spread,
                  "min_gain": min_gain, "num_requests": len(requests), **(settings or {})})
    return CalibrationResult(anchor_set=AnchorSet(anchors=tuple(anchors), scales=resolved, context=context),
                             rows=tuple(rows))


# ---------------------------------------------------------------------- selector thresholds
SELECTOR_GRID: dict[str, tuple[float, ...]] = {"payload_ratio": (1.25, 1.5, 2.0),
                                               "shape_distance": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)}
"""Thresholds ``tune_selector`` tries, smallest first (the paper's 1.25 and 0.02 first). The
shape distances reach 1.0: on the H800 4 x 8 calibration (16 seeds) leaving a seed out still
missed 14 requests at 0.2, the old edge of the grid, and none from 0.3 on (docs/selector.md)."""


def tune_selector(result: CalibrationResult, *, grid: dict[str, Sequence[float]] | None = None,
                  tolerance: float = 0.03, split_fallback: bool = True, fit_model: bool = True) -> dict[str, Any]:
    """Pick the selector thresholds and the anchors that hold, by leaving calibration data out, on
    the calibration requests alone.

    The unit left out is what validation holds out: the generator seed (``CalibrationRow.seed``)
    when the calibration spans two or more (a held-out glm request comes from another workload
    seed, whose payload and skew levels differ for every layer, so leaving out one layer of a
    seed whose other layers stay would make every threshold look safe), else the routing
    (``CalibrationRow.group``: one layer or family).

    **Anchors must hold across units.** For a setting (payload_ratio, shape_distance), an anchor
    *holds* when, on every calibration request of another unit that the runtime rule would let it
    serve (``AnchorSelector.reach_AR``), its path is within ``1 + tolerance`` of that request's
    best path. An anchor that fails somewhere marks a region where the descriptors do not decide
    the path; it is dropped. When a unit is left out, its own requests do not count against an
    anchor (they are what is being predicted).

    For each setting of ``grid``, every calibration request is decided by the runtime rule
    (``AnchorSelector``) over the anchors of the *other* units that hold without its unit, and
    scored as ``railwave validate`` scores a held-out request: how many are more than ``1 +
    tolerance`` slower than their best path, then the total time of the choices. The setting with
    the fewest such requests, then the least total, then the smallest thresholds (the grid's order)
    wins; every setting is also scored without the rule that anchors hold (``hold_rule`` False:
    it can drop anchors that fail on one request of another unit but serve several well), and the
    rule wins ties. "No anchors" (always JOINT) is scored the same way and wins unless some setting is
    strictly better (fewer requests over, or as many and a smaller total); then ``use_anchors``
    is False and ``railwave calibrate`` writes a file without anchors (every row stays in its
    JSON). Held-out requests play no part.

    With ``split_fallback`` the fallback outside the anchors is tuned too: for every setting (and
    for "no anchors") the best payload cut x* (no cut first, then every payload level of the rows)
    below which RAIL runs instead of JOINT where it posts fewer phases
    (``AnchorSelector.fallback_below``; with rail chunks JOINT posts more phases and loses at small
    payloads whatever the shape). The cut is scored with the same leave-out decisions.

    With ``fit_model`` and features on every row (``CalibrationRow.features``) the **path model**
    (``path_model``: log(t_RAIL / t_JOINT) least squares over the features) is scored the same
    way: for each unit, fitted on the other units' rows, it decides the unit's rows (RAIL where
    it predicts RAIL faster, else JOINT), once for every payload gating (``PAYLOAD_GATINGS``: no
    gate, one gate, a gate per input kind; each gate fitted without the unit, ``payload_gates``).
    The gating with the fewest requests over, then the least total, then the fewest decided
    requests (a decision costs host time) is the model's score. When it scores strictly better
    than the chosen anchors setting (or "no anchors"), the model is fitted on every row, with
    that gating's gates from every row, and returned: the runtime then decides with it and not
    with the anchors.

    Returns:
        ``use_anchors``; ``payload_ratio``, ``shape_distance`` (the choice; without anchors the
        best setting with them, for the record); ``held`` (names of the anchors that hold under
        the choice, file order; empty without anchors); ``fallback_below`` (None or
        ``{"payload_bytes", "path"}``); ``left_out`` ('seed' or 'routing');
        ``model`` (``RailJointModel.to_dict()`` when the path model won, else None);
        ``model_score`` (the path model's score under its chosen gating, None when not scored);
        ``method`` (in words); ``scores`` (one dict per setting: thresholds, over_tolerance,
        total_s, vs_joint, anchors_held, fallback_below_bytes; the first, with thresholds None, is
        "no anchors"; the last ones, with ``model`` True, the path model's per gating, with
        ``gate`` and ``decided``, when it was scored).
    """
    grid = {**SELECTOR_GRID, **(grid or {})}
    rows = result.rows
    aset = result.anchor_set
    by_seed = len({r.seed for r in rows}) >= 2
    unit_of_row = {r.request: (r.seed if by_seed else r.group) for r in rows}
    units_R = np.array([unit_of_row[r.request] for r in rows], dtype=object)
    rows_of_unit: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        rows_of_unit.setdefault(unit_of_row[r.request], []).append(i)
    anchor_units = [unit_of_row.get(a.name, a.name) for a in aset.anchors]
    best_R = np.array([min(v.median for v in r.latency.values()) for r in rows])
    limit_R = (1.0 + tolerance) * best_R * (1.0 + _RULE_RTOL)
    lat_PR = {p: np.array([r.latency[p].median for r in rows]) for p in ALL_PATHS}
    slow_PR = {p: lat > limit_R for p, lat in lat_PR.items()}
    coords_R3 = np.array([aset.coords(r.stats) for r in rows]).reshape(len(rows), 3)
    windows_R = np.array([r.input_windows for r in rows])
    joint_total = sum(r.latency[Path.JOINT].median for r in rows)
    # The split fallback: below payload coordinate x*, outside every anchor, RAIL where it posts
    # fewer phases than JOINT (AnchorSelector.fallback_below). Candidates: no split, then every
    # payload level of the rows (0.01 apart), ascending.
    below_ok_R = fewer_phases(windows_R, fallback_phases_of(aset, Path.JOINT))
    x_R = coords_R3[:, 0]
    levels = np.unique(np.round(x_R[np.isfinite(x_R)], 2)) + 0.005 if split_fallback else np.zeros(0)
    cuts = np.concatenate([[-math.inf], levels])
    lat_rail_R, lat_joint_R = lat_PR[Path.RAIL], lat_PR[Path.JOINT]
    slow_rail_R, slow_joint_R = slow_PR[Path.RAIL], slow_PR[Path.JOINT]

    def score(anchored_R: np.ndarray, anchored_lat_R: np.ndarray, anchored_slow_R: np.ndarray) -> tuple[int, float, float]:
        """(over, total, cut) of the best cut for these anchor decisions (first minimal cut wins)."""
        base_over = int(anchored_slow_R[anchored_R].sum())
        base_total = float(anchored_lat_R[anchored_R].sum())
        free = ~anchored_R
        below_CR = (x_R[None, :] < cuts[:, None]) & (below_ok_R & free)[None, :]
        joint_CR = free[None, :] & ~below_CR
        over_C = base_over + (below_CR & slow_rail_R).sum(1) + (joint_CR & slow_joint_R).sum(1)
        total_C = base_total + (below_CR * lat_rail_R).sum(1) + (joint_CR * lat_joint_R).sum(1)
        best = min(range(cuts.size), key=lambda c: (int(over_C[c]), round(float(total_C[c]), 12)))
        return int(over_C[best]), float(total_C[best]), float(cuts[best])

    def entry(ratio: float | None, dist: float | None, result: tuple[int, float, float], held: int) -> dict[str, Any]:
        over, total, cut = result
        return {"payload_ratio": ratio, "shape_distance": dist, "over_tolerance": over, "total_s": total,
                "vs_joint": total / joint_total if joint_total > 0 else 1.0, "anchors_held": held,
                "fallback_below_bytes": aset.scales[0] * 2.0 ** cut if math.isfinite(cut) else None}

    none_R = np.zeros(len(rows), dtype=bool)
    no_anchors = entry(None, None, score(none_R, lat_joint_R, slow_joint_R), 0)
    scores, held_of = [], {}
    for ratio in grid["payload_ratio"]:
        for dist in grid["shape_distance"]:
            reach_AR = AnchorSelector(aset, payload_ratio=ratio, shape_distance=dist).reach_AR(coords_R3, windows_R)
            # The units where each anchor's path is more than the tolerance off the best.
            fails = [set(units_R[reach_AR[i] & slow_PR[a.path] & (units_R != unit)])
                     for i, (a, unit) in enumerate(zip(aset.anchors, anchor_units))]
            for hold in (True, False):  # with the rule that anchors hold, then without it (it may score better)
                if not hold:
                    fails = [set() for _ in fails]
                held_of[(ratio, dist, hold)] = tuple(a.name for a, f in zip(aset.anchors, fails) if not f)
                anchored_R = np.zeros(len(rows), dtype=bool)
                anchored_lat_R, anchored_slow_R = np.zeros(len(rows)), np.zeros(len(rows), dtype=bool)
                for unit, idx in rows_of_unit.items():
                    others = tuple(a for a, u, f in zip(aset.anchors, anchor_units, fails)
                                   if u != unit and f <= {unit})
                    sel = AnchorSelector(AnchorSet(anchors=others, scales=aset.scales, context=aset.context),
                                         payload_ratio=ratio, shape_distance=dist)
                    for i in idx:
                        r = rows[i]
                        choice = sel.explain(r.stats, input_windows=r.input_windows)
                        if choice.anchor is not None:
                            anchored_R[i] = True
                            anchored_lat_R[i] = r.latency[choice.path].median
                            anchored_slow_R[i] = anchored_lat_R[i] > limit_R[i]
                scores.append({**entry(ratio, dist, score(anchored_R, anchored_lat_R, anchored_slow_R),
                                       len(held_of[(ratio, dist, hold)])), "hold_rule": hold})

    def rank(sc: dict[str, Any]) -> tuple[int, float]:
        return sc["over_tolerance"], round(sc["total_s"], 12)

    best_score = min(scores, key=rank)
    choice = (best_score["payload_ratio"], best_score["shape_distance"], best_score["hold_rule"])
    use_anchors = bool(held_of[choice]) and rank(best_score) < rank(no_anchors)
    chosen = best_score if use_anchors else no_anchors
    left_out = "seed" if by_seed else "routing"
    method = (f"leave-one-{left_out}-out on the calibration requests, "
              + (f"anchors that hold across {left_out}s" if choice[2] else "every anchor (the hold rule scored worse)"))
    if not use_anchors and aset.anchors:
        method += "; no setting beats always-JOINT, so no anchors are kept"
    # The path model, scored with the same leave-out: fitted without the unit, deciding its rows.
    model, model_scores, model_score = None, [], None
    if fit_model and rows and all(r.features is not None for r in rows):
        topo_dict = aset.context.topology
        costs = path_costs(aset.context.settings, int(topo_dict["num_nodes"]) * int(topo_dict["gpus_per_node"]))
        features_RF = np.array([r.features for r in rows], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            target_R = np.log(lat_rail_R / lat_joint_R)
        fits_R = np.isfinite(target_R)  # a request without time on either path teaches nothing
        payload_R = np.array([r.stats.B_mean_bytes for r in rows], dtype=np.float64)
        for gating in PAYLOAD_GATINGS:
            sc = score_path_model(features_RF, windows_R, target_R, payload_R, units_R, lat_rail_R, lat_joint_R,
                                  limit_R, costs=costs, gating=gating)
            model_scores.append({**entry(None, None, (sc["over_tolerance"], sc["total_s"], -math.inf), 0),
                                 "model": True, "gate": gating, "decided": sc["decided"]})
        by_gating = {sc["gate"]: sc for sc in model_scores}
        model_score = by_gating[choose_gating(by_gating)]
        if rank(model_score) < rank(chosen):
            model = fit_rail_joint(features_RF[fits_R], windows_R[fits_R], target_R[fits_R], costs=costs)
        if model is not None:
            gating = model_score["gate"]
            gate_all, gate_windowed = payload_gates(payload_R, slow_joint_R, windows_R == 1, gating=gating)
            model = dataclasses.replace(model, max_payload_bytes=gate_all, max_payload_bytes_windowed=gate_windowed)
            over = model_score["over_tolerance"]
            method += (f"; the RAIL / JOINT path model (leave-one-{left_out}-out: {over} requests over) scored "
                       "better than the anchors and decides "
                       + ("every layer (no payload gate: none scored better)" if gating == "none" else
                          f"layers up to {gate_all / MiB:.2f} MiB per GPU, JOINT above" if gating == "one" else
                          f"layers up to {gate_all / MiB:.2f} MiB per GPU sent all pairs at once and "
                          f"{gate_windowed / MiB:.2f} MiB in windows (gates per input kind), JOINT above"))
    below = chosen["fallback_below_bytes"]
    return {"use_anchors": use_anchors, "payload_ratio": choice[0], "shape_distance": choice[1], "hold_rule": choice[2],
            "held": list(held_of[choice]) if use_anchors else [],
            "fallback_below": {"payload_bytes": below, "path": str(Path.RAIL)} if below is not None else None,
            "model": model.to_dict() if model is not None else None,
            "method": method, "left_out": left_out, "tolerance": tolerance,
            "scores": [no_anchors, *scores, *model_scores],
            "model_score": model_score}


PAYLOAD_GATE_MARGIN = 1.5
"""``payload_gate``'s margin over the largest payload where JOINT missed the tolerance: one
layer's payload at one T varies by ~10% between generator seeds (8.3-9.1 MiB per GPU at T = 384
on the 4 x 8 GLM workload), and the calibrated T grid steps by 1.33-2x."""


def payload_gate(payload_R: np.ndarray, joint_slow_R: np.ndarray, *, margin: float = PAYLOAD_GATE_MARGIN) -> float:
    """The path model's payload gate (``RailJointModel.max_payload_bytes``): ``margin`` x the
    largest mean remote payload per GPU among the requests on which JOINT is more than the
    tolerance slower than the best fixed path (``joint_slow_R``); 0 when JOINT is within it on
    every request (the model then decides no layer).

    Why: the decision is host time on every layer call (~0.05-0.08 ms at 4 x 8), and above that
    payload the calibration gave selecting nothing to win that the goal needs: JOINT was within
    the tolerance everywhere, and the best path's saving is a small share of a long layer.

    Args:
        payload_R: [R] B_mean bytes of the requests (``TrafficStats.B_mean_bytes``).
        joint_slow_R: [R] bool, JOINT over the tolerance of the request's best path.
    """
    slow = np.asarray(payload_R, dtype=np.float64)[np.asarray(joint_slow_R, dtype=bool)]
    return float(margin * slow.max()) if slow.size else 0.0


PAYLOAD_GATINGS = ("none", "one", "per_kind")
"""The payload gates ``tune_selector`` scores for the path model, in its tie order: no gate, one
gate for both input kinds, a gate per input kind (all node pairs at once / several windows)."""


def payload_gates(payload_R: np.ndarray, joint_slow_R: np.ndarray, all_pairs_R: np.ndarray, *,
                  gating: str) -> tuple[float | None, float | None]:
    """(all pairs at once, several windows) payload gates of ``gating`` (``PAYLOAD_GATINGS``), each
    ``payload_gate`` over the requests it covers; None: no gate.

    Args:
        payload_R, joint_slow_R: as ``payload_gate``.
        all_pairs_R: [R] bool, the request's input is sent all node pairs at once.
    """
    if gating == "none":
        return None, None
    if gating == "one":
        gate = payload_gate(payload_R, joint_slow_R)
        return gate, gate
    if gating == "per_kind":
        all_pairs_R = np.asarray(all_pairs_R, dtype=bool)
        payload_R, joint_slow_R = np.asarray(payload_R), np.asarray(joint_slow_R, dtype=bool)
        return (payload_gate(payload_R[all_pairs_R], joint_slow_R[all_pairs_R]),
                payload_gate(payload_R[~all_pairs_R], joint_slow_R[~all_pairs_R]))
    raise ValueError(f"gating must be one of {PAYLOAD_GATINGS}, got {gating!r}")


def choose_gating(scores: dict[str, dict[str, Any]]) -> str:
    """The payload gating ``tune_selector`` keeps from ``score_path_model``'s scores per gating: the
    fewest requests over the tolerance, then the least total time, then the fewest decided
    requests (a decision is host time), then ``PAYLOAD_GATINGS``' order."""
    order = [g for g in PAYLOAD_GATINGS if g in scores]
    return min(order, key=lambda g: (scores[g]["over_tolerance"], round(scores[g]["total_s"], 12),
                                     scores[g]["decided"]))


def score_path_model(features_RF: np.ndarray, windows_R: np.ndarray, log_ratio_R: np.ndarray, payload_R: np.ndarray,
                     units_R: np.ndarray, rail_s_R: np.ndarray, joint_s_R: np.ndarray, limit_s_R: np.ndarray, *,
                     costs: PathCosts, gating: str) -> dict[str, Any]:
    """The path model's leave-one-unit-out score under a payload gating (``tune_selector``): for
    each unit, the model fitted on the other units' rows (``fit_rail_joint``, rows with a finite
    target) and their gates (``payload_gates``) decide the unit's rows, RAIL where it predicts
    RAIL faster, else JOINT.

    Args:
        features_RF: [R, F] the rows' features; windows_R: [R] their input windows.
        log_ratio_R: [R] log(t_RAIL / t_JOINT) (not finite: the row does not teach the fit).
        payload_R: [R] B_mean bytes; units_R: [R] the unit each row belongs to (a seed).
        rail_s_R, joint_s_R: [R] seconds on RAIL and JOINT; limit_s_R: [R] the tolerance's limit
            (``1 + tolerance`` x the row's best path).
        costs: what the features were computed with.

    Returns:
        ``over_tolerance`` (rows whose decided path is over its limit, JOINT where JOINT runs),
        ``total_s`` (the decided paths' seconds), ``decided`` (rows the model decided).
    """
    features_RF, windows_R = np.asarray(features_RF, dtype=np.float64), np.asarray(windows_R)
    log_ratio_R, payload_R = np.asarray(log_ratio_R, dtype=np.float64), np.asarray(payload_R, dtype=np.float64)
    units_R = np.asarray(units_R, dtype=object)
    fits_R, all_pairs_R = np.isfinite(log_ratio_R), windows_R == 1
    joint_slow_R = np.asarray(joint_s_R) > np.asarray(limit_s_R)
    rail_R = np.zeros(len(units_R), dtype=bool)
    decided_R = np.zeros(len(units_R), dtype=bool)
    for unit in dict.fromkeys(units_R.tolist()):
        train, idx = (units_R != unit), np.flatnonzero(units_R == unit)
        fitted = fit_rail_joint(features_RF[train & fits_R], windows_R[train & fits_R], log_ratio_R[train & fits_R],
                                costs=costs)
        if fitted is None:
            continue  # no model for this unit: its rows run JOINT
        gate_all, gate_windowed = payload_gates(payload_R[train], joint_slow_R[train], all_pairs_R[train],
                                                gating=gating)
        fitted = dataclasses.replace(fitted, max_payload_bytes=gate_all, max_payload_bytes_windowed=gate_windowed)
        for i in idx:  # the runtime's rule (ModelSelector): the gate, then the prediction
            windows = int(windows_R[i])
            decided_R[i] = fitted.decides(payload_R[i], input_windows=windows)
            predicted = fitted.log_ratio(features_RF[i], input_windows=windows) if decided_R[i] else None
            rail_R[i] = predicted is not None and predicted < 0
    chosen_s_R = np.where(rail_R, rail_s_R, joint_s_R)
    return {"over_tolerance": int((chosen_s_R > np.asarray(limit_s_R)).sum()), "total_s": float(chosen_s_R.sum()),
            "decided": int(decided_R.sum())}


# ---------------------------------------------------------------------- validation
MAX_RATIO_TO_BEST = 1.03
"""Goal: the selected path is never more than 3% slower than the best fixed path of a request."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationRow:
    """One held-out request: the selector's choice against JOINT and the best fixed path.

    ``sequence`` names the run of consecutive layers the request belongs to (same workload seed,
    T, arrangement and scale) and ``position`` its layer there; path changes are counted along it.
    ``windows``: the sending windows of the request's input (1: all node pairs at once, the input
    the dispatcher sends; more: a replay arrangement, ``request_windows``).
    """

    request: str
    coords: tuple[float, float, float]
    selected: Path
    anchor: str | None
    median_s: dict[Path, float]
    best: Path
    sequence: str = ""
    position: int = 0
    windows: int = 1

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
        return {"request": self.request, "sequence": self.sequence, "position": self.position,
                "windows": self.windows, "coords": list(self.coords), "selected": str(self.selected),
                "anchor": self.anchor, "selected_s": self.selected_s, "joint_s": self.joint_s,
                "best_path": str(self.best), "best_s": self.best_s, "ratio_to_best": self.ratio_to_best,
                "within_goal": self.ratio_to_best <= MAX_RATIO_TO_BEST * (1.0 + _RULE_RTOL),
                "gain_vs_joint": self.gain_vs_joint,
                "median_s": {str(p): v for p, v in self.median_s.items()}}


def count_path_changes(rows: Sequence[ValidationRow]) -> dict[str, int]:
    """Per sequence, how often the selected path changes between consecutive layers (rows are
    ordered by position within each sequence here, whatever order they come in)."""
    by_seq: dict[str, list[ValidationRow]] = {}
    for r in rows:
        by_seq.setdefault(r.sequence, []).append(r)
    out = {}
    for seq, seq_rows in by_seq.items():
        paths = [r.selected for r in sorted(seq_rows, key=lambda r: r.position)]
        out[seq] = sum(a != b for a, b in zip(paths, paths[1:]))
    return out


PASS_EXCHANGES: dict[str, int] = {"forward only": 1, "training": 2, "training with recompute": 3}
"""Layer exchanges (dispatch + combine) that run on one decision's path, per kind of layer call
(``ValidationResult.with_decision_cost``): a forward alone (inference, RL rollouts); training (the
backward runs the forward's schedule mirrored); training with activation recompute (the recompute
replays the first forward's path without deciding again)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationResult:
    rows: tuple[ValidationRow, ...]

    def summary(self, *, tolerance: float = MAX_RATIO_TO_BEST - 1.0) -> dict[str, Any]:
        """The two goals (every request within ``1 + tolerance`` of its best fixed path; the
        total below always-JOINT's), path changes between consecutive layers, totals."""
        non_joint = [r for r in self.rows if r.selected != Path.JOINT]
        worst = max(self.rows, key=lambda r: r.ratio_to_best) if self.rows else None
        totals = {str(p): sum(r.median_s[p] for r in self.rows) for p in ALL_PATHS}
        policy = min(totals, key=totals.get) if self.rows else str(Path.JOINT)
        selected_total = sum(r.selected_s for r in self.rows)
        oracle_total = sum(r.best_s for r in self.rows)
        over = [r for r in self.rows if r.ratio_to_best > (1.0 + tolerance) * (1.0 + _RULE_RTOL)]
        changes = count_path_changes(self.rows)
        joint_total = totals[str(Path.JOINT)]
        goal_best = bool(self.rows) and not over
        goal_joint = bool(self.rows) and selected_total < joint_total
        return {
            "num_requests": len(self.rows),
            "num_sequences": len(changes),
            "num_path_changes": sum(changes.values()),
            "path_changes_per_sequence": changes,
            "num_not_joint": len(non_joint),
            "num_fallback_joint": len(self.rows) - len(non_joint),
            "selected_paths": {str(p): sum(r.selected == p for r in self.rows) for p in ALL_PATHS},
            "best_paths": {str(p): sum(r.best == p for r in self.rows) for p in ALL_PATHS},
            "not_joint_gains_vs_joint": [r.gain_vs_joint for r in non_joint],
            "worst_ratio_to_best": worst.ratio_to_best if worst else 1.0,
            "worst_request": worst.request if worst else None,
            "num_over_tolerance": len(over),
            "over_tolerance_requests": [r.request for r in over],
            "tolerance": tolerance,
            "num_best_not_joint": sum(r.best != Path.JOINT for r in self.rows),
            "total_selected_s": selected_total,
            "total_best_per_request_s": oracle_total,
            "total_fixed_s": totals,
            "best_fixed_policy": policy,
            "selected_vs_best_policy": selected_total / totals[policy] if self.rows and totals[policy] > 0 else 1.0,
            "selected_vs_joint_policy": selected_total / joint_total if self.rows and joint_total > 0 else 1.0,
            "goals": {
                "within_tolerance_of_best_on_every_request": goal_best,
                "total_beats_always_joint": goal_joint,
                "all_met": goal_best and goal_joint,
            },
        }

    def with_decision_cost(self, decision_s: float, *, exchanges_per_decision: int = 1) -> dict[str, Any]:
        """The selection against always-JOINT once each layer's decision is paid for: JOINT needs
        none (its plan is built on every path), the selector ``decision_s`` host seconds per layer
        call (measured by the caller, ``railwave validate``: on the critical path, between the count
        exchange and the plan). The gain per layer of the best path per request against JOINT is
        the most any selector can save, so a decision costing more cannot pay for itself.

        Args:
            decision_s: host seconds of one decision.
            exchanges_per_decision: the layer's exchanges (a dispatch and a combine each) that run
                on one decision's path (``PASS_EXCHANGES``): 1 for a forward-only call, 2 in
                training, where the backward's combine-backward and dispatch-backward run the
                forward's schedule mirrored (``exchange.layer``: the same handle, rows of the same
                payload), 3 with activation recompute, which replays the first forward's path
                (``dispatcher``: the count exchange and the plan again, without the delivery
                counts, but no decision). Each further exchange is charged the request's modelled
                time again: the flow model times the mirrored backward as the forward (the same
                transfers and payload bytes; the backward repeats no count exchange, the same on
                every path, so no difference between paths changes).

        Returns:
            the totals with the decisions paid; ``selected_gain_s_per_layer`` and
            ``best_gain_s_per_layer`` are per decision (a layer call and the exchanges on its path).

        Raises:
            ValueError: ``decision_s`` negative or not finite; ``exchanges_per_decision`` < 1.
        """
        if not (math.isfinite(decision_s) and decision_s >= 0):
            raise ValueError(f"decision_s must be a finite number of seconds >= 0, got {decision_s!r}")
        uses = exchanges_per_decision
        if isinstance(uses, bool) or not isinstance(uses, int) or uses < 1:
            raise ValueError(f"exchanges_per_decision must be an integer >= 1, got {uses!r}")
        totals = self.summary()
        n = totals["num_requests"]
        joint, selected = uses * totals["total_fixed_s"][str(Path.JOINT)], uses * totals["total_selected_s"]
        best = uses * totals["total_best_per_request_s"]
        with_decisions = selected + n * decision_s
        return {
            "decision_s_per_layer": decision_s,
            "exchanges_per_decision": uses,
            "num_requests": n,
            "selected_gain_s_per_layer": (joint - selected) / n if n else 0.0,
            "best_gain_s_per_layer": (joint - best) / n if n else 0.0,
            "total_selected_with_decisions_s": with_decisions,
            "selected_with_decisions_vs_joint_policy": with_decisions / joint if n and joint > 0 else 1.0,
            "total_with_decisions_beats_always_joint": bool(n) and with_decisions < joint,
            "a_decision_could_pay": bool(n) and decision_s < (joint - best) / n,
        }

    def all_pairs(self) -> ValidationResult:
        """The requests whose input is sent all node pairs at once (``ValidationRow.windows`` 1):
        what the dispatcher sends on every layer call; the others are replay arrangements."""
        return ValidationResult(rows=tuple(r for r in self.rows if r.windows == 1))

    def decision_cost_by_pass(self, decision_s: float) -> dict[str, dict[str, Any]]:
        """``with_decision_cost`` on the all-pairs requests (``all_pairs``: the dispatcher's input)
        for each kind of layer call in ``PASS_EXCHANGES``."""
        dispatched = self.all_pairs()
        return {name: dispatched.with_decision_cost(decision_s, exchanges_per_decision=uses)
                for name, uses in PASS_EXCHANGES.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [r.to_dict() for r in self.rows]}


def validate(backend: MeasureBackend, selector: AnchorSelector | ModelSelector, requests: Sequence[ReplayRequest],
             topo: RailTopology, *, scales: tuple[float, float, float] | None = None, warmups: int = 5,
             repeats: int = 10, progress: bool = True) -> ValidationResult:
    """Select a path for every request and time it against all four fixed paths.

    Args:
        scales: the coordinate scales reported per request (default: the anchor selector's file's,
            else the package defaults for ``topo``).
    """
    if scales is None:
        scales = (selector.anchor_set.scales if isinstance(selector, AnchorSelector)
                  else AnchorSet.scales_for(topo, None))
    rows = []
    per_request = len(ALL_PATHS) * (repeats + (1 if warmups else 0))
    with _progress(per_request * len(requests), "validate", progress) as bar:
        for req in requests:
            choice = _decide(selector, req, topo, scales)
            samples = profile_request(backend, req, warmups=warmups, repeats=repeats,
                                      on_measure=lambda: bar.update(1))
            medians = {p: summarize(v).median for p, v in samples.items()}
            best = min(ALL_PATHS, key=lambda p: (medians[p], p != Path.JOINT))
            rows.append(ValidationRow(request=req.name, coords=choice.coords, selected=choice.path,
                                      anchor=choice.anchor, median_s=medians, best=best,
                                      sequence=str(req.meta.get("sequence", "")),
                                      position=int(req.meta.get("position", 0)), windows=request_windows(req)))
    return ValidationResult(rows=tuple(rows))


def rescore(result: ValidationResult, selector: AnchorSelector | ModelSelector, requests: Sequence[ReplayRequest],
            topo: RailTopology, *, scales: tuple[float, float, float]) -> ValidationResult:
    """``result``'s requests decided by another selector, over the same measured medians (nothing
    is measured again): two rules compared side by side in one run."""
    by_name = {r.request: r for r in result.rows}
    rows = []
    for req in requests:
        row = by_name[req.name]
        choice = _decide(selector, req, topo, scales)
        rows.append(dataclasses.replace(row, coords=choice.coords, selected=choice.path, anchor=choice.anchor))
    return ValidationResult(rows=tuple(rows))


def _decide(selector: AnchorSelector | ModelSelector, req: ReplayRequest, topo: RailTopology,
            scales: tuple[float, float, float]) -> Selection:
    st = request_stats(req, topo, SelectorScales(payload_ref_bytes=scales[0], rho_scale=scales[1],
                                                 kappa_scale=scales[2]))
    if isinstance(selector, ModelSelector):
        if req.demand is None:
            raise ValueError(f"request {req.name!r}: the path model needs the request's target masks "
                             "(ReplayRequest.demand); build the requests with glm_requests / synthetic_requests")
        return selector.explain_layer(st, req.demand, record_bytes=req.record_bytes, windows=req.windows)
    return selector.explain(st, input_windows=request_windows(req))


# ---------------------------------------------------------------------- requests
def _default_experts(topo: RailTopology) -> int:
    return topo.world_size * max(1, 128 // topo.world_size)


ARRANGEMENTS = ("none", "ring", "moderate", "extreme")
"""Sending arrangements of a request: 'none' = all node pairs at once (what a training step
sends), else the replay's RING / MODERATE / EXTREME windows (``workloads.arrange``)."""


def token_counts(settings: dict[str, Any]) -> list[int]:
    """The ``tokens`` setting as a list of T per GPU (an int or a list in the settings)."""
    raw = settings.get("tokens", 1024)
    values = [raw] if isinstance(raw, int) and not isinstance(raw, bool) else list(raw)
    if not values or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in values):
        raise ValueError(f"settings 'tokens' must be a positive integer or a list of them, got {raw!r}")
    return [int(t) for t in values]


def _variants(name: str, demand: Any, topo: RailTopology, *, arrangements: Sequence[str],
              payload_scales: Sequence[float], record_bytes: int, meta: dict[str, Any],
              sequence: str, position: int) -> list[ReplayRequest]:
    """``demand`` under every arrangement at every payload scale.

    ``sequence`` + arrangement + scale names the run of consecutive layers a request belongs to
    and ``position`` its place there (validation counts path changes along it)."""
    from megatron_railwave.lab.workloads import scaled_demand

    out = []
    for arr in arrangements:
        if arr not in ARRANGEMENTS:
            raise ValueError(f"arrangement {arr!r} is unknown; choose from {list(ARRANGEMENTS)}")
        windows = None
        arranged = demand
        if arr != "none":
            from megatron_railwave.lab.workloads import arrange

            arranged, windows = arrange(demand, arr, topo)
        for scale in payload_scales:
            scaled = arranged if scale == 1 else scaled_demand(arranged, scale)
            out.append(ReplayRequest(name=f"{name}-{arr}-x{scale:g}", records_NGN=scaled.records_NGN(),
                                     record_bytes=record_bytes, windows=windows, demand=scaled,
                                     meta={**meta, "arrangement": arr, "scale": float(scale),
                                           "sequence": f"{sequence}-{arr}-x{scale:g}", "position": position}))
    return out


def synthetic_requests(topo: RailTopology, *, families: Sequence[int], payload_scales: Sequence[float],
                       record_bytes: int, tokens: int | Sequence[int] = 1024, num_experts: int | None = None,
                       topk: int = 8, arrangements: Sequence[str] = ("none",)) -> list[ReplayRequest]:
    """Requests from ``workloads.synthetic_routing_maps``: one routing per family seed (its own
    locality and hot-expert ratio, so rho_g varies) and T, under each arrangement at every
    payload scale (counts x scale). Families play the role of consecutive layers.
    """
    from megatron_railwave.lab.workloads import synthetic_routing_maps
    from megatron_railwave.traffic import DemandCounts

    num_experts = num_experts or _default_experts(topo)
    out = []
    for t in token_counts({"tokens": tokens}):
        for pos, fam in enumerate(families):
            rng = np.random.default_rng([int(fam), 0xCA11B])
            locality, hot = float(rng.uniform(0.0, 8.0)), float(rng.uniform(2.0, 10.0))
            maps = synthetic_routing_maps(topo, num_tokens=t, num_experts=num_experts, topk=topk,
                                          seed=int(fam), hot_ratio=hot, locality=locality)
            out += _variants(f"syn{fam}-T{t}", DemandCounts.from_routing_maps(maps, topo), topo,
                             arrangements=arrangements, payload_scales=payload_scales, record_bytes=record_bytes,
                             meta={"workload": "synthetic", "family": int(fam), "locality": locality,
                                   "hot_ratio": hot, "tokens": t},
                             sequence=f"syn-T{t}", position=pos)
    return out


def glm_requests(topo: RailTopology, *, layers: Sequence[int] | None, step: int, seed: int,
                 payload_scales: Sequence[float], record_bytes: int, tokens: int | Sequence[int] = 1024,
                 arrangements: Sequence[str] = ("none",)) -> list[ReplayRequest]:
    """Requests from the synthetic GLM-4.5-Air routing (``workloads.glm``): layers at one step,
    at every T per GPU in ``tokens``."""
    from megatron_railwave.lab.workloads import GlmAirWorkload, glm_air_demands

    out = []
    for t in token_counts({"tokens": tokens}):
        work = GlmAirWorkload(num_tokens=t, seed=seed, step=step, layers=tuple(layers) if layers else None)
        for layer, demand in glm_air_demands(topo, work).items():
            out += _variants(f"glm{seed}-s{step}-l{layer}-T{t}", demand, topo, arrangements=arrangements,
                             payload_scales=payload_scales, record_bytes=record_bytes,
                             meta={"workload": "glm", "layer": layer, "step": step, "seed": seed, "tokens": t},
                             sequence=f"glm{seed}-s{step}-T{t}", position=int(layer))
    return out


def glm_seeds(settings: dict[str, Any]) -> list[int]:
    """The glm workload seeds of ``settings``: ``seed`` (one) plus ``extra_seeds`` (more routings
    of the same layers, to cover more skew levels)."""
    return [int(settings["seed"])] + [int(v) for v in settings.get("extra_seeds", [])]


def calibration_requests(topo: RailTopology, settings: dict[str, Any], *, record_bytes: int) -> list[ReplayRequest]:
    """The requests that ``settings`` (``workload``, ``families`` or ``layers``, ``seed``,
    ``payload_scales``, ``tokens``: one T or a list) describe; stored in the anchors file for
    validation."""
    scales, arrs = settings["payload_scales"], settings.get("arrangements", ("none",))
    if settings.get("workload", "synthetic") == "glm":
        return [req for seed in glm_seeds(settings)
                for req in glm_requests(topo, layers=settings.get("layers"), step=0, seed=seed,
                                        payload_scales=scales, record_bytes=record_bytes,
                                        tokens=token_counts(settings), arrangements=arrs)]
    return synthetic_requests(topo, families=settings["families"], payload_scales=scales,
                              record_bytes=record_bytes, tokens=token_counts(settings),
                              num_experts=settings.get("num_experts"), topk=settings.get("topk", 8),
                              arrangements=arrs)


def held_out_settings(settings: dict[str, Any], *, seed: int, count: int | None = None,
                      layers: Sequence[int] | None = None) -> dict[str, Any]:
    """Settings of validation requests that share nothing with calibration's ``settings``.

    glm: another workload seed (``seed``: other expert popularity and skew per layer) and layers
    calibration did not use (``layers``, default: every GLM-4.5-Air MoE layer outside the
    calibrated ones; the first ``count`` of them when given). synthetic: ``count`` routing
    families (default as many as calibration had) numbered from ``seed`` upwards, none of them
    calibrated. Payload scales, T and arrangements stay those of calibration.

    Raises:
        ValueError: the result would overlap calibration (``check_held_out``).
    """
    out = {k: v for k, v in settings.items() if k not in ("layers", "families", "extra_seeds")}
    out["seed"] = int(seed)
    if settings.get("workload", "synthetic") == "glm":
        from megatron_railwave.lab.workloads import GLM45_AIR

        if layers is None:
            used = set(settings.get("layers") or GLM45_AIR.layer_numbers)
            layers = [layer for layer in GLM45_AIR.layer_numbers if layer not in used]
            if not layers:
                raise ValueError("calibration used every GLM-4.5-Air MoE layer, so no layer is held out; "
                                 "calibrate on a subset (railwave calibrate --layers, e.g. the odd ones)")
        out["layers"] = sorted(int(v) for v in layers)[:count] if count else sorted(int(v) for v in layers)
    else:
        n = count or len(settings["families"])
        out["families"] = [int(seed) + i for i in range(n)]
    check_held_out(settings, out)
    return out


def check_held_out(calibration: dict[str, Any], validation: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the validation settings are held out from calibration's.

    glm: different workload seeds and disjoint layer sets (calibration's ``layers`` None = all).
    synthetic: disjoint family seeds.
    """
    workload = calibration.get("workload", "synthetic")
    if validation.get("workload", "synthetic") != workload:
        raise ValueError(f"validation workload {validation.get('workload')!r} differs from calibration's {workload!r}")
    if workload == "glm":
        from megatron_railwave.lab.workloads import GLM45_AIR

        shared_seeds = sorted(set(glm_seeds(validation)) & set(glm_seeds(calibration)))
        if shared_seeds:
            raise ValueError(f"held-out requests need another GLM seed than calibration's {glm_seeds(calibration)} "
                             f"(shared: {shared_seeds}); pass railwave validate --seed with another value")
        cal_layers = set(calibration.get("layers") or GLM45_AIR.layer_numbers)
        val_layers = set(validation.get("layers") or GLM45_AIR.layer_numbers)
        shared = sorted(cal_layers & val_layers)
        if shared:
            raise ValueError(f"held-out layers {shared} were calibrated; pass railwave validate --layers "
                             "with layers calibration did not use")
        return
    shared = sorted(set(calibration["families"]) & set(validation["families"]))
    if shared:
        raise ValueError(f"held-out routing families {shared} were calibrated; pass railwave validate --seed "
                         f"above {max(calibration['families'])}")


def validation_requests(topo: RailTopology, settings: dict[str, Any], *, seed: int, count: int | None = None,
                        layers: Sequence[int] | None = None, record_bytes: int) -> list[ReplayRequest]:
    """Held-out requests (``held_out_settings``) for validating anchors calibrated with ``settings``,
    ordered by sequence then layer, so path changes between consecutive layers can be counted."""
    held = held_out_settings(settings, seed=seed, count=count, layers=layers)
    requests = calibration_requests(topo, held, record_bytes=record_bytes)
    return sorted(requests, key=lambda r: (r.meta["sequence"], r.meta["position"]))
