"""Path selection per layer: a fixed path, or the calibrated nearest-anchor rule.

The selector sees only global descriptors (identical on every rank), so every rank picks the
same path. Anchors and the full calibrated rule live in ``selector_anchors`` (see docs).
"""

from __future__ import annotations

from typing import Protocol

import warnings

from .planner import Path, parse_path
from .topology import RailTopology
from .traffic import TrafficStats

__all__ = ["PathSelector", "FixedSelector", "selector_from_config"]


class PathSelector(Protocol):
    def select(self, stats: TrafficStats) -> Path:
        """The path for a phase with these (global) descriptors."""
        ...


class FixedSelector:
    """Always the same path."""

    def __init__(self, path: Path | str) -> None:
        self.path = parse_path(path)

    def select(self, stats: TrafficStats) -> Path:
        return self.path


def selector_from_config(config: "RailWaveConfig", topo: RailTopology) -> PathSelector:  # noqa: F821
    """The selector for ``path='auto'``: the calibrated anchors, or JOINT when there are none."""
    if config.anchors is None:
        warnings.warn("railwave path 'auto' without an anchors file: every layer runs JOINT "
                      "(run `railwave calibrate` to create anchors)", stacklevel=2)
        return FixedSelector(Path.JOINT)
    raise NotImplementedError("anchor-based selection is not wired yet")
