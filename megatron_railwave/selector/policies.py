"""Route selection per layer: a fixed path, the calibrated nearest-anchor rule, or the calibrated
RAIL / JOINT path model.

A selector sees only global data (the anchor rule: B, rho_g, kappa of the gathered demand; the
path model: features of the gathered counts, ``path_model``), identical on every rank, and keeps
no state, so every rank picks the same path for the same layer call. An anchors file whose
tuning chose the path model (``context.settings.selector.model``) gets a ``ModelSelector``;
otherwise the anchor rule below applies.

Runtime rule (paper): an anchor is *eligible* for a phase when its payload is within
``payload_ratio`` of the phase's (|log2 B - log2 B_a| <= log2 payload_ratio) and both shape
coordinates are within ``shape_distance``; the nearest eligible anchor (Euclidean distance over
the three coordinates, ties to the earlier anchor in the file) gives the path; with none, JOINT.
Anchors come from ``railwave calibrate`` (file format in ``anchors``).

One extension of the paper's payload window (``extend_below``, on by default): an anchor whose
path posts fewer phases than the JOINT fallback (NATIVE or RAIL on an input with fewer sending
windows than the N - 1 waves of the permutation schedule, e.g. all node pairs at once) is also
eligible at *any smaller* payload, same shape window. Why: the fewer-phase path saves fixed
per-phase costs, whose weight grows as the payload shrinks, so where it beat JOINT it beats JOINT
by at least as much below (checked on the flow model: docs/selector.md, "Results"). Above the
anchor's payload the paper's ratio still applies.

Outside every anchor the path is JOINT, or, where the anchors file records a tuned fallback split
(``fallback_below``), RAIL below that payload when it posts fewer phases than JOINT (with rail
chunks JOINT posts 2-3x the phases and loses at small payloads whatever the shape).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from megatron_railwave.names import Route, parse_route
from megatron_railwave.planner import WaveSchedule
from megatron_railwave.selector.anchors import (
    DEFAULT_PAYLOAD_RATIO,
    DEFAULT_SHAPE_DISTANCE,
    Anchor,
    AnchorSet,
    load_anchors,
)
from megatron_railwave.selector.online import PROCESS_SHARED, OnlineSelector, anchor_prior
from megatron_railwave.selector.path_model import RailJointModel, path_features
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, SelectorScales, TrafficStats

if TYPE_CHECKING:
    from megatron_railwave.config import RailWaveConfig

__all__ = [
    "PathSelector",
    "FixedSelector",
    "AnchorSelector",
    "ModelSelector",
    "Selection",
    "selector_from_config",
    "select_for_layer",
    "needs_delivery",
    "plans_min_max",
    "needs_descriptors",
    "fallback_phases_of",
    "fewer_phases",
    "posts_fewer_phases",
]


class PathSelector(Protocol):
    def select(self, stats: TrafficStats) -> Route:
        """The path for a phase with these (global) descriptors."""
        ...


class FixedSelector:
    """Always the same path."""

    def __init__(self, path: Route | str) -> None:
        self.path = parse_route(path)

    def select(self, stats: TrafficStats) -> Route:
        return self.path


@dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    """Why a path was chosen (tools and validation; ``select`` returns only the path)."""

    path: Route
    anchor: str | None
    """Name of the anchor reused, None for the fallback."""
    distance: float
    """Distance to that anchor in selector coordinates (inf for the fallback)."""
    coords: tuple[float, float, float]


class AnchorSelector:
    """Nearest eligible calibrated anchor, else ``fallback`` (JOINT).

    Pure: the decision depends only on ``stats`` and the immutable anchors, so repeated calls and
    different ranks agree. Cost: a few microseconds per layer (``railwave validate --bench``).

    Args:
        anchor_set: the calibrated anchors (``anchors.load_anchors``).
        payload_ratio: reuse an anchor only within this payload ratio (>= 1; paper 1.25).
        shape_distance: ... and within this distance on both shape coordinates (>= 0; paper 0.02).
        fallback: the path outside every anchor's neighbourhood (JOINT).
        extend_below: an anchor whose path posts fewer phases than the fallback is also eligible
            at any smaller payload (module docstring); False: the paper's two-sided ratio only.
        fallback_below: (B_mean bytes, path) or None. Outside every anchor's neighbourhood, a
            phase whose B_mean is below these bytes runs this path instead of ``fallback``, when
            the path posts fewer rail phases than the fallback on its input (NATIVE / RAIL on fewer
            windows than JOINT's waves x chunks): the payload below which fixed per-phase costs
            decide, tuned by ``railwave calibrate`` (``AnchorSet.fallback_below``).
    """

    __slots__ = (
        "anchor_set",
        "payload_ratio",
        "shape_distance",
        "fallback",
        "extend_below",
        "fallback_below",
        "_points",
        "_scales",
        "_log_ratio",
        "_below_x",
        "_fallback_phases",
    )

    def __init__(
        self,
        anchor_set: AnchorSet,
        *,
        payload_ratio: float = DEFAULT_PAYLOAD_RATIO,
        shape_distance: float = DEFAULT_SHAPE_DISTANCE,
        fallback: Route | str = Route.JOINT,
        extend_below: bool = True,
        fallback_below: tuple[float, Route | str] | None = None,
    ) -> None:
        if not payload_ratio >= 1:
            raise ValueError(f"payload_ratio must be >= 1, got {payload_ratio}")
        if not shape_distance >= 0:
            raise ValueError(f"shape_distance must be >= 0, got {shape_distance}")
        if fallback_below is not None:
            below_bytes, below_path = float(fallback_below[0]), parse_route(fallback_below[1])
            if not (below_bytes > 0 and math.isfinite(below_bytes)) or below_path.waved:
                raise ValueError(
                    f"fallback_below must be (bytes > 0, native or rail), got {fallback_below!r}"
                )
            fallback_below = (below_bytes, below_path)
        self.fallback_below = fallback_below
        self.anchor_set = anchor_set
        self.payload_ratio = float(payload_ratio)
        self.shape_distance = float(shape_distance)
        self.fallback = parse_route(fallback)
        self.extend_below = bool(extend_below)
        fallback_phases = fallback_phases_of(anchor_set, self.fallback)
        self._fallback_phases = fallback_phases
        self._below_x = (
            math.log2(fallback_below[0] / anchor_set.scales[0])
            if fallback_below is not None
            else -math.inf
        )
        # Flat tuples: the hot loop touches only floats (no attribute lookups per anchor).
        self._points = tuple(
            (
                a.coords[0],
                a.coords[1],
                a.coords[2],
                a.path,
                a.name,
                a.input_windows,
                self.extend_below and posts_fewer_phases(a, fallback_phases),
            )
            for a in anchor_set.anchors
        )
        self._scales = anchor_set.scales
        # Tiny slack so a ratio of exactly payload_ratio stays eligible despite rounding.
        self._log_ratio = math.log2(self.payload_ratio) + 1e-12

    def _coords(self, stats: TrafficStats) -> tuple[float, float, float]:
        ref, rho_scale, kappa_scale = self._scales
        b = stats.B_mean_bytes
        return (
            math.log2(b / ref) if b > 0 else -math.inf,
            (stats.rho_g - 1.0) / rho_scale,
            (stats.kappa - 1.0) / kappa_scale,
        )

    def explain(self, stats: TrafficStats, *, input_windows: int = 1) -> Selection:
        """The decision with the anchor that made it.

        Args:
            input_windows: sending windows the input comes in (1: all node pairs at once, as a
                training step sends; replay tools pass their arrangement's count). Only anchors
                calibrated with as many windows are eligible.
        """
        x, y, z = self._coords(stats)
        if not math.isfinite(x):  # no remote payload: every path is the same, nothing to reuse
            return Selection(path=self.fallback, anchor=None, distance=math.inf, coords=(x, y, z))
        best, best_d2 = None, math.inf
        lr, sd = self._log_ratio, self.shape_distance + 1e-12
        for ax, ay, az, path, name, windows, below_ok in self._points:
            if windows != input_windows:
                continue
            dx, dy, dz = x - ax, y - ay, z - az
            if dx > lr or (dx < -lr and not below_ok) or abs(dy) > sd or abs(dz) > sd:
                continue
            d2 = dx * dx + dy * dy + dz * dz
            if d2 < best_d2:
                best, best_d2 = (path, name), d2
        if best is None:
            return Selection(
                path=self.fallback_path(x, input_windows),
                anchor=None,
                distance=math.inf,
                coords=(x, y, z),
            )
        return Selection(
            path=best[0], anchor=best[1], distance=math.sqrt(best_d2), coords=(x, y, z)
        )

    def fallback_path(self, x: float, input_windows: int = 1) -> Route:
        """The path outside every anchor's neighbourhood at payload coordinate ``x``:
        ``fallback_below``'s path below its payload where it posts fewer phases, else
        ``fallback``."""
        if (
            x < self._below_x
            and self.fallback_below is not None
            and fewer_phases(input_windows, self._fallback_phases)
        ):
            return self.fallback_below[1]
        return self.fallback

    def select(self, stats: TrafficStats) -> Route:
        return self.explain(stats).path

    def reach_AR(self, coords_R3: np.ndarray, windows_R: np.ndarray) -> np.ndarray:
        """[A, R] bool: whether anchor ``a`` (file order) is eligible for point ``r`` under the
        runtime rule of ``explain`` (calibration's cross-seed check; not used at run time).

        Args:
            coords_R3: [R, 3] float, selector coordinates of R points (x may be -inf: never
            eligible).
            windows_R: [R] int, the points' input windows.
        """
        x, y, z = (np.asarray(coords_R3, dtype=np.float64)[:, k] for k in range(3))
        windows_R = np.asarray(windows_R)
        lr, sd = self._log_ratio, self.shape_distance + 1e-12
        out = np.zeros((len(self._points), x.size), dtype=bool)
        for i, (ax, ay, az, _, _, windows, below_ok) in enumerate(self._points):
            dx = x - ax
            out[i] = (
                np.isfinite(x)
                & (windows_R == windows)
                & (dx <= lr)
                & ((dx >= -lr) | below_ok)
                & (np.abs(y - ay) <= sd)
                & (np.abs(z - az) <= sd)
            )
        return out


class ModelSelector:
    """RAIL where the calibrated model (``path_model.RailJointModel``) predicts RAIL faster than
    JOINT, else JOINT.

    Pure: the features come from the gathered global counts (``path_model.path_features``: the
    estimated time of RAIL's sending windows against JOINT's cyclic waves, from their rail,
    relay, local-round and NVLink delivery loads and the model's recorded fixed costs), so every
    rank decides the same. It needs every rank's copies per destination GPU and mask class, which
    the count exchange carries when ``needs_delivery(selector)`` (the dispatcher asks for them).

    Args:
        model: the fitted coefficients and the costs they go with (``AnchorSet.path_model``).
        topo: the job's topology (the features' rates and healthy rails).
        fallback: the path where the model has no coefficients for the input kind (JOINT).
    """

    __slots__ = ("model", "topo", "fallback")

    def __init__(
        self, model: RailJointModel, topo: RailTopology, *, fallback: Route | str = Route.JOINT
    ) -> None:
        self.model = model
        self.topo = topo
        self.fallback = parse_route(fallback)

    def explain_layer(
        self,
        stats: TrafficStats,
        demand: DemandCounts,
        *,
        record_bytes: int,
        windows: WaveSchedule | None = None,
    ) -> Selection:
        """The decision; ``distance`` holds the predicted log(t_RAIL / t_JOINT) (inf: no
        prediction); ``anchor`` is "model", "gate" (above the payload gate) or None (no
        prediction)."""
        predicted = self._predict(demand, record_bytes=record_bytes, windows=windows)
        if predicted is None:
            gated = stats.B_mean_bytes > 0 and not self.model.decides(
                stats.B_mean_bytes, input_windows=_input_windows(windows)
            )
            return Selection(
                path=self.fallback,
                anchor="gate" if gated else None,
                distance=math.inf,
                coords=stats.coords,
            )
        return Selection(
            path=Route.RAIL if predicted < 0 else Route.JOINT,
            anchor="model",
            distance=predicted,
            coords=stats.coords,
        )

    def select_layer(
        self,
        stats: TrafficStats | None,
        demand: DemandCounts,
        *,
        record_bytes: int,
        windows: WaveSchedule | None = None,
    ) -> Route:
        """The path alone. ``stats`` is not read (None is fine): the model decides from the counts,
        so the dispatcher need not compute the descriptors for it (``needs_descriptors``)."""
        predicted = self._predict(demand, record_bytes=record_bytes, windows=windows)
        if predicted is None:
            return self.fallback
        return Route.RAIL if predicted < 0 else Route.JOINT

    def _predict(
        self, demand: DemandCounts, *, record_bytes: int, windows: WaveSchedule | None
    ) -> float | None:
        """Predicted log(t_RAIL / t_JOINT); None without remote payload (every path is the same),
        above the model's payload gate for the input kind (``RailJointModel.gate``: no estimate is
        computed) or without coefficients for the input kind."""
        remote = demand.remote_records()
        if not (record_bytes > 0 and remote > 0):
            return None
        input_windows = _input_windows(windows)
        if not self.model.decides(
            remote * record_bytes / demand.world_size,  # B_mean, as TrafficStats has it
            input_windows=input_windows,
        ):
            return None
        features = path_features(
            demand, self.topo, record_bytes=record_bytes, windows=windows, costs=self.model.costs
        )
        return self.model.log_ratio(features, input_windows=input_windows)

    def select(self, stats: TrafficStats) -> Route:
        raise TypeError(
            "ModelSelector decides from the gathered counts, not the descriptors alone: call "
            "select_for_layer(selector, stats, demand, record_bytes=...)"
        )


def _input_windows(windows: WaveSchedule | None) -> int:
    """The input's sending windows (None: all node pairs at once, one window)."""
    return windows.num_waves if windows is not None else 1


def select_for_layer(
    selector: PathSelector,
    stats: TrafficStats | None,
    demand: DemandCounts,
    *,
    record_bytes: int,
    windows: WaveSchedule | None = None,
) -> Route:
    """One layer's path: a selector that reads the counts (``select_layer``, the path model) gets
    them; any other ``PathSelector`` the descriptors alone (``stats``; None only where
    ``needs_descriptors(selector)`` is False)."""
    if isinstance(selector, ModelSelector):
        return selector.select_layer(stats, demand, record_bytes=record_bytes, windows=windows)
    if stats is None and needs_descriptors(selector):
        raise ValueError(
            f"{type(selector).__name__} decides from the descriptors; pass the layer's "
            f"TrafficStats "
            "(stats.demand_stats)"
        )
    return selector.select(stats)


def needs_descriptors(selector: PathSelector) -> bool:
    """Whether ``select_for_layer`` reads the descriptors (B, rho_g, kappa) for this selector: not
    for a fixed path, nor for the path model, which decides from the counts (the descriptors cost
    ~0.3 ms per layer on the host at 4 x 8, more than the model's own decision)."""
    return not isinstance(selector, (ModelSelector, FixedSelector, OnlineSelector))


def plans_min_max(selector: PathSelector, path: Route | None = None) -> bool:
    """Whether this layer call's plan may be a min-max one (FLOW / FLOW_WAVES), whose planner
    reads every rank's copies per destination GPU (``planner.plan.delivery_copies_NNGG``), so the
    count exchange must carry the delivery counts: a path already fixed for the call (a recompute
    replays its forward's, which gathered them too) that is one, a fixed selector's, or an online
    selector with one among its candidates. The same answer on every rank (the configuration's)."""
    if path is not None:
        return parse_route(path).min_max
    if isinstance(selector, FixedSelector):
        return selector.path.min_max
    if isinstance(selector, OnlineSelector):
        return any(p.min_max for p in selector.candidates)
    return False


def needs_delivery(selector: PathSelector) -> bool:
    """Whether the count exchange must carry every rank's copies per destination GPU and mask class
    for it (``traffic.DemandCounts.delivery_WNKG``): the selectors ``select_for_layer`` hands the
    counts to."""
    return isinstance(selector, ModelSelector)


def fallback_phases_of(anchor_set: AnchorSet, fallback: Route) -> int | None:
    """Rail phases the fallback posts per call on the calibrated cluster: N - 1 waves of the
    file's rail chunks each for a waved path (the cyclic permutation schedule calibration plans
    with), None (unknown: the input's windows) for NATIVE / RAIL."""
    nodes = anchor_set.context.topology.get("num_nodes")
    if not fallback.waved or isinstance(nodes, bool) or not isinstance(nodes, int):
        return None
    return (nodes - 1) * anchor_set.chunks


def fewer_phases(input_windows: Any, fallback_phases: int | None) -> Any:
    """Whether NATIVE / RAIL, which keep the input's sending windows (one rail phase each), post
    fewer rail phases than the fallback's ``fallback_phases`` (None: unknown, never). Works on an
    int or elementwise on an array of window counts."""
    if fallback_phases is None:
        return (
            np.zeros_like(input_windows, dtype=bool)
            if isinstance(input_windows, np.ndarray)
            else False
        )
    return input_windows < fallback_phases


def posts_fewer_phases(anchor: Anchor, fallback_phases: int | None) -> bool:
    """Whether ``anchor``'s path posts fewer rail phases than the fallback on its input."""
    return not anchor.path.waved and bool(fewer_phases(anchor.input_windows, fallback_phases))


# ---------------------------------------------------------------------- from the config
_LOG = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *, warn: bool) -> None:
    # Every MoE layer builds its own dispatcher (and selector): one line per process and cause,
    # through logging (not warnings.warn, which PYTHONWARNINGS=ignore would hide), and only where
    # the caller says so (the dispatcher's mode choice: global rank 0), so a job prints it once.
    if warn and key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message)


