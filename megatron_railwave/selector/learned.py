"""What this process's online selectors learned, as a small YAML report (the config's
``online_out``; ``railwave online-sim --learned``).

One entry per (layer, pass kind, neighbourhood) that timed a path: the neighbourhood's centre in
the selector coordinates and its descriptors, the path with the lowest median, and the median
seconds (slowest rank per call, the kept window) of every path timed there. It is a record for
people and tools; no run reads it back (each run learns from its own measurements:
docs/selector.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from megatron_railwave.selector.online import OnlineSelector, live_selectors
from megatron_railwave.topology import RailTopology

__all__ = [
    "FORMAT",
    "learned_paths",
    "write_learned_paths",
    "save_learned_paths",
    "save_learned_paths_at_exit",
]

_LOG = logging.getLogger(__name__)

FORMAT = "railwave-learned-paths/1"
"""The report's ``format`` field."""


def learned_paths(selectors: Iterable[OnlineSelector], topo: RailTopology) -> dict[str, Any]:
    """The report of what ``selectors`` measured (module docstring), as plain data."""
    selectors = list(selectors)
    entries = []
    for sel in selectors:
        for kind, nb, best, medians in sel.learned():
            entries.append(
                {
                    "layer": sel.layer,
                    "pass_kind": kind,
                    "neighbourhood": nb.index,
                    "centre": [round(float(v), 6) for v in nb.centre],
                    "B_mean_bytes": float(nb.stats.B_mean_bytes),
                    "rho_g": float(nb.stats.rho_g),
                    "kappa": float(nb.stats.kappa),
                    "best": str(best),
                    "median_s": {str(p): float(v) for p, v in medians.items()},
                }
            )
    settings = selectors[0].settings.to_dict() if selectors else None
    return {
        "format": FORMAT,
        "topology": topo.to_dict(),
        "scales": list(selectors[0].scales) if selectors else None,
        "online": settings,
        "entries": entries,
    }


def write_learned_paths(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``report`` (``learned_paths``) as YAML, atomically: a temporary file in the same
    folder (created if missing), then ``os.replace``, so a reader, or a process killed mid-write,
    never finds half a file in place of a good one. Returns the path."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(report, f, sort_keys=False)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def save_learned_paths(path: str | os.PathLike, topo: RailTopology) -> Path | None:
    """Write what this process's online selectors learned (``live_selectors``) to ``path``
    (``write_learned_paths``); returns the path, or None when nothing was learned (no live
    selector, e.g. the model was freed before interpreter exit, or no neighbourhood timed yet):
    then an existing file is left as it is, with one log line, rather than replaced by an empty
    report."""
    report = learned_paths(live_selectors(), topo)
    if not report["entries"]:
        _LOG.warning(
            "online_out=%r: nothing learned to write (no live online selector with a timed "
            "neighbourhood: was the model freed before exit?); the file is left as it is",
            str(path),
        )
        return None
    return write_learned_paths(report, path)


_AT_EXIT: set[str] = set()


def save_learned_paths_at_exit(path: str | os.PathLike, topo: RailTopology) -> None:
    """Register ``save_learned_paths`` at interpreter exit, once per path and process."""
    key = str(path)
    if key in _AT_EXIT:
        return
    _AT_EXIT.add(key)
    atexit.register(save_learned_paths, path, topo)
