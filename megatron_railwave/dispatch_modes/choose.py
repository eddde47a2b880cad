"""The layer's selector and dispatch mode, chosen once, at the dispatcher's construction."""

from __future__ import annotations

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.dispatch_modes.base import DispatchMode
from megatron_railwave.dispatch_modes.capacity import CapacityMode, OnlineCapacityMode
from megatron_railwave.dispatch_modes.counted import CountedMode
from megatron_railwave.dispatch_modes.online import OnlineMode
from megatron_railwave.process import global_rank
from megatron_railwave.selector import (
    FixedSelector,
    OnlineSelector,
    PathSelector,
    selector_from_config,
)
from megatron_railwave.selector.learned import save_learned_paths_at_exit
from megatron_railwave.topology import RailTopology

__all__ = ["choose_dispatch_mode"]


def choose_dispatch_mode(
    railwave: RailWaveConfig,
    topology: RailTopology,
    *,
    selector: PathSelector | None,
    num_local_experts: int,
) -> DispatchMode:
    """The mode of one MoE layer, from the config (the same on every rank): without
    ``max_tokens_per_rank``, ``CountedMode`` (a fixed path or a caller's selector) or
    ``OnlineMode`` (the online selector, ``path: auto``); with it, ``CapacityMode`` or
    ``OnlineCapacityMode``.

    Args:
        railwave: the RailWave configuration.
        topology: the EP group's rail topology.
        selector: the selector for ``path: auto`` (None: the config's online selector,
            ``selector_from_config``). Ignored for a fixed path.
        num_local_experts: E_loc (the fixed-capacity rows per expert).
    """
    if railwave.path == "auto":
        if selector is None:
            selector = selector_from_config(railwave, topology)
        if isinstance(selector, OnlineSelector) and railwave.online_out and global_rank() == 0:
            save_learned_paths_at_exit(railwave.online_out, topology)
    else:
        selector = FixedSelector(railwave.path)
    online = isinstance(selector, OnlineSelector)
    capacity = railwave.max_tokens_per_rank
    if capacity is None:
        return OnlineMode(selector, topology) if online else CountedMode(selector, topology)
    mode = OnlineCapacityMode if online else CapacityMode
    return mode(selector, topology, capacity=capacity, num_local_experts=num_local_experts)