@lru_cache(maxsize=16)
def _cached_anchors(path: str, mtime_ns: int, topo: RailTopology) -> AnchorSet:
    return load_anchors(path, topo)


def selector_from_config(
    config: RailWaveConfig, topo: RailTopology, *, warn: bool = True
) -> PathSelector | OnlineSelector:
    """The selector for ``path='auto'``: with ``config.selector_kind() == 'online'`` an
    ``online.OnlineSelector`` (one per layer: it keeps that layer's measurements), seeded by the
    anchors file when one is given; otherwise the file's path model when its tuning recorded one
    (``ModelSelector``; the config's payload_ratio / shape_distance then play no part), else the
    calibrated anchors, or JOINT when there are none.

    A missing anchors file means "always JOINT": one warning through the ``megatron_railwave``
    logger per process, when ``warn`` (``dispatch_modes.choose_dispatch_mode`` passes True on
    global rank 0 only). A malformed file, one calibrated for another topology or with other rail
    chunks than the config's raises ``ValueError`` naming the field (on every rank, at
    construction, before any collective).
    """
    if config.selector_kind() == "online":
        return _online_selector(config, topo)
    if config.anchors is None:
        _warn_once(
            "<none>",
            "railwave path 'auto' without an anchors file: every layer runs JOINT "
            "(run `railwave calibrate` to create anchors)",
            warn=warn,
        )
        return FixedSelector(Route.JOINT)
    path = Path(config.anchors).expanduser().resolve()
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        _warn_once(
            str(path),
            f"railwave anchors file {str(path)!r} does not exist: every layer "
            "runs JOINT (run `railwave calibrate --write-anchors` to create it)",
            warn=warn,
        )
        return FixedSelector(Route.JOINT)
    anchor_set = _cached_anchors(str(path), mtime, topo)
    if anchor_set.chunks != config.chunks:
        # The anchors say where a path beats JOINT with the file's chunks; another JOINT (more or
        # fewer rail phases per wave) moves every boundary, so the file does not apply.
        raise ValueError(
            f"anchors file {str(path)!r} was calibrated with chunks={anchor_set.chunks} (field "
            f"'context.settings.chunks') but this RailWave config has chunks={config.chunks}; set "
            f"chunks: {anchor_set.chunks} or run `railwave calibrate --chunks {config.chunks}`"
        )
    if anchor_set.path_model is not None:
        return ModelSelector(anchor_set.path_model, topo)
    # The thresholds the file was tuned with (calibrate's leave-one-out choice), unless the
    # config overrides them: anchors are only validated with the thresholds they were tuned for.
    payload_ratio, shape_distance = anchor_set.thresholds(
        config.payload_ratio, config.shape_distance
    )
    return AnchorSelector(
        anchor_set,
        payload_ratio=payload_ratio,
        shape_distance=shape_distance,
        fallback_below=anchor_set.fallback_below,
    )


