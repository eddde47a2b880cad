"""``RailWaveTokenDispatcher``: the Megatron-Core glue (the six dispatcher hooks).

Letters: S sequence, B micro-batch, T = S * B tokens of this rank, E experts, E_loc local
experts, H hidden, n_ent received (token, local expert) entries.

Workflow of one MoE layer (Megatron calls the hooks in this order):
  1. ``dispatch_preprocess(tokens [S, B, H], routing_map [T, E], probs [T, E])``: flatten; keep
     the routing map; classify the pass (training forward, recompute, forward-only) and its step.
     No communication.
  2. ``token_dispatch``: the layer's mode (``dispatch_modes``, chosen once at construction)
     chooses the path and prepares the layer: gather the global counts (the layer's one host
     sync), select the path from global data (same on every rank), plan and compile the
     schedule; then the shared tail (``_move``) runs the dispatch phases. Returns the received
     entries [n_ent, H] and their probs [n_ent].
  3. ``dispatch_postprocess``: hand the experts ``tokens_per_expert`` (CPU int64; the mode's).
     No comm. Fixed-capacity mode (``max_tokens_per_rank`` = C): step 2 has no count exchange
     and no host sync, the entries come in the padded layout [E_loc * W * C, H], and the experts
     get W * C rows per expert as a constant CPU tensor (``dispatch_modes.capacity``).
  4. ``combine_preprocess``: nothing to do (the experts applied the probs). No comm.
  5. ``token_combine``: the combine phases, reducing in a canonical order.
  6. ``combine_postprocess``: back to [S, B, H]; release the layer's state.
With ``moe_shared_expert_overlap`` MoELayer hands the dispatcher its shared expert
(``set_shared_experts``); step 2 posts the dispatch (``Exchange.start_dispatch``), runs
the shared expert's fc1 while the phases travel, then completes it; step 5 does the same with
fc2 and the combine; step 6 adds the shared expert's output (``exchange.pending``).
Megatron's six calls force per-layer state onto the dispatcher: it is kept in exactly one
attribute, ``self._state``, set in step 1 and cleared in step 6.

Construction (collective over the EP group, before any data moves): one all-gather of every
EP rank's facts and configuration fingerprint (``exchange.placement``): ranks that disagree on
the configuration raise one ``ConfigMismatchError`` everywhere; the EP-rank -> (node, local GPU)
map is built from hosts and GPUs, not assumed; then the node, rail and count groups are created
and warmed up, so the first layer call starts no group.

Steps and passes (``steps``): the step is Megatron's iteration (else ``steps.set_step``, else the
layer's count of training forwards). A training forward advances the plan's rotation phase; a
recompute (activation checkpointing replays the forward inside backward) replays its first
forward's phase and path and is neither logged nor captured again; a forward-only pass (eval)
uses the current phase without advancing it. Descriptors and statistics are computed only when
the selector ('auto') or a stats sink needs them.

The modes (``dispatch_modes``): ``CountedMode`` (the count exchange, then a fixed path or a
caller's ``PathSelector``), ``OnlineMode`` (``path: auto``, the online selector: each call's time
rides on the next call's count exchange), ``CapacityMode`` (fixed capacity: the path selected
once) and ``OnlineCapacityMode`` (fixed capacity with ``path: auto``: one path per epoch of calls,
timed on a small asynchronous all-reduce). Each owns what its calls share;
the dispatcher keeps the per-call state, the pass bookkeeping and the shared tail (replay
memory, capture, the dispatch with the shared expert's overlap, statistics).
"""

from __future__ import annotations

