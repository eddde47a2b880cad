"""Path selection per layer.

``policies``: a fixed path, the calibrated nearest-anchor rule, the calibrated RAIL / JOINT
path model, or the online selector, built from the user config (``selector_from_config``).
``online``: the online selector (each layer probes the paths and runs the fastest it measured).
``anchors``: the anchors file (``railwave calibrate`` writes it). ``path_model`` and ``arrivals``:
the RAIL / JOINT estimate an anchors file may carry. Every selector sees only global data, so every
rank picks the same path.
"""

from megatron_railwave.selector.online import (
    OnlineDecision,
    OnlineSelector,
    fast_descriptors,
    learned_anchor_set,
)
from megatron_railwave.selector.policies import (
    AnchorSelector,
    FixedSelector,
    ModelSelector,
    PathSelector,
    Selection,
    fallback_phases_of,
    fewer_phases,
    needs_delivery,
    needs_descriptors,
    plans_min_max,
    posts_fewer_phases,
    select_for_layer,
    selector_from_config,
)

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
    "OnlineSelector",
    "OnlineDecision",
    "fast_descriptors",
    "learned_anchor_set",
]
