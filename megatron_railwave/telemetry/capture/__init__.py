"""Routing capture during training: the trace format and the recorder the dispatcher uses.

Letters: W ranks (N nodes x G GPUs), T tokens of one rank, K top-k, E experts.

This is part of the runtime (``RailWaveConfig.capture_dir``): ``recorder.TraceRecorder`` writes
every rank's routing of a captured step, ``trace`` defines the versioned on-disk format and
reads it back, ``routing`` converts between routing maps, top-k ids and demand counts. The replay
tools (``megatron_railwave.lab.workloads``) read traces through this package.
"""

from megatron_railwave.telemetry.capture.recorder import TraceRecorder, merge_captures, step_dir
from megatron_railwave.telemetry.capture.routing import (
    NO_EXPERT,
    demand_from_topk_ids,
    routing_map_from_topk_ids,
    topk_ids_from_routing_map,
)
from megatron_railwave.telemetry.capture.trace import (
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
    "TraceRecorder",
    "merge_captures",
    "step_dir",
    "NO_EXPERT",
    "demand_from_topk_ids",
    "routing_map_from_topk_ids",
    "topk_ids_from_routing_map",
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