import atexit
import enum
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.dispatch_modes import (
    DispatchInputs,
    DispatchMode,
    LayerCall,
    LayerState,
    choose_dispatch_mode,
)
from megatron_railwave.exchange import (
    Exchange,
    LayerHandle,
    build_exchange,
    build_rail_groups,
    check_fingerprints,
    gather_rank_facts,
    place_ranks,
)
from megatron_railwave.names import Route
from megatron_railwave.selector import OnlineSelector, PathSelector
from megatron_railwave.steps import PassKind, current_step, pass_kind
from megatron_railwave.telemetry.capture import TraceMeta, TraceRecorder
from megatron_railwave.telemetry.stats import (
    LayerCommStats,
    Stopwatch,
    demand_stats,
    layer_comm_stats,
)
from megatron_railwave.traffic import DemandCounts, TrafficStats, dtype_bytes

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
    # Attention TP / CP / PP are folded out of the expert grid ("MoE parallel folding"): with
    # expert-TP 1 every EP rank holds its own tokens, which is all the exchange needs.
    if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
        problems.append(
            f"expert_tensor_parallel_size={config.expert_tensor_parallel_size} (need 1; expert-TP "
            "splits every expert over ranks and makes EP groups strided)"
        )
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping; "
            "need None)"
        )
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        problems.append("moe_pad_expert_input_to_capacity=True (need False)")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        problems.append("fp8/fp4 training (fp8 dispatch is not implemented; need fp8=None)")
    if getattr(config, "moe_latent_size", None):
        problems.append(f"moe_latent_size={config.moe_latent_size} (need None)")
    if getattr(config, "moe_router_padding_for_quantization", False) or getattr(
        config, "moe_router_padding_for_fp8", False
    ):
        problems.append(
            "moe_router_padding_for_quantization / moe_router_padding_for_fp8=True (need False: "
            "the "
            "padding rounds every expert's rows up to the fp8/fp4 GEMM alignment and Megatron "
            "allows it "
            "only with fp8/fp4 training, whose quantized payload RailWave does not carry)"
        )
    graphs = _graphed_moe_preprocess(config)
    if graphs:
        problems.append(
            f"{graphs} (a graph replay skips MoELayer.preprocess, and with it the dispatcher's "
            "per-call state; need cuda_graph_impl='none', or cuda_graph_modules without 'moe', "
            "'moe_preprocess' and whole-layer capture, e.g. ['attn', 'moe_router'])"
        )
    if problems:
        raise ValueError(
            "moe_token_dispatcher_type='railwave' does not support: "
            + "; ".join(problems)
            + ". Change these options or use the 'alltoall' dispatcher."
        )


