"""Validation on held-out requests: the selector's choice for each against JOINT and the best
fixed path, the two goals, path changes between layers, and what a decision costs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_railwave.lab.calibration.backend import MeasureBackend
from megatron_railwave.lab.calibration.profiling import (
    _RULE_RTOL,
    ALL_PATHS,
    _progress,
    profile_request,
    summarize,
)
from megatron_railwave.lab.calibration.requests import ReplayRequest, request_stats, request_windows
from megatron_railwave.names import Route
from megatron_railwave.selector import (
    AnchorSelector,
    ModelSelector,
    Selection,
    needs_descriptors,
    select_for_layer,
)
from megatron_railwave.selector.anchors import AnchorSet
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, SelectorScales

MAX_RATIO_TO_BEST = 1.03
"""Goal: the selected path is never more than 3% slower than the best fixed path of a request."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationRow:
    """One held-out request: the selector's choice against JOINT and the best fixed path.

    ``sequence`` names the run of consecutive layers the request belongs to (same workload seed,
    T, arrangement and scale) and ``position`` its layer there; path changes are counted along it.
    ``windows``: the sending windows of the request's input (1: all node pairs at once, the input
    the dispatcher sends; more: a replay arrangement, ``request_windows``).
    """

    request: str
    coords: tuple[float, float, float]
    selected: Route
    anchor: str | None
    median_s: dict[Route, float]
    best: Route
    sequence: str = ""
    position: int = 0
    windows: int = 1

    @property
    def selected_s(self) -> float:
        return self.median_s[self.selected]

    @property
    def joint_s(self) -> float:
        return self.median_s[Route.JOINT]

    @property
    def best_s(self) -> float:
        return self.median_s[self.best]

    @property
    def ratio_to_best(self) -> float:
        return self.selected_s / self.best_s if self.best_s > 0 else 1.0

    @property
    def gain_vs_joint(self) -> float:
        """1 - selected / JOINT (positive: the selection is faster than JOINT)."""
        return 1.0 - self.selected_s / self.joint_s if self.joint_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "sequence": self.sequence,
            "position": self.position,
            "windows": self.windows,
            "coords": list(self.coords),
            "selected": str(self.selected),
            "anchor": self.anchor,
            "selected_s": self.selected_s,
            "joint_s": self.joint_s,
            "best_path": str(self.best),
            "best_s": self.best_s,
            "ratio_to_best": self.ratio_to_best,
            "within_goal": self.ratio_to_best <= MAX_RATIO_TO_BEST * (1.0 + _RULE_RTOL),
            "gain_vs_joint": self.gain_vs_joint,
            "median_s": {str(p): v for p, v in self.median_s.items()},
        }


def count_path_changes(rows: Sequence[ValidationRow]) -> dict[str, int]:
    """Per sequence, how often the selected path changes between consecutive layers (rows are
    ordered by position within each sequence here, whatever order they come in)."""
    by_seq: dict[str, list[ValidationRow]] = {}
    for r in rows:
        by_seq.setdefault(r.sequence, []).append(r)
    out = {}
    for seq, seq_rows in by_seq.items():
        paths = [r.selected for r in sorted(seq_rows, key=lambda r: r.position)]
        out[seq] = sum(a != b for a, b in zip(paths, paths[1:]))
    return out


