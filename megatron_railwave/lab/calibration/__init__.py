"""Calibration of the selector anchors and their validation on unseen requests.

A *backend* times one path on one replay request (``MeasureBackend.measure``); everything else
(warm-ups, interleaving, medians, the keep rule, validation) is backend-independent, so a new
backend is one class with a ``measure`` method. The only backend is ``netmodel`` (the flow model);
a backend that times real exchanges does not exist yet.

Modules, each importing only those above it:

- ``requests``: ``ReplayRequest`` and the request generators (calibration and held-out sets).
- ``backend``: ``MeasureBackend``, ``NetmodelBackend``, ``make_backend``, ``path_costs``.
- ``profiling``: profiling on the four paths, the keep rule (its docstring), ``CalibrationRow`` /
  ``CalibrationResult``, ``calibrate``, ``merge_results``, ``result_from_json``, ``with_features``.
- ``tuning``: ``tune_selector`` (anchor thresholds, split fallback, path model) and its payload
gates; ``with_selector_settings`` (the tuned anchors file).
- ``validation``: ``ValidationRow`` / ``ValidationResult``, ``validate``, ``rescore``,
  ``bench_selector`` (a decision's host cost), ``validation_model``.

Every public name is re-exported here (``from megatron_railwave.lab import calibration;
calibration.calibrate(...)``); a test that replaces a name an internal caller uses patches the
module that owns it.
"""

from megatron_railwave.lab.calibration.backend import (
    BACKENDS,
    MeasureBackend,
    NetmodelBackend,
    make_backend,
    path_costs,
)
from megatron_railwave.lab.calibration.profiling import (
    ALL_PATHS,
    CalibrationResult,
    CalibrationRow,
    calibrate,
    keep_anchor,
    merge_results,
    profile_request,
    result_from_json,
    summarize,
    with_features,
)
from megatron_railwave.lab.calibration.requests import (
    ARRANGEMENTS,
    ReplayRequest,
    calibration_requests,
    check_held_out,
    glm_requests,
    glm_seeds,
    held_out_settings,
    request_features,
    request_group,
    request_plan,
    request_seed,
    request_stats,
    request_windows,
    synthetic_requests,
    token_counts,
    validation_requests,
)
from megatron_railwave.lab.calibration.tuning import (
    PAYLOAD_GATE_MARGIN,
    PAYLOAD_GATINGS,
    SELECTOR_GRID,
    choose_gating,
    payload_gate,
    payload_gates,
    score_path_model,
    tune_selector,
    with_selector_settings,
)
from megatron_railwave.lab.calibration.validation import (
    MAX_RATIO_TO_BEST,
    PASS_EXCHANGES,
    ValidationResult,
    ValidationRow,
    bench_selector,
    count_path_changes,
    rescore,
    validate,
    validation_model,
)

__all__ = [
    "ALL_PATHS",
    "ARRANGEMENTS",
    "BACKENDS",
    "CalibrationResult",
    "CalibrationRow",
    "MAX_RATIO_TO_BEST",
    "MeasureBackend",
    "NetmodelBackend",
    "PASS_EXCHANGES",
    "PAYLOAD_GATE_MARGIN",
    "PAYLOAD_GATINGS",
    "ReplayRequest",
    "SELECTOR_GRID",
    "ValidationResult",
    "ValidationRow",
    "bench_selector",
    "calibrate",
    "calibration_requests",
    "check_held_out",
    "choose_gating",
    "count_path_changes",
    "glm_requests",
    "glm_seeds",
    "held_out_settings",
    "keep_anchor",
    "make_backend",
    "merge_results",
    "path_costs",
    "payload_gate",
    "payload_gates",
    "profile_request",
    "request_features",
    "request_group",
    "request_plan",
    "request_seed",
    "request_stats",
    "request_windows",
    "rescore",
    "result_from_json",
    "score_path_model",
    "summarize",
    "synthetic_requests",
    "token_counts",
    "tune_selector",
    "validate",
    "validation_model",
    "validation_requests",
    "with_features",
    "with_selector_settings",
]
