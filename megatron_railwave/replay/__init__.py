"""Replay workloads: synthetic GLM-4.5-Air routing, sending arrangements, and the routing traces
that training captures.

Letters: W ranks (N nodes x G GPUs), T tokens per rank, K top-k, E experts.

The trace format, the recorder and the routing conversions are runtime code and live in
``megatron_railwave.capture``; they are re-exported here because every replay tool reads traces.
"""

from ..capture import (
    NO_EXPERT,
    TRACE_FORMAT,
    TRACE_VERSION,
    LayerTrace,
    Trace,
    TraceFormatError,
    TraceMeta,
    TraceRecorder,
    check_topology,
    demand_from_topk_ids,
    merge_captures,
    read_trace,
    routing_map_from_topk_ids,
    step_dir,
    topk_ids_from_routing_map,
    write_trace,
)
from .arrangements import (
    ArrangeMode,
    Pattern,
    arrange,
    arrange_topk_ids,
    arrange_trace,
    arrangement_schedule,
    window_peaks,
)
from .glm import GLM45_AIR, GlmAirWorkload, ModelSpec, glm_air_demands, glm_air_layer_ids, glm_air_trace
from .synthetic import sample_topk_ids, synthetic_routing_maps, synthetic_topk_ids

__all__ = [
    "ArrangeMode",
    "Pattern",
    "arrange",
    "arrange_topk_ids",
    "arrange_trace",
    "arrangement_schedule",
    "window_peaks",
    "TraceRecorder",
    "merge_captures",
    "step_dir",
    "GLM45_AIR",
    "GlmAirWorkload",
    "ModelSpec",
    "glm_air_demands",
    "glm_air_layer_ids",
    "glm_air_trace",
    "NO_EXPERT",
    "demand_from_topk_ids",
    "routing_map_from_topk_ids",
    "topk_ids_from_routing_map",
    "sample_topk_ids",
    "synthetic_routing_maps",
    "synthetic_topk_ids",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "LayerTrace",
    "Trace",
    "TraceFormatError",
    "TraceMeta",
    "check_topology",
    "read_trace",
    "write_trace",
]