PASS_EXCHANGES: dict[str, int] = {"forward only": 1, "training": 2, "training with recompute": 3}
"""Layer exchanges (dispatch + combine) that run on one decision's path, per kind of layer call
(``ValidationResult.with_decision_cost``): a forward alone (inference, RL rollouts); training (the
backward runs the forward's schedule mirrored); training with activation recompute (the recompute
replays the first forward's path without deciding again)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationResult:
    rows: tuple[ValidationRow, ...]

    def summary(self, *, tolerance: float = MAX_RATIO_TO_BEST - 1.0) -> dict[str, Any]:
        """The two goals (every request within ``1 + tolerance`` of its best fixed path; the
        total below always-JOINT's), path changes between consecutive layers, totals."""
        non_joint = [r for r in self.rows if r.selected != Route.JOINT]
        worst = max(self.rows, key=lambda r: r.ratio_to_best) if self.rows else None
        totals = {str(p): sum(r.median_s[p] for r in self.rows) for p in ALL_PATHS}
        policy = min(totals, key=totals.get) if self.rows else str(Route.JOINT)
        selected_total = sum(r.selected_s for r in self.rows)
        oracle_total = sum(r.best_s for r in self.rows)
        over = [r for r in self.rows if r.ratio_to_best > (1.0 + tolerance) * (1.0 + _RULE_RTOL)]
        changes = count_path_changes(self.rows)
        joint_total = totals[str(Route.JOINT)]
        goal_best = bool(self.rows) and not over
        goal_joint = bool(self.rows) and selected_total < joint_total
        return {
            "num_requests": len(self.rows),
            "num_sequences": len(changes),
            "num_path_changes": sum(changes.values()),
            "path_changes_per_sequence": changes,
            "num_not_joint": len(non_joint),
            "num_fallback_joint": len(self.rows) - len(non_joint),
            "selected_paths": {str(p): sum(r.selected == p for r in self.rows) for p in ALL_PATHS},
            "best_paths": {str(p): sum(r.best == p for r in self.rows) for p in ALL_PATHS},
            "not_joint_gains_vs_joint": [r.gain_vs_joint for r in non_joint],
            "worst_ratio_to_best": worst.ratio_to_best if worst else 1.0,
            "worst_request": worst.request if worst else None,
            "num_over_tolerance": len(over),
            "over_tolerance_requests": [r.request for r in over],
            "tolerance": tolerance,
            "num_best_not_joint": sum(r.best != Route.JOINT for r in self.rows),
            "total_selected_s": selected_total,
            "total_best_per_request_s": oracle_total,
            "total_fixed_s": totals,
            "best_fixed_policy": policy,
            "selected_vs_best_policy": selected_total / totals[policy]
            if self.rows and totals[policy] > 0
            else 1.0,
            "selected_vs_joint_policy": selected_total / joint_total
            if self.rows and joint_total > 0
            else 1.0,
            "goals": {
                "within_tolerance_of_best_on_every_request": goal_best,
                "total_beats_always_joint": goal_joint,
                "all_met": goal_best and goal_joint,
            },
        }

    def with_decision_cost(
        self, decision_s: float, *, exchanges_per_decision: int = 1
    ) -> dict[str, Any]:
        """The selection against always-JOINT once each layer's decision is paid for: JOINT needs
        none (its plan is built on every path), the selector ``decision_s`` host seconds per layer
        call (measured by the caller, ``railwave validate``: on the critical path, between the count
        exchange and the plan). The gain per layer of the best path per request against JOINT is
        the most any selector can save, so a decision costing more cannot pay for itself.

        Args:
            decision_s: host seconds of one decision.
            exchanges_per_decision: the layer's exchanges (a dispatch and a combine each) that run
                on one decision's path (``PASS_EXCHANGES``): 1 for a forward-only call, 2 in
                training, where the backward's combine-backward and dispatch-backward run the
                forward's schedule mirrored (``exchange.layer``: the same handle, rows of the same
                payload), 3 with activation recompute, which replays the first forward's path
                (``dispatcher``: the count exchange and the plan again, without the delivery
                counts, but no decision). Each further exchange is charged the request's modelled
                time again: the flow model times the mirrored backward as the forward (the same
                transfers and payload bytes; the backward repeats no count exchange, the same on
                every path, so no difference between paths changes).

        Returns:
            the totals with the decisions paid; ``selected_gain_s_per_layer`` and
            ``best_gain_s_per_layer`` are per decision (a layer call and the exchanges on its path).

        Raises:
            ValueError: ``decision_s`` negative or not finite; ``exchanges_per_decision`` < 1.
        """
        if not (math.isfinite(decision_s) and decision_s >= 0):
            raise ValueError(
                f"decision_s must be a finite number of seconds >= 0, got {decision_s!r}"
            )
        uses = exchanges_per_decision
        if isinstance(uses, bool) or not isinstance(uses, int) or uses < 1:
            raise ValueError(f"exchanges_per_decision must be an integer >= 1, got {uses!r}")
        totals = self.summary()
        n = totals["num_requests"]
        joint, selected = (
            uses * totals["total_fixed_s"][str(Route.JOINT)],
            uses * totals["total_selected_s"],
        )
        best = uses * totals["total_best_per_request_s"]
        with_decisions = selected + n * decision_s
        return {
            "decision_s_per_layer": decision_s,
            "exchanges_per_decision": uses,
            "num_requests": n,
            "selected_gain_s_per_layer": (joint - selected) / n if n else 0.0,
            "best_gain_s_per_layer": (joint - best) / n if n else 0.0,
            "total_selected_with_decisions_s": with_decisions,
            "selected_with_decisions_vs_joint_policy": with_decisions / joint
            if n and joint > 0
            else 1.0,
            "total_with_decisions_beats_always_joint": bool(n) and with_decisions < joint,
            "a_decision_could_pay": bool(n) and decision_s < (joint - best) / n,
        }

    def all_pairs(self) -> ValidationResult:
        """The requests whose input is sent all node pairs at once (``ValidationRow.windows`` 1):
        what the dispatcher sends on every layer call; the others are replay arrangements."""
        return ValidationResult(rows=tuple(r for r in self.rows if r.windows == 1))

    def decision_cost_by_pass(self, decision_s: float) -> dict[str, dict[str, Any]]:
        """``with_decision_cost`` on the all-pairs requests (``all_pairs``: the dispatcher's input)
        for each kind of layer call in ``PASS_EXCHANGES``."""
        dispatched = self.all_pairs()
        return {
            name: dispatched.with_decision_cost(decision_s, exchanges_per_decision=uses)
            for name, uses in PASS_EXCHANGES.items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [r.to_dict() for r in self.rows]}


def validate(
    backend: MeasureBackend,
    selector: AnchorSelector | ModelSelector,
    requests: Sequence[ReplayRequest],
    topo: RailTopology,
    *,
    scales: tuple[float, float, float] | None = None,
    warmups: int = 5,
    repeats: int = 10,
    progress: bool = True,
) -> ValidationResult:
    """Select a path for every request and time it against all four fixed paths.

    Args:
        scales: the coordinate scales reported per request (default: the anchor selector's file's,
            else the package defaults for ``topo``).
    """
    if scales is None:
        scales = (
            selector.anchor_set.scales
            if isinstance(selector, AnchorSelector)
            else AnchorSet.scales_for(topo, None)
        )
    rows = []
    per_request = len(ALL_PATHS) * (repeats + (1 if warmups else 0))
    with _progress(per_request * len(requests), "validate", progress) as bar:
        for req in requests:
            choice = _decide(selector, req, topo, scales)
            samples = profile_request(
                backend, req, warmups=warmups, repeats=repeats, on_measure=lambda: bar.update(1)
            )
            medians = {p: summarize(v).median for p, v in samples.items()}
            best = min(ALL_PATHS, key=lambda p: (medians[p], p != Route.JOINT))
            rows.append(
                ValidationRow(
                    request=req.name,
                    coords=choice.coords,
                    selected=choice.path,
                    anchor=choice.anchor,
                    median_s=medians,
                    best=best,
                    sequence=str(req.meta.get("sequence", "")),
                    position=int(req.meta.get("position", 0)),
                    windows=request_windows(req),
                )
            )
    return ValidationResult(rows=tuple(rows))


def rescore(
    result: ValidationResult,
    selector: AnchorSelector | ModelSelector,
    requests: Sequence[ReplayRequest],
    topo: RailTopology,
    *,
    scales: tuple[float, float, float],
) -> ValidationResult:
    """``result``'s requests decided by another selector, over the same measured medians (nothing
    is measured again): two rules compared side by side in one run."""
    by_name = {r.request: r for r in result.rows}
    rows = []
    for req in requests:
        row = by_name[req.name]
        choice = _decide(selector, req, topo, scales)
        rows.append(
            dataclasses.replace(
                row, coords=choice.coords, selected=choice.path, anchor=choice.anchor
            )
        )
    return ValidationResult(rows=tuple(rows))


def _decide(
    selector: AnchorSelector | ModelSelector,
    req: ReplayRequest,
    topo: RailTopology,
    scales: tuple[float, float, float],
) -> Selection:
    st = request_stats(
        req,
        topo,
        SelectorScales(payload_ref_bytes=scales[0], rho_scale=scales[1], kappa_scale=scales[2]),
    )
    if isinstance(selector, ModelSelector):
        if req.demand is None:
            raise ValueError(
                f"request {req.name!r}: the path model needs the request's target masks "
                "(ReplayRequest.demand); build the requests with glm_requests / synthetic_requests"
            )
        return selector.explain_layer(
            st, req.demand, record_bytes=req.record_bytes, windows=req.windows
        )
    return selector.explain(st, input_windows=request_windows(req))


def bench_selector(
    selector: Any, requests: list[Any], topo: Any, *, repeats: int = 200, num_anchors: int = 0
) -> dict[str, Any]:
    """Median host cost in microseconds of one layer's decision as the dispatcher pays it, and of
    the descriptors alone (``railwave validate``'s ``bench``).

    The decision: the descriptors (``stats.demand_stats``) where the selector reads them
    (``selector.needs_descriptors``), then ``selector.select_for_layer``; from the counts in the
    count exchange's form (records per rank and node, and copies per destination GPU and mask
    class, which the exchange gathers for the path model), all node pairs at once (a training
    step). Runs on one thread; median of 5 rounds, each over every request at least once
    (``repeats`` calls at least), so that layers the path model's payload gate skips count in
    their share.
    """
    gathered = [
        (
            DemandCounts(records_WN=r.demand.records_WN, delivery_WNKG=r.demand.class_copies_WNKG())
            if r.demand is not None
            else DemandCounts(records_WN=r.records_NGN.reshape(-1, r.records_NGN.shape[0])),
            r.record_bytes,
        )
        for r in requests
    ]
    reads_descriptors = needs_descriptors(selector)

    def decide(item: tuple[Any, int]) -> Any:
        demand, record_bytes = item
        descr = demand_stats(demand, topo, record_bytes=record_bytes) if reads_descriptors else None
        return select_for_layer(selector, descr, demand, record_bytes=record_bytes)

    def per_call(fn, items, n):
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                fn(items[i % len(items)])
            samples.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(samples)

    calls = max(repeats, len(gathered))
    decision_us = per_call(decide, gathered, calls)
    descr_us = per_call(
        lambda item: demand_stats(item[0], topo, record_bytes=item[1]), gathered, calls
    )
    return {
        "us_per_decision": decision_us,
        "us_per_descriptors": descr_us,
        "descriptors_in_decision": reads_descriptors,
        "num_anchors": num_anchors,
        "repeats": calls,
    }


def validation_model(
    anchor_set: AnchorSet, model: Any | None, *, anchors_path: str
) -> tuple[Any, str | None]:
    """The flow model to validate ``anchor_set`` on: ``model`` (``--model``), else the model
    recorded in the anchors file (``context.settings.model``), else the built-in defaults.

    Returns:
        (the model, None or, when ``model`` differs from the recorded one, the differing
        parameters as "name before -> after, ...": a what-if, not a validation of the file, whose
        anchors and path model were fitted on another fabric).
    """
    from megatron_railwave.lab.netmodel import NetModelConfig

    recorded = anchor_set.context.settings.get("model")
    source = f"anchors file {anchors_path!r}: context.settings.model"
    if model is None:
        return (
            NetModelConfig.from_dict(recorded, source=source)
            if isinstance(recorded, dict)
            else NetModelConfig()
        ), None
    try:
        calibrated = (
            NetModelConfig.from_dict(recorded, source=source)
            if isinstance(recorded, dict)
            else None
        )
    except ValueError:  # an older file's model with a retired field: --model replaces it anyway
        calibrated = None
    if calibrated is None or model == calibrated:
        return model, None
    before = calibrated.to_dict()
    changed = ", ".join(
        f"{k} {before.get(k)} -> {v}" for k, v in model.to_dict().items() if before.get(k) != v
    )
    return model, changed
