"""Replay workloads: routing traces, capture, synthetic GLM-4.5-Air routing, sending arrangements.

Letters: W ranks (N nodes x G GPUs), T tokens per rank, K top-k, E experts.
"""

from .arrangements import (
    ArrangeMode,
    Pattern,
    arrange,
    arrange_topk_ids,
    arrange_trace,
    arrangement_schedule,
    window_peaks,
)
from .capture import TraceRecorder, merge_captures, step_dir
from .glm import GLM45_AIR, GlmAirWorkload, ModelSpec, glm_air_demands, glm_air_layer_ids, glm_air_trace
from .routing import NO_EXPERT, demand_from_topk_ids, routing_map_from_topk_ids, topk_ids_from_routing_map
from .synthetic import sample_topk_ids, synthetic_routing_maps, synthetic_topk_ids
from .trace import (
    TRACE_FORMAT,
    TRACE_VERSION,
    LayerTrace,
    Trace,
    TraceFormatError,
    TraceMeta,
    check_topology,
    read_trace,
    write_trace,
)

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