def _online_selector(config: RailWaveConfig, topo: RailTopology) -> OnlineSelector:
    """An online selector; an anchors file (checked like the offline rule's: topology, chunks)
    is its prior and sets its coordinate scales. A missing file raises: the user named it."""
    if config.anchors is None:
        return OnlineSelector(
            config.online, scales=SelectorScales().resolve(topo), shared=PROCESS_SHARED
        )
    path = Path(config.anchors).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"anchors file {str(path)!r} (the online selector's prior) does not exist; write it "
            f"with "
            "`railwave calibrate --write-anchors` or an earlier run's online_out, or drop 'anchors'"
        )
    anchor_set = _cached_anchors(str(path), os.stat(path).st_mtime_ns, topo)
    if anchor_set.chunks != config.chunks:
        raise ValueError(
            f"anchors file {str(path)!r} was calibrated with chunks={anchor_set.chunks} (field "
            f"'context.settings.chunks') but this RailWave config has chunks={config.chunks}; set "
            f"chunks: {anchor_set.chunks} or drop 'anchors'"
        )
    payload_ratio, shape_distance = anchor_set.thresholds(
        config.payload_ratio, config.shape_distance
    )
    rule = AnchorSelector(
        anchor_set,
        payload_ratio=payload_ratio,
        shape_distance=shape_distance,
        fallback_below=anchor_set.fallback_below,
    )
    return OnlineSelector(
        config.online,
        scales=anchor_set.scales,
        prior=anchor_prior(anchor_set, rule.explain),
        shared=PROCESS_SHARED,
    )
