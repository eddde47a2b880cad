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
from megatron_railwave.selector.online import save_learned_anchors_at_exit
from megatron_railwave.topology import RailTopology

__all__ = ["choose_dispatch_mode"]


def choose_dispatch_mode(
    railwave: RailWaveConfig,
    topology: RailTopology,
    *,
    selector: PathSelector | None,
    num_local_experts: int,
    hidden_size: int,
    hidden_dtype: str,
) -> DispatchMode:
    """The mode of one MoE layer, from the config (the same on every rank): without
    ``max_tokens_per_rank``, ``CountedMode`` (a fixed path or a calibrated selector) or
    ``OnlineMode`` (the online selector); with it, ``CapacityMode`` or ``OnlineCapacityMode``.

    Args:
        railwave: the RailWave configuration.
        topology: the EP group's rail topology.
        selector: the selector for ``path: auto`` (None: the config's, ``selector_from_config``,
            which warns about a missing anchors file once per job: on global rank 0). Ignored
            for a fixed path.
        num_local_experts: E_loc (the fixed-capacity rows per expert).
        hidden_size, hidden_dtype: the hidden states' width and dtype name ('bfloat16', ...),
            recorded with the online selector's learned anchors (``online_out``).
    """
    if railwave.path == "auto":
        if selector is None:
            # The missing-anchors warning: once per job (global rank 0), not once per rank.
            selector = selector_from_config(railwave, topology, warn=global_rank() == 0)
        if isinstance(selector, OnlineSelector) and railwave.online_out and global_rank() == 0:
            save_learned_anchors_at_exit(
                railwave.online_out,
                topology,
                hidden_size=hidden_size,
                dtype=hidden_dtype,
                chunks=railwave.chunks,
            )
    else:
        selector = FixedSelector(railwave.path)
    online = isinstance(selector, OnlineSelector)
    capacity = railwave.max_tokens_per_rank
    if capacity is None:
        return OnlineMode(selector, topology) if online else CountedMode(selector, topology)
    mode = OnlineCapacityMode if online else CapacityMode
    return mode(selector, topology, capacity=capacity, num_local_experts=num_local_experts)