def _graphed_moe_preprocess(config: Any) -> str:
    """The CUDA-graph settings under which Megatron captures the MoE preprocess (where the
    dispatcher's ``dispatch_preprocess`` runs), as text; '' when it runs eagerly."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none" and (
        getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph", False)
    ):
        impl = "local" if getattr(config, "enable_cuda_graph", False) else "transformer_engine"
    if impl == "none":
        return ""
    if impl == "full_iteration":
        return "cuda_graph_impl='full_iteration'"
    modules = getattr(config, "cuda_graph_modules", None)
    if modules is None:
        modules = getattr(config, "cuda_graph_scope", None)
    if modules is None or isinstance(modules, (str, enum.Enum)):
        modules = [] if modules in (None, "", "full") else [modules]
    names = [str(getattr(m, "name", m)) for m in modules]
    if not names or {"moe", "moe_preprocess", "full_iteration"} & set(names):
        return f"cuda_graph_impl={impl!r} with cuda_graph_modules={names or 'whole layer'}"
    return ""


def _hidden_dtype(config: Any) -> torch.dtype:
    """The dtype of the hidden states Megatron hands the dispatcher (sizes DeepEP's buffer)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return getattr(config, "params_dtype", None) or torch.float32


_REPLAY_LIMIT = 4096
"""Training forwards remembered for their recompute (per layer; cleared at each new step)."""


class RailWaveTokenDispatcher(MoETokenDispatcher):
    """Rail-balanced, incast-bounded token dispatcher for Megatron-Core MoE layers.

    Args:
        num_local_experts: E_loc, experts on this rank.
        local_expert_indices: their global indices (contiguous).
        config: Megatron ``TransformerConfig``.
        pg_collection: Megatron process groups (``ep`` is the expert-parallel group).
        railwave: the RailWave configuration (``megatron_railwave.install`` supplies it).
        selector: path selector for ``path='auto'``; default: the online selector.
        stats_sink: called with every layer's ``LayerCommStats`` after combine.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
        *,
        railwave: RailWaveConfig | None = None,
        selector: PathSelector | None = None,
        stats_sink: StatsSink | None = None,
    ) -> None:
        check_supported(config)
        super().__init__(config=config, pg_collection=pg_collection)
        # Megatron-Core 0.15 does not set ep_rank on the base dispatcher (0.19 does).
        self.ep_rank = dist.get_rank(self.ep_group) if dist.is_initialized() else 0
        self.railwave = railwave or RailWaveConfig()
        deepep_num_sms = self.railwave.deepep_num_sms_for(config)  # raises before any collective
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        expected = list(
            range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts)
        )
        if self.local_expert_indices != expected:
            raise ValueError(
                f"RailWave expects contiguous expert placement: EP rank {self.ep_rank} should own "
                f"experts {expected}, got {self.local_expert_indices}"
            )
        # Facts and fingerprints first (one all-gather on the EP group): every later check then
        # raises the same error on every rank, and a rank with another config cannot hang the rest.
        fields = self.railwave.fingerprint()
        facts = gather_rank_facts(self.ep_group, fields)
        check_fingerprints(facts, fields)
        configured = self.railwave.configured_gpus_per_node()
        if configured is not None:
            self.railwave.topology(self.ep_size)  # the config's own checks (W a multiple of G, ...)
            configured = min(configured, self.ep_size)
        self.placement = place_ranks(
            facts, gpus_per_node=configured, rail_of_gpu=self.railwave.cluster_rail_of_gpu()
        )
        self.topology = self.railwave.topology(
            self.ep_size,
            ranks_per_node=self.placement.gpus_per_node,
            rail_of_local=self.placement.rail_of_local,
        )
        self._mode: DispatchMode = choose_dispatch_mode(
            self.railwave,
            self.topology,
            selector=selector,
            num_local_experts=num_local_experts,
        )
        """How this layer's calls choose their path and prepare the exchange (``dispatch_modes``):
        the count exchange with a fixed path or a caller's selector, the online selector, or
        fixed capacity with either."""
        self.stats_sink = stats_sink
        self.layer_number: int | None = None
        self.moe_layer: Callable[[], Any] | None = None
        """Weak reference to the owning MoELayer (its ``training`` flag); set by ``install``'s
        hook."""
        options = self.railwave.plan_options(self.topology)
        groups = build_rail_groups(
            self.ep_group,
            self.topology,
            timeout_s=self.railwave.timeout_s,
            placement=self.placement,
        )
        self._exchange = build_exchange(
            self.topology,
            groups,
            backend=self.railwave.backend,
            num_experts=self.num_experts,
            topk=int(config.moe_router_topk),
            hidden_size=int(config.hidden_size),
            hidden_dtype=_hidden_dtype(config),
            deepep_num_sms=deepep_num_sms,
            options=options,
            timeout_s=self.railwave.timeout_s,
            max_tokens_per_rank=self.railwave.max_tokens_per_rank,
            streamed_candidates=bool(self.railwave.streamed_candidates),
        )
        self._columns: dict[torch.device, torch.Tensor] = {}
        self._train_forwards = 0
        self._step: int | None = None
        self._microbatch = 0
        self._forward_only_calls = 0
        self._replay: deque[LayerCall] = deque(maxlen=_REPLAY_LIMIT)
        self._state: LayerState | None = None

    @property
    def selector(self) -> PathSelector | OnlineSelector:
        """The layer's path selector (a ``FixedSelector`` for a fixed path); its mode's."""
        return self._mode.selector

    def set_moe_layer(self, layer: Any) -> None:
        """Remember the owning MoELayer (weakly), whose ``training`` flag tells eval passes
        apart."""
        self.moe_layer = weakref.ref(layer)

    # ------------------------------------------------------------------ helpers
    def _get_exchange(self) -> Exchange:
        return self._exchange

    def _training(self) -> bool:
        layer = self.moe_layer() if self.moe_layer is not None else None
        return bool(layer.training) if layer is not None else torch.is_grad_enabled()

    def _begin_call(self) -> LayerCall:
        """Classify this call and give it its step, micro-batch and phase (host only)."""
        kind = pass_kind(self._training())
        if kind == PassKind.RECOMPUTE:
            if self._replay:
                return self._replay.popleft()
            # No remembered forward (a checkpoint whose first forward did not come through here):
            # the last training forward's phase; any phase gives the same numbers.
            return LayerCall(
                kind=kind,
                step=self._step or 0,
                microbatch=self._microbatch,
                phase=max(self._train_forwards - 1, 0),
            )
        clock = current_step()
        if kind == PassKind.FORWARD_ONLY:
            step = clock if clock is not None else (self._step or 0)
            if step != self._step:
                self._step, self._microbatch, self._forward_only_calls = step, -1, 0
            call = LayerCall(
                kind=kind,
                step=step,
                microbatch=self._forward_only_calls,
                phase=self._train_forwards,
            )
            self._forward_only_calls += 1
            return call
        step = clock if clock is not None else self._train_forwards
        if step != self._step:
            self._step, self._microbatch, self._forward_only_calls = step, 0, 0
            if clock is not None:
                self._replay.clear()  # recomputes of earlier steps are done
        else:
            self._microbatch += 1
        call = LayerCall(
            kind=kind, step=step, microbatch=self._microbatch, phase=self._train_forwards
        )
        self._train_forwards += 1
        return call

    def _sink_wants(self, step: int) -> bool:
        """Whether the stats sink will take this step's record (same answer on every rank)."""
        sink = self.stats_sink
        if sink is None:
            return False
        wants = getattr(sink, "wants", None)
        return True if wants is None else bool(wants(step))

    def _to_railwave(
        self, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert columns from Megatron's EP order into railwave order ([T, E] each; device, no
        sync).

        Identity (nothing done) when the launcher numbers EP ranks node by node. A malformed input
        is passed through untouched, so that the count exchange names it.
        """
        if self.placement.identity:
            return routing_map, probs
        e = self.num_experts
        if (
            routing_map.dim() != 2
            or routing_map.shape[1] != e
            or tuple(probs.shape) != tuple(routing_map.shape)
        ):
            return routing_map, probs
        columns = self._columns.get(routing_map.device)
        if columns is None:
            # Outside inference mode: a cache made in a first call under torch.inference_mode() (an
            # eval or RL rollout before training) would be an inference tensor, which every later
            # training forward would save for backward ("Inference tensors cannot be saved").
            with torch.inference_mode(False):
                columns = self.placement.expert_columns(self.num_local_experts).to(
                    routing_map.device
                )
            self._columns[routing_map.device] = columns
        # index_select's backward scatters the probs gradient back to Megatron's columns.
        return routing_map.index_select(1, columns), probs.index_select(1, columns)

    def _schedule_owned(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, copied under the EP-overlap schedule (``overlap_moe_expert_parallel_comm``).

        That schedule frees the storage of its dispatch and mlp nodes' inputs right after their
        forward; Megatron's dispatchers hand those nodes permuted copies, while ours would hand
        views of tensors that the router and the experts saved for their backward."""
        return x.clone() if getattr(self.config, "overlap_moe_expert_parallel_comm", False) else x

    # ------------------------------------------------------------------ the six hooks
    def dispatch_preprocess(
        self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """[S, B, H] -> [T, H]; keeps the routing map. No communication."""
        hidden_shape = tokens.shape
        call = self._begin_call()
        wants = call.kind != PassKind.RECOMPUTE and self._sink_wants(call.step)
        self._state = LayerState(
            hidden_shape=hidden_shape, routing_map=routing_map, call=call, wants_stats=wants
        )
        if wants:
            self._state.timers["dispatch"] = Stopwatch(tokens.device)
        return self._schedule_owned(tokens.reshape(-1, hidden_shape[-1])), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Gather counts, select, plan, move (the mode's way; ``dispatch_modes``). Returns
        (entries [n_ent, H], probs [n_ent])."""
        state = self._require_state("token_dispatch")
        routing_map, probs = self._to_railwave(state.routing_map, probs)
        inputs = DispatchInputs(
            state=state,
            exchange=self._get_exchange(),
            hidden_states=hidden_states,
            probs=probs,
            routing_map=routing_map,
            record_bytes=hidden_states.shape[-1] * dtype_bytes(hidden_states.dtype),
            layer_number=self.layer_number,
        )
        return self._mode.token_dispatch(inputs, self._move)

    def _move(
        self,
        inputs: DispatchInputs,
        *,
        path: Route,
        handle: LayerHandle,
        descr: TrafficStats | DemandCounts | None,
        plan_ms: float,
        expert_loads: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The common tail of every mode (``dispatch_modes.MoveTail``): remember the path for
        recompute, capture, the dispatch itself, then the statistics (``descr``: the descriptors,
        or the counts they are computed from). Returns (entries [n_ent, H], probs [n_ent])."""
        state, exchange, record_bytes = inputs.state, inputs.exchange, inputs.record_bytes
        hidden_states, probs, routing_map = inputs.hidden_states, inputs.probs, inputs.routing_map
        call = state.call
        if call.kind == PassKind.TRAIN:
            self._replay.append(
                LayerCall(
                    kind=PassKind.RECOMPUTE,
                    step=call.step,
                    microbatch=call.microbatch,
                    phase=call.phase,
                    path=path,
                )
            )
            self._capture(hidden_states, routing_map, call)
        shared = self.shared_experts
        if shared is None:
            state.dispatched = exchange.dispatch(hidden_states, probs, routing_map, handle)
        else:
            # moe_shared_expert_overlap (MoELayer handed us the shared expert): its fc1 runs while
            # the dispatch phases travel, in the order of Megatron's flex dispatcher.
            pending = exchange.start_dispatch(hidden_states, probs, routing_map, handle)
            shared.pre_forward_comm(hidden_states.view(state.hidden_shape))
            shared.linear_fc1_forward_and_act()
            state.dispatched = exchange.finish_dispatch(hidden_states, probs, routing_map, pending)
        if "dispatch" in state.timers:
            state.timers["dispatch"].stop()
        if state.exchange_timers:
            state.exchange_timers[0].stop()
        if state.wants_stats:
            # After the dispatch is posted: the statistics are host work (~0.7 ms per layer at 4 x 8
            # on the development machine) that no transfer waits for.
            if isinstance(descr, DemandCounts):
                descr = demand_stats(descr, self.topology, record_bytes=record_bytes)
            state.stats = layer_comm_stats(
                layer=self.layer_number or 0,
                step=call.step,
                plan=handle.plan,
                demand_descr=descr,
                record_bytes=record_bytes,
                plan_ms=plan_ms,
                wire_row_bytes=handle.dispatch_row_bytes,
                tokens_per_expert_E=expert_loads,
                microbatch=call.microbatch,
                pass_kind=str(call.kind),
            )
        return state.dispatched.tokens, state.dispatched.probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns (tokens [n_ent, H], tokens_per_expert [E_loc] CPU int64, probs [n_ent]).

        Fixed-capacity mode: the padded layout's W * C rows per expert (a constant; no sync)."""
        state = self._require_state("dispatch_postprocess")
        hidden_states = self._schedule_owned(hidden_states)
        return hidden_states, self._mode.tokens_per_expert(state.dispatched), probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs are already weighted by the probs. No communication."""
        state = self._require_state("combine_preprocess")
        if state.wants_stats:
            state.timers["combine"] = Stopwatch(hidden_states.device)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Entries [n_ent, H] -> this rank's tokens [T, H] (canonical reduction order)."""
        state = self._require_state("token_combine")
        exchange, shared = self._get_exchange(), self.shared_experts
        if state.exchange_timers:
            state.exchange_timers.append(Stopwatch(hidden_states.device))
        if shared is None:
            out = exchange.combine(hidden_states, state.dispatched.handle)
        else:  # the shared expert's fc2 while the combine phases travel
            pending = exchange.start_combine(hidden_states, state.dispatched.handle)
            shared.linear_fc2_forward()
            shared.post_forward_comm()
            out = exchange.finish_combine(hidden_states, pending)
        if "combine" in state.timers:
            state.timers["combine"].stop()
        if state.exchange_timers:
            state.exchange_timers[-1].stop()
            self._mode.combine_done(state)
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """[T, H] -> [S, B, H]; reports the layer's statistics and clears the state."""
        state = self._require_state("combine_postprocess")
        self._state = None
        if state.stats is not None and self.stats_sink is not None:
            # CUDA times stay pending (no event sync here); sinks read them when they write.
            state.stats.set_timers(
                dispatch=state.timers["dispatch"], combine=state.timers["combine"]
            )
            self.stats_sink(state.stats)
        output = hidden_states.view(state.hidden_shape)
        if (
            self.shared_experts is not None
        ):  # computed during the exchange (token_dispatch, token_combine)
            output = output + self.shared_experts.get_output()
        return output

    def _capture(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, call: LayerCall
    ) -> None:
        """Record this rank's routing (railwave rank and expert order: what the network carries)
        for replay: the first micro-batch of every ``capture_interval``-th step (no comm)."""
        capture_dir = self.railwave.capture_dir
        if capture_dir is None or call.microbatch != 0:
            return
        recorder = _RECORDERS.get(capture_dir)
        if recorder is None:
            meta = TraceMeta(
                model=str(getattr(self.config, "railwave_model_name", "megatron")),
                topology=self.topology,
                num_experts=self.num_experts,
                topk=int(self.config.moe_router_topk),
                hidden_size=int(hidden_states.shape[-1]),
                dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
                    hidden_states.dtype, "fp32"
                ),
            )
            recorder = TraceRecorder(
                capture_dir, self.railwave.capture_interval, self.topology, meta
            )
            _RECORDERS[capture_dir] = recorder
            atexit.register(recorder.close)
        if recorder.should_capture(call.step):
            recorder.record(
                call.step, self.layer_number or 0, self._exchange.groups.railwave_rank, routing_map
            )  # an asynchronous copy: no host sync on the dispatch path

    def _require_state(self, hook: str) -> LayerState:
        if self._state is None:
            raise RuntimeError(
                f"RailWaveTokenDispatcher.{hook} called without dispatch_preprocess: the six hooks "
                "must run in Megatron's order for every layer call"
            )
        return self._state
