"""Path selection per layer.

``online``: the online selector (each layer probes the paths and runs the fastest it measured)
and the descriptors it decides from (``fast_descriptors``). ``capacity_epochs``: its variant for
the fixed-capacity mode (one decision per epoch of calls). ``policies``: a fixed path, the
``PathSelector`` interface, and the selector of a config (``selector_from_config``).
``learned``: the report of what the online selectors learned (``online_out``). Every selector sees
only global data, so every rank picks the same path.
"""

from megatron_railwave.selector.learned import learned_paths, save_learned_paths
from megatron_railwave.selector.online import OnlineDecision, OnlineSelector, fast_descriptors
from megatron_railwave.selector.policies import FixedSelector, PathSelector, selector_from_config

__all__ = [
    "PathSelector",
    "FixedSelector",
    "selector_from_config",
    "OnlineSelector",
    "OnlineDecision",
    "fast_descriptors",
    "learned_paths",
    "save_learned_paths",
]
