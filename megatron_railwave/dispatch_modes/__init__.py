"""How a RailWave MoE layer's calls choose their path and prepare the exchange: one mode object
per layer, chosen once from the config (``choose_dispatch_mode``), behind Megatron's six
dispatcher hooks (``dispatcher.RailWaveTokenDispatcher``, which keeps the per-call state and the
shared tail: replay memory, capture, the dispatch, statistics).

``counted``: the count exchange, then a fixed path or a caller's ``PathSelector`` (``CountedMode``).
``online``: the count exchange carrying the previous call's time, then the online selector
(``OnlineMode``). ``capacity``: fixed capacity, no count exchange; the path selected once
(``CapacityMode``) or once per epoch of calls by the online selector (``OnlineCapacityMode``).
``base``: the per-call records and the mode interface. The modes are siblings: none imports
another.
"""

from megatron_railwave.dispatch_modes.base import (
    DispatchInputs,
    DispatchMode,
    LayerCall,
    LayerState,
    MoveTail,
)
from megatron_railwave.dispatch_modes.capacity import CapacityMode, OnlineCapacityMode
from megatron_railwave.dispatch_modes.choose import choose_dispatch_mode
from megatron_railwave.dispatch_modes.counted import CountedMode
from megatron_railwave.dispatch_modes.online import OnlineMode

__all__ = [
    "DispatchMode",
    "DispatchInputs",
    "LayerCall",
    "LayerState",
    "MoveTail",
    "CountedMode",
    "OnlineMode",
    "CapacityMode",
    "OnlineCapacityMode",
    "choose_dispatch_mode",
]
