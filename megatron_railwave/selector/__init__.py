"""Path selection per layer.

``policies``: a fixed path, the calibrated nearest-anchor rule, or the calibrated RAIL / JOINT
path model, built from the user config (``selector_from_config``). ``anchors``: the anchors file
(``railwave calibrate`` writes it). ``path_model`` and ``arrivals``: the RAIL / JOINT estimate an
anchors file may carry. Every selector sees only global data, so every rank picks the same path.
"""

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
    posts_fewer_phases,
    select_for_layer,
    selector_from_config,
)

__all__ = ["PathSelector", "FixedSelector", "AnchorSelector", "ModelSelector", "Selection", "selector_from_config",
           "select_for_layer", "needs_delivery", "needs_descriptors",
           "fallback_phases_of", "fewer_phases", "posts_fewer_phases"]
