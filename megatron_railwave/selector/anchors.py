"""Selector anchors: the calibrated file format (YAML, versioned) and its loader.

An *anchor* is a calibrated point of the selector space: the normalised coordinates of one
replay request, the path that won there, and the measured latencies of all four paths. At run
time ``selector.AnchorSelector`` reuses an anchor only near it (payload ratio and shape distance)
and falls back to JOINT elsewhere.

File layout (``format: railwave-anchors``, ``version: 1``)::

    format: railwave-anchors
    version: 1
    context:                      # what the anchors were calibrated for
      topology: {...}             # RailTopology.to_dict(); must match the job (name excepted)
      hidden_size: 4096
      dtype: bf16
      backend: netmodel           # netmodel | testbed | torchrun | ...
      date: '2026-01-01T00:00:00+00:00'
      settings: {...}             # warm-ups, repeats, thresholds, requests, chunks (free-form)
    scales:                       # coordinate normalisation (SelectorScales, resolved)
      payload_ref_bytes: 58720256.0
      rho_scale: 7.0
      kappa_scale: 2.0
    anchors:
      - name: req-003
        coords: [0.41, 0.12, 0.98]            # log2(B / ref), (rho_g - 1) / rho_scale, (kappa - 1)
        / kappa_scale
        B_mean_bytes: 78643200.0
        rho_g: 1.84
        kappa: 2.96
        path: rail                            # native | rail | perm | joint
        input_windows: 1                      # sending windows of the input (1 = all pairs at once)
        latency_s:                            # all four paths: median and spread in seconds
          native: {median: 0.0123, p10: 0.0121, p90: 0.0125, samples: 10}
          rail:   {...}
          perm:   {...}
          joint:  {...}

Coordinates are recomputed at run time from B, rho_g and kappa with the file's ``scales``, so a
file stays valid when the package's default scales change.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_railwave.names import PAPER_ROUTES, ROUTES, Route, parse_route, route_list
from megatron_railwave.planner.plan import MAX_CHUNKS
from megatron_railwave.selector.path_model import RailJointModel
from megatron_railwave.topology import RailTopology, read_yaml
from megatron_railwave.traffic import SelectorScales, TrafficStats

__all__ = [
    "ANCHORS_FORMAT",
    "ANCHORS_VERSION",
    "DEFAULT_PAYLOAD_RATIO",
    "DEFAULT_SHAPE_DISTANCE",
    "PathLatency",
    "Anchor",
    "CalibrationContext",
    "AnchorSet",
    "anchors_from_dict",
    "load_anchors",
    "save_anchors",
]

DEFAULT_PAYLOAD_RATIO = 1.25
"""The paper's selector thresholds, used where an anchors file records no tuned ones: reuse an
anchor within this payload ratio ..."""
DEFAULT_SHAPE_DISTANCE = 0.02
"""... and within this distance on both shape coordinates."""

ANCHORS_FORMAT = "railwave-anchors"
ANCHORS_VERSION = 1
_PATHS = ROUTES
"""Paths an anchor may carry a latency for (written in this order)."""
_REQUIRED_PATHS = PAPER_ROUTES
"""Paths every anchor must carry: the paper's four (FLOW's are optional, so that files written
before it was added stay valid)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PathLatency:
    """Measured latency of one path on one request (seconds)."""

    median: float
    p10: float
    p90: float
    samples: int

    def __post_init__(self) -> None:
        if not (0 <= self.p10 <= self.median <= self.p90) or not math.isfinite(self.p90):
            raise ValueError(
                f"need 0 <= p10 <= median <= p90 (finite), got p10={self.p10}, "
                f"median={self.median}, p90={self.p90}"
            )
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")

    @property
    def spread(self) -> float:
        """p90 / p10 (1.0 = perfectly repeatable; inf when p10 is 0 and p90 is not)."""
        if self.p10 > 0:
            return self.p90 / self.p10
        return 1.0 if self.p90 == 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "samples": self.samples}


