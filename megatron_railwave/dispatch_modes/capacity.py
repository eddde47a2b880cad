"""The fixed-capacity modes (``max_tokens_per_rank`` = C): no count exchange, no host sync.

Every call prepares the capacity layout (``Exchange.prepare_capacity``): the entries
come in the padded layout [E_loc * W * C, H], and the experts get W * C rows per expert as a
constant CPU tensor. Megatron's experts call ``tokens_per_expert.tolist()``, which on the
exchange's device counts would be a host sync; on the constant it is not, and the padding rows
(zero tokens, zero probs) cost expert compute instead. The true counts stay on the device
(``dispatched.tokens_per_expert``). The statistics describe the capacity plan (the bytes that
move); expert loads are not gathered.

``CapacityMode`` (a fixed path, or a ``PathSelector`` a caller passes): the path is selected
once, from the capacity demand's descriptors (the same at every call); no host sync at all.
``OnlineCapacityMode`` (``path: auto``): one path per epoch of
``online.capacity_sync_every`` calls, its time on a small asynchronous all-reduce read an epoch
later (the mode's one host wait; ``selector.capacity_epochs``, ``exchange.timing_reduce``).
Recomputes replay their forward's path, untimed.
"""

from __future__ import annotations

import time

import torch

from megatron_railwave.config import streamed_candidates_in_fixed_capacity
from megatron_railwave.dispatch_modes.base import (
    DispatchInputs,
    DispatchMode,
    MoveTail,
    log_once_per_job,
)
from megatron_railwave.exchange import DispatchOutput, capacity_demand
from megatron_railwave.names import Route
from megatron_railwave.selector import FixedSelector, OnlineSelector, PathSelector
from megatron_railwave.selector.capacity_epochs import CapacityEpochs
from megatron_railwave.selector.online import fast_descriptors
from megatron_railwave.steps import PassKind
from megatron_railwave.telemetry.stats import Stopwatch, demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import TrafficStats

__all__ = ["CapacityMode", "OnlineCapacityMode"]


class _FixedCapacity(DispatchMode):
    """What both fixed-capacity modes share: the capacity, the constant rows per expert and the
    capacity demand's descriptors (computed once, at the first call that needs them).

    Args:
        selector: the layer's path selector.
        topology: the EP group's rail topology (W = ``topology.world_size`` ranks).
        capacity: C, ``max_tokens_per_rank``.
        num_local_experts: E_loc.
    """

    def __init__(
        self,
        selector: PathSelector | OnlineSelector,
        topology: RailTopology,
        *,
        capacity: int,
        num_local_experts: int,
    ) -> None:
        super().__init__(selector)
        self.topology = topology
        self.capacity = capacity
        self.num_local_experts = num_local_experts
        self._descr: TrafficStats | None = None
        """The capacity demand's descriptors (the same every layer call)."""
        self._rows: torch.Tensor | None = None

    def tokens_per_expert(self, dispatched: DispatchOutput) -> torch.Tensor:
        """The padded layout's W * C rows per expert: [E_loc] int64 on CPU, a constant (no
        sync)."""
        if self._rows is None:
            # Outside inference mode: a cache made in a first call under torch.inference_mode()
            # would be an inference tensor for every later training forward.
            with torch.inference_mode(False):
                self._rows = torch.full(
                    (self.num_local_experts,),
                    self.topology.world_size * self.capacity,
                    dtype=torch.int64,
                )
        return self._rows


class CapacityMode(_FixedCapacity):
    """Fixed capacity with a fixed path or a caller's ``PathSelector``: the path is selected
    once."""

    def __init__(
        self,
        selector: PathSelector,
        topology: RailTopology,
        *,
        capacity: int,
        num_local_experts: int,
    ) -> None:
        super().__init__(selector, topology, capacity=capacity, num_local_experts=num_local_experts)
        self._path: Route | None = None
        """The path of every call (a recompute's is its forward's)."""

    def token_dispatch(
        self, inputs: DispatchInputs, move: MoveTail
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: yes (EP group, the dispatch). Host sync: no."""
        state, call = inputs.state, inputs.state.call
        t0 = time.perf_counter()
        record_bytes = inputs.record_bytes
        selecting = not isinstance(self.selector, FixedSelector)
        if self._descr is None and (state.wants_stats or selecting):
            demand = capacity_demand(self.topology, self.capacity)
            self._descr = demand_stats(demand, self.topology, record_bytes=record_bytes)
            if selecting:
                self._path = self.selector.select(self._descr)
        if self._path is None:
            self._path = self.selector.select(self._descr)
        path = call.path if call.path is not None else self._path
        handle = inputs.exchange.prepare_capacity(
            inputs.hidden_states, inputs.probs, inputs.routing_map, path
        )
        return move(
            inputs,
            path=path,
            handle=handle,
            descr=self._descr,
            plan_ms=(time.perf_counter() - t0) * 1e3,
            expert_loads=None,
        )


class OnlineCapacityMode(_FixedCapacity):
    """Fixed capacity with the online selector: epochs of calls (``selector.capacity_epochs``)."""

    selector: OnlineSelector

    def __init__(
        self,
        selector: OnlineSelector,
        topology: RailTopology,
        *,
        capacity: int,
        num_local_experts: int,
    ) -> None:
        super().__init__(selector, topology, capacity=capacity, num_local_experts=num_local_experts)
        streamed = [str(c) for c in selector.candidates if c.streamed]
        if streamed:  # for direct users; a config refuses them at load
            raise ValueError(streamed_candidates_in_fixed_capacity(streamed))
        self._epochs: CapacityEpochs | None = None
        """The layer's epochs (made at its first call, with the capacity descriptors)."""

    def token_dispatch(
        self, inputs: DispatchInputs, move: MoveTail
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: at an epoch's second call (the timing reduce, asynchronous), and the
        dispatch. Host sync: at an epoch's first call after the first epoch (the reduce posted
        ``capacity_sync_every`` - 1 calls earlier)."""
        selector, state, call = self.selector, inputs.state, inputs.state.call
        device = inputs.hidden_states.device
        t0 = time.perf_counter()
        record_bytes = inputs.record_bytes
        if self._descr is None:
            demand = capacity_demand(self.topology, self.capacity)
            self._descr = demand_stats(demand, self.topology, record_bytes=record_bytes)
            self._epochs = CapacityEpochs(
                selector,
                fast_descriptors(
                    demand.records_WN.numpy(),
                    self.topology,
                    record_bytes=record_bytes,
                    scales=selector.scales,
                ),
            )
        if selector.layer is None:
            selector.layer = inputs.layer_number
        timers = None
        if call.kind == PassKind.RECOMPUTE:  # its forward's path (JOINT if none remembered)
            decision = selector.replay(call.path or Route.JOINT)
        else:
            decision, timers, message = self._epochs.begin_call(
                str(call.kind), lambda word: inputs.exchange.post_timing(word, device)
            )
            log_once_per_job(message)
        handle = inputs.exchange.prepare_capacity(
            inputs.hidden_states, inputs.probs, inputs.routing_map, decision.path
        )
        if timers is not None:
            # An epoch's first call: its dispatch and combine fill ``timers``, timed from here. A
            # path's first call builds its capacity schedule (cached for every later call): a
            # one-time cost that would count against every path the selector probes.
            state.exchange_timers = timers
            timers.append(Stopwatch(device))
        out = move(
            inputs,
            path=decision.path,
            handle=handle,
            descr=self._descr,
            plan_ms=(time.perf_counter() - t0) * 1e3,
            expert_loads=None,
        )
        if state.stats is not None:
            state.stats.set_online(selector.snapshot(decision))
        return out
