"""The selector of a layer from the user config: a fixed path, or the online selector.

A selector sees only global data, identical on every rank, so every rank picks the same path for
the same layer call. ``PathSelector`` is the interface a caller may also implement and pass to the
dispatcher (``RailWaveTokenDispatcher(selector=...)``): it decides from the gathered descriptors
(``stats.demand_stats``) alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from megatron_railwave.names import Route, parse_route
from megatron_railwave.selector.online import PROCESS_SHARED, OnlineSelector
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import SelectorScales, TrafficStats

if TYPE_CHECKING:
    from megatron_railwave.config import RailWaveConfig

__all__ = ["PathSelector", "FixedSelector", "selector_from_config"]


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


def selector_from_config(
    config: RailWaveConfig, topo: RailTopology
) -> FixedSelector | OnlineSelector:
    """The layer's selector: ``FixedSelector`` for a fixed ``path``; for ``path: auto`` a new
    ``OnlineSelector`` (one per layer: it keeps that layer's measurements; the layers of one
    process share what they timed, ``PROCESS_SHARED``), in the normal and the fixed-capacity mode
    alike."""
    if config.selector_kind() == "fixed":
        return FixedSelector(config.path)
    return OnlineSelector(
        config.online, scales=SelectorScales().resolve(topo), shared=PROCESS_SHARED
    )
