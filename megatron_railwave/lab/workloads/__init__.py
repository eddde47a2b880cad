"""Workloads: synthetic GLM-4.5-Air routing and its fit to the paper's published statistics,
sending arrangements, demand forms and payload scaling, the routing traces that training
captures, and the token skew measured on them.

Letters: W ranks (N nodes x G GPUs), T tokens per rank, K top-k, E experts.

The trace format, the recorder and the routing conversions are runtime code and live in
``megatron_railwave.telemetry.capture``; every name of its ``__all__`` is re-exported here because
every replay tool reads traces.
"""

from megatron_railwave.lab.workloads.arrangements import (
    ArrangeMode,
    Pattern,
    arrange,
    arrange_topk_ids,
    arrange_trace,
    arrangement_schedule,
    window_peaks,
)
from megatron_railwave.lab.workloads.demand import (
    SparseDemand,
    scaled_counts,
    scaled_demand,
    sparse_demand_from_topk_ids,
)
from megatron_railwave.lab.workloads.fit import (
    FIT_KNOBS,
    FIT_LAYERS,
    NIC_LAYERS,
    NIC_STEPS,
    PUBLISHED,
    LayerSample,
    Published,
    WorkloadFit,
    collect_samples,
    compare_to_published,
    expected_sample,
    fit_statistics,
    fit_workload,
    sampled_sample,
    workload_report,
    workload_statistics,
)
from megatron_railwave.lab.workloads.glm import (
    GLM45_AIR,
    PAPER_PAYLOAD_SCALE,
    GlmAirWorkload,
    ModelSpec,
    glm_air_demands,
    glm_air_layer_ids,
    glm_air_trace,
)
from megatron_railwave.lab.workloads.synthetic import (
    one_destination_topk_ids,
    sample_topk_ids,
    synthetic_routing_maps,
    synthetic_topk_ids,
)
from megatron_railwave.lab.workloads.token_skew import (
    capture_token_skew,
    read_capture_steps,
    token_skew,
    token_skew_report,
    trace_tokens_per_rank,
)
from megatron_railwave.telemetry import capture as _capture
from megatron_railwave.telemetry.capture import *  # noqa: F403 - the re-export described above

__all__ = [
    "ArrangeMode",
    "Pattern",
    "arrange",
    "arrange_topk_ids",
    "arrange_trace",
    "arrangement_schedule",
    "window_peaks",
    "SparseDemand",
    "scaled_counts",
    "scaled_demand",
    "sparse_demand_from_topk_ids",
    "FIT_KNOBS",
    "FIT_LAYERS",
    "NIC_LAYERS",
    "NIC_STEPS",
    "fit_statistics",
    "PUBLISHED",
    "LayerSample",
    "Published",
    "WorkloadFit",
    "collect_samples",
    "compare_to_published",
    "expected_sample",
    "fit_workload",
    "sampled_sample",
    "workload_report",
    "workload_statistics",
    "GLM45_AIR",
    "PAPER_PAYLOAD_SCALE",
    "GlmAirWorkload",
    "ModelSpec",
    "glm_air_demands",
    "glm_air_layer_ids",
    "glm_air_trace",
    "sample_topk_ids",
    "one_destination_topk_ids",
    "synthetic_routing_maps",
    "synthetic_topk_ids",
    "capture_token_skew",
    "read_capture_steps",
    "token_skew",
    "token_skew_report",
    "trace_tokens_per_rank",
    *_capture.__all__,
]