@dataclass(frozen=True, kw_only=True, slots=True)
class Anchor:
    """One calibrated point: where it is, which path won, and what every path measured."""

    name: str
    coords: tuple[float, float, float]
    B_mean_bytes: float
    rho_g: float
    kappa: float
    path: Route
    latency_s: dict[Route, PathLatency] = field(default_factory=dict)
    input_windows: int = 1
    """Sending windows of the calibrated input: 1 = all node pairs at once (what a training step
    sends), N - 1 = a replay arrangement, whose windows NATIVE and RAIL keep. The selector reuses
    an anchor only for an input with as many windows: with the same descriptors, one window and
    three favour different paths (NATIVE / RAIL post one rail phase in the first, three in the
    second)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.input_windows, bool)
            or not isinstance(self.input_windows, int)
            or self.input_windows < 1
        ):
            raise ValueError(
                f"Anchor.input_windows must be an integer >= 1, got {self.input_windows!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "coords": [float(c) for c in self.coords],
            "B_mean_bytes": float(self.B_mean_bytes),
            "rho_g": float(self.rho_g),
            "kappa": float(self.kappa),
            "path": str(self.path),
            "input_windows": int(self.input_windows),
            "latency_s": {
                str(p): self.latency_s[p].to_dict() for p in _PATHS if p in self.latency_s
            },
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationContext:
    """Where and how the anchors were measured."""

    topology: dict[str, Any]
    """``RailTopology.to_dict()`` of the calibrated cluster."""
    hidden_size: int
    dtype: str
    backend: str
    date: str
    """ISO 8601 time of the calibration."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Free-form: warm-ups, repeats, thresholds, request generator."""

    @staticmethod
    def now() -> str:
        return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": dict(self.topology),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "backend": self.backend,
            "date": self.date,
            "settings": dict(self.settings),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class AnchorSet:
    """The content of an anchors file (immutable; shared by every layer's selector)."""

    anchors: tuple[Anchor, ...]
    scales: tuple[float, float, float]
    """(payload_ref_bytes, rho_scale, kappa_scale), resolved for the calibrated topology."""
    context: CalibrationContext

    def thresholds(
        self, payload_ratio: float | None = None, shape_distance: float | None = None
    ) -> tuple[float, float]:
        """(payload_ratio, shape_distance) for a selector over this file: each one given here
        (a RailWave config's or a command line's override), else the one `railwave calibrate`
        tuned and recorded under ``context.settings.selector`` (checked when the file is loaded),
        else the paper's default."""
        tuned = self.context.settings.get("selector") or {}
        return (
            float(tuned.get("payload_ratio", DEFAULT_PAYLOAD_RATIO))
            if payload_ratio is None
            else payload_ratio,
            float(tuned.get("shape_distance", DEFAULT_SHAPE_DISTANCE))
            if shape_distance is None
            else shape_distance,
        )

    @property
    def fallback_below(self) -> tuple[float, Route] | None:
        """(B_mean bytes, path) tuned by ``railwave calibrate`` (``context.settings.selector.
        fallback_below``, checked when the file is loaded): below this payload, outside every
        anchor, the selector runs this fewer-phase path instead of JOINT; None: JOINT everywhere."""
        below = (self.context.settings.get("selector") or {}).get("fallback_below")
        if not below:
            return None
        return float(below["payload_bytes"]), parse_route(below["path"])

    @property
    def path_model(self) -> RailJointModel | None:
        """The RAIL / JOINT model fitted by ``railwave calibrate`` (``context.settings.selector.
        model``, checked when the file is loaded), when the tuning chose it over the anchors;
        None: the nearest-anchor rule."""
        raw = (self.context.settings.get("selector") or {}).get("model")
        return (
            None
            if raw is None
            else RailJointModel.from_dict(raw, source="context.settings.selector.model")
        )

    @property
    def chunks(self) -> int:
        """Rail chunks per wave of the PERM / JOINT plans the file was calibrated with
        (``context.settings.chunks``, checked when the file is loaded; absent = 1, whole waves). The
        anchors compare paths against *that* JOINT, so a selector over them needs the same
        chunks."""
        return int(self.context.settings.get("chunks", 1))

    def coords(self, stats: TrafficStats) -> tuple[float, float, float]:
        """Selector coordinates of ``stats`` under this file's scales (pure, ~1 us)."""
        ref, rho_scale, kappa_scale = self.scales
        b = stats.B_mean_bytes
        return (
            math.log2(b / ref) if b > 0 else -math.inf,
            (stats.rho_g - 1.0) / rho_scale,
            (stats.kappa - 1.0) / kappa_scale,
        )

    def to_dict(self) -> dict[str, Any]:
        ref, rho, kappa = self.scales
        return {
            "format": ANCHORS_FORMAT,
            "version": ANCHORS_VERSION,
            "context": self.context.to_dict(),
            "scales": {"payload_ref_bytes": ref, "rho_scale": rho, "kappa_scale": kappa},
            "anchors": [a.to_dict() for a in self.anchors],
        }

    @staticmethod
    def scales_for(
        topo: RailTopology, scales: SelectorScales | None = None
    ) -> tuple[float, float, float]:
        return (scales or SelectorScales()).resolve(topo)


# ---------------------------------------------------------------------- parsing
def _fail(source: str, where: str, problem: str) -> ValueError:
    return ValueError(f"anchors file {source}: field '{where}' {problem}")


