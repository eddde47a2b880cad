"""The online mode (``selector: online``): the previous call's time rides on the count exchange.

Each layer call is timed (plan + dispatch, and combine: stopwatches, CUDA events read at the
layer's next call with ``query()``, never a wait; the CPU clock on CPU). That time goes into this
rank's status word of the next call's count exchange (every row carries one: no extra bytes), so
every rank files the slowest rank's time and takes the same decision from the gathered
descriptors (``selector.online``). A recompute replays its forward's path and is not timed:
torch's default checkpoint (non-reentrant, early stop) ends the recompute once the tensors the
backward needs are back, before the combine, so its stopwatches would never stop (a "missing"
time on every rank at the next call); its count exchange still carries the previous call's word.
"""

from __future__ import annotations

import time

import torch

from megatron_railwave.dispatch_modes.base import (
    DispatchInputs,
    DispatchMode,
    LayerState,
    MoveTail,
    log_once_per_job,
    plans_min_max,
)
from megatron_railwave.names import Route
from megatron_railwave.selector import OnlineSelector
from megatron_railwave.selector.online import encode_timing, fast_descriptors
from megatron_railwave.steps import PassKind
from megatron_railwave.telemetry.stats import Stopwatch
from megatron_railwave.topology import RailTopology

__all__ = ["OnlineMode"]


class OnlineMode(DispatchMode):
    """The count exchange with the timing word, then ``observe`` / ``decide``.

    Args:
        selector: the layer's online selector.
        topology: the EP group's rail topology.
    """

    selector: OnlineSelector

    def __init__(self, selector: OnlineSelector, topology: RailTopology) -> None:
        super().__init__(selector)
        self.topology = topology
        self._previous_timers: list[Stopwatch] = []
        """The stopwatches of this layer's previous call (its timing word)."""

    def token_dispatch(
        self, inputs: DispatchInputs, move: MoveTail
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: yes (EP group, the count exchange). Host sync: yes (one, the counts)."""
        selector, state, exchange = self.selector, inputs.state, inputs.exchange
        hidden_states = inputs.hidden_states
        if selector.layer is None:
            selector.layer = inputs.layer_number
        seconds = None
        timers = self._previous_timers
        if timers and all(t.ready() for t in timers):  # no wait: query() only
            seconds = sum(t.elapsed_ms() for t in timers) * 1e-3
        word = encode_timing(seconds, expected=selector.expects_timing())
        self._previous_timers = []
        layer = exchange.gather_demand(
            hidden_states,
            inputs.probs,
            inputs.routing_map,
            expert_loads=state.wants_stats,
            delivery_counts=plans_min_max(selector, state.call.path),
            timing_word=word,
        )
        t0 = time.perf_counter()
        log_once_per_job(selector.observe(layer.timing_W))
        call = state.call
        recompute = call.kind == PassKind.RECOMPUTE
        if recompute:  # its forward's path (JOINT if none was remembered): no descriptors needed
            decision = selector.replay(call.path or Route.JOINT)
        else:
            descr = fast_descriptors(
                layer.demand.records_WN,
                self.topology,
                record_bytes=inputs.record_bytes,
                scales=selector.scales,
            )
            decision = selector.decide(str(call.kind), descr)
        if not recompute:  # a recompute is not timed (module docstring)
            state.exchange_timers.append(Stopwatch(hidden_states.device))
        # A '+streamed' candidate streams its relay; the others plan as the config says
        # (``streamed``). A recompute replays the forward's route only: every candidate gives
        # the same results bit for bit, and a recompute is not timed.
        plan = exchange.plan(
            layer, decision.path, phase=call.phase, streamed=True if decision.streamed else None
        )
        handle = exchange.prepare(layer, plan, hidden_states, inputs.probs)
        out = move(
            inputs,
            path=decision.path,
            handle=handle,
            descr=layer.demand,
            plan_ms=(time.perf_counter() - t0) * 1e3,
            expert_loads=layer.expert_load_E,
        )
        if state.stats is not None:
            state.stats.set_online(selector.snapshot(decision))
        return out

    def combine_done(self, state: LayerState) -> None:
        """Keep this call's stopwatches: the next call's timing word reads them."""
        self._previous_timers = state.exchange_timers
