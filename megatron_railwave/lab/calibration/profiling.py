"""Profiling requests on the four paths, the keep rule of an anchor, and the calibration
result (its rows, JSON round trip, merging runs at other T, features for older files).

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_railwave.lab.calibration.backend import MeasureBackend, path_costs
from megatron_railwave.lab.calibration.requests import (
    ReplayRequest,
    calibration_requests,
    request_features,
    request_group,
    request_seed,
    request_stats,
    request_windows,
    token_counts,
)
from megatron_railwave.names import PAPER_ROUTES, Route, parse_route
from megatron_railwave.selector.anchors import Anchor, AnchorSet, CalibrationContext, PathLatency
from megatron_railwave.selector.path_model import FEATURE_NAMES
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import SelectorScales, TrafficStats, dtype_bytes

ALL_PATHS: tuple[Route, ...] = PAPER_ROUTES


def profile_request(
    backend: MeasureBackend,
    request: ReplayRequest,
    paths: Sequence[Route] = ALL_PATHS,
    *,
    warmups: int = 5,
    repeats: int = 10,
    on_measure: Callable[[], None] | None = None,
) -> dict[Route, list[float]]:
    """Warm-ups, then ``repeats`` interleaved rounds; returns the samples per path (seconds)."""
    if repeats < 1 or warmups < 0:
        raise ValueError(
            f"need repeats >= 1 and warmups >= 0, got repeats={repeats}, warmups={warmups}"
        )
    paths = list(paths)
    if warmups:
        for path in paths:
            backend.measure(request, path, warmups)
            if on_measure:
                on_measure()
    samples: dict[Route, list[float]] = {p: [] for p in paths}
    for r in range(repeats):
        for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
            got = backend.measure(request, path, 1)
            if len(got) != 1 or not all(math.isfinite(t) and t >= 0 for t in got):
                raise ValueError(
                    f"backend {backend.name!r} returned {got!r} for one sample of "
                    f"{path} on {request.name!r}; expected one finite time >= 0"
                )
            samples[path].extend(float(t) for t in got)
            if on_measure:
                on_measure()
    return samples


def summarize(samples: Sequence[float]) -> PathLatency:
    """Median, p10 and p90 (linear interpolation) of latency samples."""
    arr = np.asarray(samples, dtype=np.float64)
    p10, med, p90 = np.percentile(arr, [10, 50, 90])
    return PathLatency(
        median=float(med), p10=float(min(p10, med)), p90=float(max(p90, med)), samples=int(arr.size)
    )


def keep_anchor(
    latency: dict[Route, PathLatency], *, max_spread: float = 1.2, min_gain: float = 0.05
) -> tuple[Route, bool, float, str]:
    """Apply the keep rule (module docstring). Returns (best path by median, kept, conservative
    gain ``1 - p90(best) / p10(JOINT)``, reason).

    The gain test is the product form ``p90(best) <= (1 - min_gain) * p10(JOINT)``, inclusive:
    a path exactly 5% below JOINT is kept. ``_RULE_RTOL`` absorbs only the rounding of the
    product (1e-12 relative), not a measurable difference.
    """
    best = min(ALL_PATHS, key=lambda p: (latency[p].median, p != Route.JOINT))
    joint = latency[Route.JOINT]
    gain = 1.0 - latency[best].p90 / joint.p10 if joint.p10 > 0 else 0.0
    if best == Route.JOINT:
        return best, False, 0.0, "JOINT is fastest"
    for p in (best, Route.JOINT):
        if latency[p].spread > max_spread:
            return (
                best,
                False,
                gain,
                f"{p} not repeatable (p90/p10 {latency[p].spread:.3f} > {max_spread})",
            )
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
    latency: dict[Route, PathLatency]
    best: Route
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
        out = {
            "request": self.request,
            "group": self.group,
            "seed": self.seed,
            "input_windows": self.input_windows,
            "coords": list(self.coords),
            "B_mean_bytes": self.stats.B_mean_bytes,
            "rho_g": self.stats.rho_g,
            "kappa": self.stats.kappa,
            "best": str(self.best),
            "kept": self.kept,
            "gain": self.gain,
            "reason": self.reason,
            "latency_s": {str(p): v.to_dict() for p, v in self.latency.items()},
        }
        if self.features is not None:
            out["features"] = list(self.features)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationResult:
    anchor_set: AnchorSet
    rows: tuple[CalibrationRow, ...]


def result_from_json(
    data: Any, *, source: str = "<json>", topo: RailTopology | None = None
) -> CalibrationResult:
    """The ``CalibrationResult`` behind a ``railwave calibrate --json`` file, to re-tune the
    selector without measuring again (``railwave calibrate --retune``).

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

    if (
        not isinstance(data, dict)
        or not isinstance(data.get("requests"), list)
        or "anchors" not in data
    ):
        raise ValueError(
            f"{source}: expected the JSON of `railwave calibrate --json` (fields 'anchors' and "
            "'requests')"
        )
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
            latency = {parse_route(p): PathLatency(**v) for p, v in row["latency_s"].items()}
            st = TrafficStats(
                B_mean_bytes=float(row["B_mean_bytes"]),
                B_max_bytes=float(row["B_mean_bytes"]),
                rho_g=float(row["rho_g"]),
                kappa=float(row["kappa"]),
                coords=coords,  # type: ignore[arg-type]
                records_total=0,
                remote_records=0,
            )
            out = CalibrationRow(
                request=str(row["request"]),
                stats=st,
                coords=coords,
                latency=latency,  # type: ignore[arg-type]
                best=parse_route(row["best"]),
                kept=bool(row["kept"]),
                gain=float(row["gain"]),
                reason=str(row["reason"]),
                input_windows=int(row["input_windows"]),
                group=str(row["group"]),
                seed=str(row["seed"]),
                features=None
                if row.get("features") is None or not current
                else tuple(float(v) for v in row["features"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{source}: field 'requests[{i}]' is malformed ({exc!r}); write it with "
                "`railwave calibrate --json`"
            ) from None
        rows.append(out)
        if out.kept:
            anchors.append(
                Anchor(
                    name=out.request,
                    coords=coords,
                    B_mean_bytes=st.B_mean_bytes,  # type: ignore[arg-type]
                    rho_g=st.rho_g,
                    kappa=st.kappa,
                    path=out.best,
                    latency_s=latency,
                    input_windows=out.input_windows,
                )
            )
    return CalibrationResult(
        anchor_set=AnchorSet(anchors=tuple(anchors), scales=base.scales, context=base.context),
        rows=tuple(rows),
    )


def with_features(
    result: CalibrationResult, topo: RailTopology, *, progress: bool = True
) -> CalibrationResult:
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
        raise ValueError(
            "the calibration records no request settings (context.settings.requests): its rows' "
            "features cannot be computed; re-run `railwave calibrate`"
        )
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
        raise ValueError(
            f"the calibration's settings do not regenerate request {lost[0]!r} ({len(lost)} in "
            f"all): "
            "its features cannot be computed; re-run `railwave calibrate`"
        )
    rows = tuple(
        dataclasses.replace(r, features=features[r.request]) if r.features is None else r
        for r in result.rows
    )
    return CalibrationResult(anchor_set=result.anchor_set, rows=rows)


def calibrate(
    backend: MeasureBackend,
    requests: Sequence[ReplayRequest],
    topo: RailTopology,
    *,
    hidden_size: int,
    dtype: str,
    warmups: int = 5,
    repeats: int = 10,
    max_spread: float = 1.2,
    min_gain: float = 0.05,
    scales: SelectorScales | None = None,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> CalibrationResult:
    """Profile every request on the four paths and keep the anchors that pass the rule; every row
    carries the path model's features, computed with the costs ``settings`` name
    (``path_costs``)."""
    if not requests:
        raise ValueError("calibrate needs at least one request")
    resolved = AnchorSet.scales_for(topo, scales)
    ref, rho_s, kappa_s = resolved
    costs = path_costs(settings or {}, topo.world_size)
    rows, anchors = [], []
    per_request = len(ALL_PATHS) * (repeats + (1 if warmups else 0))
    with _progress(per_request * len(requests), "calibrate", progress) as bar:
        for req in requests:
            st = request_stats(
                req,
                topo,
                SelectorScales(payload_ref_bytes=ref, rho_scale=rho_s, kappa_scale=kappa_s),
            )
            samples = profile_request(
                backend, req, warmups=warmups, repeats=repeats, on_measure=lambda: bar.update(1)
            )
            latency = {p: summarize(v) for p, v in samples.items()}
            best, kept, gain, reason = keep_anchor(
                latency, max_spread=max_spread, min_gain=min_gain
            )
            if kept and not math.isfinite(st.coords[0]):
                kept, reason = False, "no remote payload"
            rows.append(
                CalibrationRow(
                    request=req.name,
                    stats=st,
                    coords=st.coords,
                    latency=latency,
                    best=best,
                    kept=kept,
                    gain=gain,
                    reason=reason,
                    input_windows=request_windows(req),
                    group=request_group(req),
                    seed=request_seed(req),
                    features=request_features(req, topo, costs),
                )
            )
            if kept:
                anchors.append(
                    Anchor(
                        name=req.name,
                        coords=st.coords,
                        B_mean_bytes=st.B_mean_bytes,
                        rho_g=st.rho_g,
                        kappa=st.kappa,
                        path=best,
                        latency_s=latency,
                        input_windows=request_windows(req),
                    )
                )
    context = CalibrationContext(
        topology=topo.to_dict(),
        hidden_size=hidden_size,
        dtype=dtype,
        backend=backend.name,
        date=CalibrationContext.now(),
        settings={
            "warmups": warmups,
            "repeats": repeats,
            "max_spread": max_spread,
            "min_gain": min_gain,
            "num_requests": len(requests),
            **(settings or {}),
        },
    )
    return CalibrationResult(
        anchor_set=AnchorSet(anchors=tuple(anchors), scales=resolved, context=context),
        rows=tuple(rows),
    )


def merge_results(
    results: Sequence[CalibrationResult], sources: Sequence[str]
) -> CalibrationResult:
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
        return {
            "context.topology": c.topology,
            "context.hidden_size": c.hidden_size,
            "context.dtype": c.dtype,
            "context.backend": c.backend,
            "scales": list(res.anchor_set.scales),
            **{f"context.settings.{k}": v for k, v in c.settings.items() if k not in skip_settings},
            "context.settings.requests (besides tokens)": req,
        }

    want = comparable(first)
    for res, src in zip(results[1:], sources[1:]):
        got = comparable(res)
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                raise ValueError(
                    f"{src} is another calibration than {sources[0]}: field {key!r} is "
                    f"{got.get(key)!r} there and {want.get(key)!r} here; only the T values may "
                    f"differ"
                )
    rows = tuple(r for res in results for r in res.rows)
    names = [r.request for r in rows]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:3]
        raise ValueError(
            f"the calibrations {list(sources)} share requests (e.g. {dup}); merge runs of other T "
            f"values"
        )
    tokens = sorted(
        {
            t
            for res in results
            for t in token_counts(res.anchor_set.context.settings.get("requests", {}))
        }
    )
    settings = {
        **ctx.settings,
        "num_requests": len(rows),
        "requests": {**ctx.settings.get("requests", {}), "tokens": tokens},
    }
    context = dataclasses.replace(ctx, settings=settings)
    anchors = tuple(a for res in results for a in res.anchor_set.anchors)
    return CalibrationResult(
        anchor_set=AnchorSet(anchors=anchors, scales=first.anchor_set.scales, context=context),
        rows=rows,
    )
