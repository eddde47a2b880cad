"""``RailWaveTokenDispatcher``: the Megatron-Core glue (the six dispatcher hooks).

Letters: S sequence, B micro-batch, T = S * B tokens of this rank, E experts, E_loc local
experts, H hidden, n_ent received (token, local expert) entries.

Workflow of one MoE layer (Megatron calls the hooks in this order):
  1. ``dispatch_preprocess(tokens [S, B, H], routing_map [T, E], probs [T, E])``: flatten; keep
     the routing map. No communication.
  2. ``token_dispatch``: gather the global counts (the layer's one host sync), select the path
     from global descriptors (same on every rank), plan, compile the schedule and run its
     dispatch phases. Returns the received entries [n_ent, H] and their probs [n_ent].
  3. ``dispatch_postprocess``: hand the experts ``tokens_per_expert`` (CPU int64). No comm.
  4. ``combine_preprocess``: nothing to do (the experts applied the probs). No comm.
  5. ``token_combine``: the combine phases, reducing in a canonical order.
  6. ``combine_postprocess``: back to [S, B, H]; release the layer's state.
Megatron's six calls force per-layer state onto the dispatcher: it is kept in exactly one
attribute, ``self._state``, set in step 1 and cleared in step 6.

The process groups (node, rail and the count group) are created and warmed up in the
constructor, collectively, so the first layer call starts no group and a rank that dies later
cannot leave the others waiting in a lazy ``new_group``.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .capture import TraceMeta, TraceRecorder
from .config import RailWaveConfig
from .exchange import DispatchOutput, TorchDistExchange, build_exchange, build_rail_groups
from .planner import Path
from .selector import FixedSelector, PathSelector, selector_from_config
from .stats import LayerCommStats, Stopwatch, demand_stats, layer_comm_stats
from .traffic import dtype_bytes

__all__ = ["RailWaveTokenDispatcher", "check_supported", "flush_captures"]

StatsSink = Callable[[LayerCommStats], None]

# One trace recorder per capture directory in this process, shared by the MoE layers.
_RECORDERS: dict[str, Any] = {}


def flush_captures() -> None:
    """Write every buffered routing-trace part of this process (also runs at interpreter exit;
    call it explicitly where processes end with os._exit, e.g. multiprocessing workers)."""
    for recorder in _RECORDERS.values():
        recorder.flush()


def check_supported(config: Any) -> None:
    """Raise ``ValueError`` naming any TransformerConfig option RailWave does not support yet.

    Called at construction, on every rank, before any communication.
    """
    problems = []
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        problems.append(f"expert_tensor_parallel_size={config.expert_tensor_parallel_size} (need 1)")
    if getattr(config, "tensor_model_parallel_size", 1) != 1:
        problems.append(f"tensor_model_parallel_size={config.tensor_model_parallel_size} (need 1)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping; "
            "need None)")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        problems.append("moe_pad_expert_input_to_capacity=True (need False)")
    if getattr(config, "moe_shared_expert_overlap", False):
        problems.append("moe_shared_expert_overlap=True (need False)")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm=True (need False)")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        problems.append("fp8/fp4 training (fp8 dispatch is not implemented; need fp8=None)")
    if getattr(config, "moe_latent_size", None):
        problems.append(f"moe_latent_size={config.moe_latent_size} (need None)")
    if getattr(config, "moe_router_padding_for_quantization", False):
        problems.append("moe_router_padding_for_quantization=True (need False)")
    if problems:
        raise ValueError(
            "moe_token_dispatcher_type='railwave' does not support: " + "; ".join(problems)
            + ". Change these options or use the 'alltoall' dispatcher."
        )


def _hidden_dtype(config: Any) -> torch.dtype:
    """The dtype of the hidden states Megatron hands the dispatcher (sizes DeepEP's buffer)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return getattr(config, "params_dtype", None) or torch.float32


@dataclass(kw_only=True, slots=True)
class _LayerState:
    """Per-call state between the six hooks (cleared in combine_postprocess)."""

    hidden_shape: torch.Size
    routing_map: torch.Tensor
    dispatched: DispatchOutput | None = None
    stats: LayerCommStats | None = None
    timers: dict[str, Stopwatch] = field(default_factory=dict)


class RailWaveTokenDispatcher(MoETokenDispatcher):
    """Rail-balanced, incast-bounded token dispatcher for Megatron-Core MoE layers.

    Args:
        num_local_experts: E_loc, experts on this rank.
        local_expert_indices: their global indices (contiguous).
        config: Megatron ``TransformerConfig``.
        pg_collection: Megatron process groups (``ep`` is the expert-parallel group).
        railwave: the RailWave configuration (``megatron_railwave.install`` supplies it).
        selector: path selector for ``path='auto'``; default: the anchors file, else JOINT.
        stats_sink: called with every layer's ``LayerCommStats`` after combine.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: Any,
                 pg_collection: Any = None, *, railwave: RailWaveConfig | None = None,
                 selector: PathSelector | None = None, stats_sink: StatsSink | None = None) -> None:
        check_supported(config)
        super().__init__(config=config, pg_collection=pg_collection)
        self.railwave = railwave or RailWaveConfig()
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topology = self.railwave.topology(self.ep_size)
        expected = list(range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts))
        if self.local_expert_indices != expected:
            raise ValueError(
                f"RailWave expects contiguous expert placement: EP rank {self.ep_rank} should own "
                f"experts {expected}, got {self.local_expert_indices}"
            )
        if self.railwave.path == "auto":
            if selector is None:
                # The missing-anchors warning: once per job (global rank 0), not once per rank.
                rank0 = not dist.is_initialized() or dist.get_rank() == 0
                selector = selector_from_config(self.railwave, self.topology, warn=rank0)
            self.selector: PathSelector = selector
        else:
            self.selector = FixedSelector(self.railwave.path)
        self.stats_sink = stats_sink
        self.layer_number: int | None = None
        self._num_calls = 0
        options = self.railwave.plan_options(self.topology)
        groups = build_rail_groups(self.ep_group, self.topology, timeout_s=self.railwave.timeout_s)
        self._exchange = build_exchange(
            self.topology, groups, backend=self.railwave.backend, num_experts=self.num_experts,
            topk=int(config.moe_router_topk), hidden_size=int(config.hidden_size), hidden_dtype=_hidden_dtype(config),
            deepep_buffer=self.railwave.deepep_buffer, deepep_num_sms=self.railwave.deepep_num_sms, options=options,
            timeout_s=self.railwave.timeout_s)
        self._state: _LayerState | None = None

    # ------------------------------------------------------------------ helpers
    def _get_exchange(self) -> TorchDistExchange:
        return self._exchange

    # ------------------------------------------------------------------ the six hooks
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[S, B, H] -> [T, H]; keeps the routing map. No communication."""
        hidden_shape = tokens.shape
        self._state = _LayerState(hidden_shape=hidden_shape, routing_map=routing_map)
        self._state.timers["dispatch"] = Stopwatch(tokens.device)
        return tokens.reshape(-1, hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Gather counts, select, plan, move. Returns (entries [n_ent, H], probs [n_ent])."""
        state = self._require_state("token_dispatch")
        exchange = self._get_exchange()
        layer = exchange.gather_demand(hidden_states, probs, state.routing_map)
        t0 = time.perf_counter()
        record_bytes = hidden_states.shape[-1] * dtype_bytes(hidden_states.dtype)
        descr = demand_stats(layer.demand, self.topology, record_bytes=record_bytes)
        path: Path = self.selector.select(descr)
        plan = exchange.plan(layer, path, phase=self._num_calls)
        handle = exchange.prepare(layer, plan, hidden_states, probs)
        plan_ms = (time.perf_counter() - t0) * 1e3
        state.stats = layer_comm_stats(layer=self.layer_number or 0, step=self._num_calls, plan=plan,
                                       demand_descr=descr, record_bytes=record_bytes, plan_ms=plan_ms)
        self._capture(hidden_states, state.routing_map)
        self._num_calls += 1
        out = exchange.dispatch(hidden_states, probs, state.routing_map, handle)
        state.dispatched = out
        state.timers["dispatch"].stop()
        return out.tokens, out.probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns (tokens [n_ent, H], tokens_per_expert [E_loc] CPU int64, probs [n_ent])."""
        state = self._require_state("dispatch_postprocess")
        return hidden_states, state.dispatched.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs are already weighted by the probs. No communication."""
        state = self._require_state("combine_preprocess")
        state.timers["combine"] = Stopwatch(hidden_states.device)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Entries [n_ent, H] -> this rank's tokens [T, H] (canonical reduction order)."""
        state = self._require_state("token_combine")
        out = self._get_exchange().combine(hidden_states, state.dispatched.handle)
        state.timers["combine"].stop()
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """[T, H] -> [S, B, H]; reports the layer's statistics and clears the state."""
        state = self._require_state("combine_postprocess")
        self._state = None
        if state.stats is not None and self.stats_sink is not None:
            # CUDA times stay pending (no event sync here); sinks read them when they write.
            state.stats.set_timers(dispatch=state.timers["dispatch"], combine=state.timers["combine"])
            self.stats_sink(state.stats)
        return hidden_states.view(state.hidden_shape)

    def _capture(self, hidden_states: torch.Tensor, routing_map: torch.Tensor) -> None:
        """Record this rank's routing for replay every ``capture_interval`` calls (no comm)."""
        capture_dir = self.railwave.capture_dir
        if capture_dir is None:
            return
        recorder = _RECORDERS.get(capture_dir)
        if recorder is None:
            meta = TraceMeta(model=str(getattr(self.config, "railwave_model_name", "megatron")),
                             topology=self.topology, num_experts=self.num_experts,
                             topk=int(self.config.moe_router_topk),
                             hidden_size=int(hidden_states.shape[-1]),
                             dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(hidden_states.dtype, "fp32"))
            recorder = TraceRecorder(capture_dir, self.railwave.capture_interval, self.topology, meta)
            _RECORDERS[capture_dir] = recorder
            atexit.register(recorder.close)
        if recorder.should_capture(self._num_calls):
            recorder.record(self._num_calls, self.layer_number or 0, self.ep_rank, routing_map.cpu())

    def _require_state(self, hook: str) -> _LayerState:
        if self._state is None:
            raise RuntimeError(
                f"RailWaveTokenDispatcher.{hook} called without dispatch_preprocess: the six hooks "
                "must run in Megatron's order for every layer call"
            )
        return self._state
