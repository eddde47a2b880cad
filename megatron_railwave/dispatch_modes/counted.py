"""The counted mode: every call gathers the global counts, then the configured selector decides.

For a fixed ``path`` (``FixedSelector``) and for a ``PathSelector`` a caller passes. Per call:
the count exchange (the layer's one host sync; with every rank's copies per destination GPU where
a min-max plan reads them), the path from global data (the same on every rank; a recompute
replays its forward's path), the plan at the call's rotation phase, the prepare, then the
dispatcher's shared tail.
"""

from __future__ import annotations

import time

import torch

from megatron_railwave.dispatch_modes.base import (
    DispatchInputs,
    DispatchMode,
    MoveTail,
    plans_min_max,
)
from megatron_railwave.names import Route
from megatron_railwave.selector import FixedSelector, PathSelector
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology

__all__ = ["CountedMode"]


class CountedMode(DispatchMode):
    """The count exchange, then the configured selector's ``select``.

    Args:
        selector: a ``PathSelector`` (``FixedSelector`` for a fixed path).
        topology: the EP group's rail topology.
    """

    def __init__(self, selector: PathSelector, topology: RailTopology) -> None:
        super().__init__(selector)
        self.topology = topology

    def token_dispatch(
        self, inputs: DispatchInputs, move: MoveTail
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: yes (EP group, the count exchange). Host sync: yes (one, the counts)."""
        state, exchange = inputs.state, inputs.exchange
        call = state.call
        layer = exchange.gather_demand(
            inputs.hidden_states,
            inputs.probs,
            inputs.routing_map,
            expert_loads=state.wants_stats,
            delivery_counts=plans_min_max(self.selector, call.path),
        )
        t0 = time.perf_counter()
        record_bytes = inputs.record_bytes
        # Only the descriptors the decision reads are computed here, on the critical path; those of
        # the statistics wait until the dispatch is posted (the dispatcher's _move).
        descr = None
        if call.path is not None:
            path: Route = call.path
        elif isinstance(self.selector, FixedSelector):
            path = self.selector.path
        else:
            descr = demand_stats(layer.demand, self.topology, record_bytes=record_bytes)
            path = self.selector.select(descr)
        plan = exchange.plan(layer, path, phase=call.phase)
        handle = exchange.prepare(layer, plan, inputs.hidden_states, inputs.probs)
        return move(
            inputs,
            path=path,
            handle=handle,
            descr=descr if descr is not None else layer.demand,
            plan_ms=(time.perf_counter() - t0) * 1e3,
            expert_loads=layer.expert_load_E,
        )