def _number(
    data: dict[str, Any], key: str, source: str, where: str, *, positive: bool = False
) -> float:
    if key not in data:
        raise _fail(source, f"{where}.{key}" if where else key, "is missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _fail(source, f"{where}.{key}" if where else key, f"must be a number, got {value!r}")
    if positive and not value > 0:
        raise _fail(source, f"{where}.{key}" if where else key, f"must be > 0, got {value!r}")
    return float(value)


def _mapping(data: Any, source: str, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _fail(source, where, f"must be a mapping, got {type(data).__name__}")
    return data


def _path(value: Any, source: str, where: str) -> Route:
    try:
        return parse_route(value)
    except ValueError:
        raise _fail(source, where, f"must be one of {route_list()}, got {value!r}") from None


def _latency(data: Any, source: str, where: str) -> PathLatency:
    data = _mapping(data, source, where)
    values = {k: _number(data, k, source, where) for k in ("median", "p10", "p90")}
    samples = data.get("samples", 1)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise _fail(source, f"{where}.samples", f"must be a positive integer, got {samples!r}")
    try:
        return PathLatency(**values, samples=samples)
    except ValueError as exc:
        raise _fail(source, where, str(exc)) from None


def _anchor(data: Any, source: str, where: str) -> Anchor:
    data = _mapping(data, source, where)
    name = data.get("name", where)
    if not isinstance(name, str):
        raise _fail(source, f"{where}.name", f"must be a string, got {name!r}")
    coords = data.get("coords")
    if (
        not isinstance(coords, list)
        or len(coords) != 3
        or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
            for c in coords
        )
    ):
        raise _fail(
            source, f"{where}.coords", f"must be a list of 3 finite numbers, got {coords!r}"
        )
    if "path" not in data:
        raise _fail(source, f"{where}.path", "is missing")
    path = _path(data["path"], source, f"{where}.path")
    lat = _mapping(data.get("latency_s", {}), source, f"{where}.latency_s")
    latency: dict[Route, PathLatency] = {}
    for key, value in lat.items():
        p = _path(key, source, f"{where}.latency_s.{key}")
        latency[p] = _latency(value, source, f"{where}.latency_s.{key}")
    missing = [str(p) for p in _REQUIRED_PATHS if p not in latency]
    if missing:
        raise _fail(
            source, f"{where}.latency_s", f"lacks the path(s) {missing}; all four are required"
        )
    windows = data.get("input_windows", 1)
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise _fail(source, f"{where}.input_windows", f"must be an integer >= 1, got {windows!r}")
    return Anchor(
        input_windows=windows,
        name=name,
        coords=(float(coords[0]), float(coords[1]), float(coords[2])),
        B_mean_bytes=_number(data, "B_mean_bytes", source, where, positive=True),
        rho_g=_number(data, "rho_g", source, where),
        kappa=_number(data, "kappa", source, where),
        path=path,
        latency_s=latency,
    )


def _check_topology(recorded: dict[str, Any], topo: RailTopology, source: str) -> None:
    expected = topo.to_dict()
    for key in sorted(set(expected) - {"name"}):
        if key not in recorded:
            raise _fail(source, f"context.topology.{key}", "is missing")
        got, want = recorded[key], expected[key]
        if key == "failed_rails":
            got = sorted([list(f) for f in got or []])
        if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
            same = math.isclose(float(got), want, rel_tol=1e-9)
        else:
            same = got == want
        if not same:
            raise ValueError(
                f"anchors file {source} was calibrated for another topology: field "
                f"'context.topology.{key}' is {got!r} but this job's topology "
                f"{topo.name!r} has {want!r}; run `railwave calibrate` for this cluster or drop "
                "'anchors' from the railwave config (path 'auto' then runs JOINT)"
            )


def _check_thresholds(settings: dict[str, Any], source: str) -> None:
    """The tuned selector thresholds, where recorded, are what the runtime uses: check them."""
    if settings.get("selector") is None:
        return
    tuned = _mapping(settings["selector"], source, "context.settings.selector")
    for key, low in (("payload_ratio", 1.0), ("shape_distance", 0.0)):
        if key in tuned:
            value = _number(tuned, key, source, "context.settings.selector")
            if not (math.isfinite(value) and value >= low):
                raise _fail(
                    source,
                    f"context.settings.selector.{key}",
                    f"must be a finite number >= {low:g}, got {value!r}; re-run `railwave "
                    f"calibrate`",
                )
    if tuned.get("fallback_below") is not None:
        where = "context.settings.selector.fallback_below"
        below = _mapping(tuned["fallback_below"], source, where)
        _number(below, "payload_bytes", source, where, positive=True)
        path = _path(below.get("path"), source, f"{where}.path")
        if path.waved:
            raise _fail(
                source,
                f"{where}.path",
                f"must be native or rail (fewer phases than JOINT), got {path}",
            )


def _check_model(settings: dict[str, Any], source: str) -> None:
    """A recorded path model, where present, is what the runtime uses: check it."""
    tuned = settings.get("selector") or {}
    if tuned.get("model") is not None:
        model = RailJointModel.from_dict(
            tuned["model"], source=f"{source}: field 'context.settings.selector.model'"
        )
        chunks = settings.get("chunks", 1)
        if model.costs.chunks != chunks:
            raise _fail(
                source,
                "context.settings.selector.model.costs.chunks",
                f"is {model.costs.chunks} but the file was calibrated with chunks={chunks} "
                "(context.settings.chunks); re-run `railwave calibrate --retune`",
            )


def _check_chunks(settings: dict[str, Any], source: str) -> None:
    """The recorded rail chunks, where present, decide which JOINT the anchors beat: check them."""
    if "chunks" not in settings:
        return
    value = settings["chunks"]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHUNKS:
        raise _fail(
            source,
            "context.settings.chunks",
            f"must be an integer in 1..{MAX_CHUNKS} (rail chunks per wave), got {value!r}; "
            "re-run `railwave calibrate`",
        )


def anchors_from_dict(
    data: Any, *, source: str = "<dict>", topo: RailTopology | None = None
) -> AnchorSet:
    """Validate and build an ``AnchorSet``; errors name the offending field.

    Args:
        data: the parsed YAML.
        source: how errors refer to the file.
        topo: when given, the file must have been calibrated for this topology.

    Raises:
        ValueError: malformed content, unknown version, or another topology.
    """
    data = _mapping(data, source, "<top level>")
    if data.get("format") != ANCHORS_FORMAT:
        raise _fail(source, "format", f"must be {ANCHORS_FORMAT!r}, got {data.get('format')!r}")
    version = data.get("version")
    if version != ANCHORS_VERSION:
        raise _fail(
            source,
            "version",
            f"must be {ANCHORS_VERSION} (this build reads version "
            f"{ANCHORS_VERSION}), got {version!r}; re-run `railwave calibrate`",
        )
    ctx = _mapping(data.get("context"), source, "context")
    topo_data = _mapping(ctx.get("topology"), source, "context.topology")
    hidden = ctx.get("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise _fail(source, "context.hidden_size", f"must be a positive integer, got {hidden!r}")
    for key in ("dtype", "backend", "date"):
        if not isinstance(ctx.get(key), str):
            raise _fail(source, f"context.{key}", f"must be a string, got {ctx.get(key)!r}")
    context = CalibrationContext(
        topology=topo_data,
        hidden_size=hidden,
        dtype=ctx["dtype"],
        backend=ctx["backend"],
        date=ctx["date"],
        settings=_mapping(ctx.get("settings", {}), source, "context.settings"),
    )
    _check_thresholds(context.settings, source)
    _check_chunks(context.settings, source)
    _check_model(context.settings, source)
    if topo is not None:
        _check_topology(topo_data, topo, source)
    sc = _mapping(data.get("scales"), source, "scales")
    scales = tuple(
        _number(sc, k, source, "scales", positive=True)
        for k in ("payload_ref_bytes", "rho_scale", "kappa_scale")
    )
    raw = data.get("anchors")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _fail(source, "anchors", f"must be a list, got {type(raw).__name__}")
    anchors = tuple(_anchor(a, source, f"anchors[{i}]") for i, a in enumerate(raw))
    return AnchorSet(anchors=anchors, scales=scales, context=context)  # type: ignore[arg-type]


def load_anchors(path: str | os.PathLike, topo: RailTopology | None) -> AnchorSet:
    """Read an anchors YAML file calibrated for ``topo``.

    Raises:
        FileNotFoundError: the file does not exist (``selector_from_config`` turns this into
            "always JOINT" with one warning).
        ValueError: malformed file (the message names the field) or another topology.
    """
    path = Path(path)
    data = read_yaml(path, "anchors file")
    return anchors_from_dict(data, source=repr(str(path)), topo=topo)


def save_anchors(anchor_set: AnchorSet, path: str | os.PathLike) -> Path:
    """Write ``anchor_set`` as YAML (directories created); returns the path.

    Written next to the target and renamed over it (``os.replace``), so a reader, or a process
    killed mid-write, never leaves half a file in place of a good one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(anchor_set.to_dict(), sort_keys=False, default_flow_style=None)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
