"""Tuning the selector on the calibration requests alone: the anchor thresholds and the anchors
that hold (leave one seed or routing out), the split fallback, and the RAIL / JOINT path model
with its payload gates.

Letters: R requests (rows), F path-model features.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_railwave.lab.calibration.backend import path_costs
from megatron_railwave.lab.calibration.profiling import _RULE_RTOL, ALL_PATHS, CalibrationResult
from megatron_railwave.names import Route
from megatron_railwave.selector import AnchorSelector, fallback_phases_of, fewer_phases
from megatron_railwave.selector.anchors import AnchorSet
from megatron_railwave.selector.path_model import PathCosts, fit_rail_joint
from megatron_railwave.traffic import MiB

SELECTOR_GRID: dict[str, tuple[float, ...]] = {
    "payload_ratio": (1.25, 1.5, 2.0),
    "shape_distance": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
}
"""Thresholds ``tune_selector`` tries, smallest first (the paper's 1.25 and 0.02 first). The
shape distances reach 1.0: on the H800 4 x 8 calibration (16 seeds) leaving a seed out still
missed 14 requests at 0.2, the old edge of the grid, and none from 0.3 on (docs/selector.md)."""


def tune_selector(
    result: CalibrationResult,
    *,
    grid: dict[str, Sequence[float]] | None = None,
    tolerance: float = 0.03,
    split_fallback: bool = True,
    fit_model: bool = True,
) -> dict[str, Any]:
    """Pick the selector thresholds and the anchors that hold, by leaving calibration data out, on
    the calibration requests alone.

    The unit left out is what validation holds out: the generator seed (``CalibrationRow.seed``)
    when the calibration spans two or more (a held-out glm request comes from another workload
    seed, whose payload and skew levels differ for every layer, so leaving out one layer of a
    seed whose other layers stay would make every threshold look safe), else the routing
    (``CalibrationRow.group``: one layer or family).

    **Anchors must hold across units.** For a setting (payload_ratio, shape_distance), an anchor
    *holds* when, on every calibration request of another unit that the runtime rule would let it
    serve (``AnchorSelector.reach_AR``), its path is within ``1 + tolerance`` of that request's
    best path. An anchor that fails somewhere marks a region where the descriptors do not decide
    the path; it is dropped. When a unit is left out, its own requests do not count against an
    anchor (they are what is being predicted).

    For each setting of ``grid``, every calibration request is decided by the runtime rule
    (``AnchorSelector``) over the anchors of the *other* units that hold without its unit, and
    scored as ``railwave validate`` scores a held-out request: how many are more than ``1 +
    tolerance`` slower than their best path, then the total time of the choices. The setting with
    the fewest such requests, then the least total, then the smallest thresholds (the grid's order)
    wins; every setting is also scored without the rule that anchors hold (``hold_rule`` False:
    it can drop anchors that fail on one request of another unit but serve several well), and the
    rule wins ties. "No anchors" (always JOINT) is scored the same way and wins unless some setting
    is strictly better (fewer requests over, or as many and a smaller total); then ``use_anchors``
    is False and ``railwave calibrate`` writes a file without anchors (every row stays in its
    JSON). Held-out requests play no part.

    With ``split_fallback`` the fallback outside the anchors is tuned too: for every setting (and
    for "no anchors") the best payload cut x* (no cut first, then every payload level of the rows)
    below which RAIL runs instead of JOINT where it posts fewer phases
    (``AnchorSelector.fallback_below``; with rail chunks JOINT posts more phases and loses at small
    payloads whatever the shape). The cut is scored with the same leave-out decisions.

    With ``fit_model`` and features on every row (``CalibrationRow.features``) the **path model**
    (``path_model``: log(t_RAIL / t_JOINT) least squares over the features) is scored the same
    way: for each unit, fitted on the other units' rows, it decides the unit's rows (RAIL where
    it predicts RAIL faster, else JOINT), once for every payload gating (``PAYLOAD_GATINGS``: no
    gate, one gate, a gate per input kind; each gate fitted without the unit, ``payload_gates``).
    The gating with the fewest requests over, then the least total, then the fewest decided
    requests (a decision costs host time) is the model's score. When it scores strictly better
    than the chosen anchors setting (or "no anchors"), the model is fitted on every row, with
    that gating's gates from every row, and returned: the runtime then decides with it and not
    with the anchors.

    Returns:
        ``use_anchors``; ``payload_ratio``, ``shape_distance`` (the choice; without anchors the
        best setting with them, for the record); ``held`` (names of the anchors that hold under
        the choice, file order; empty without anchors); ``fallback_below`` (None or
        ``{"payload_bytes", "path"}``); ``left_out`` ('seed' or 'routing');
        ``model`` (``RailJointModel.to_dict()`` when the path model won, else None);
        ``model_score`` (the path model's score under its chosen gating, None when not scored);
        ``method`` (in words); ``scores`` (one dict per setting: thresholds, over_tolerance,
        total_s, vs_joint, anchors_held, fallback_below_bytes; the first, with thresholds None, is
        "no anchors"; the last ones, with ``model`` True, the path model's per gating, with
        ``gate`` and ``decided``, when it was scored).
    """
    grid = {**SELECTOR_GRID, **(grid or {})}
    rows = result.rows
    aset = result.anchor_set
    by_seed = len({r.seed for r in rows}) >= 2
    unit_of_row = {r.request: (r.seed if by_seed else r.group) for r in rows}
    units_R = np.array([unit_of_row[r.request] for r in rows], dtype=object)
    rows_of_unit: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        rows_of_unit.setdefault(unit_of_row[r.request], []).append(i)
    anchor_units = [unit_of_row.get(a.name, a.name) for a in aset.anchors]
    best_R = np.array([min(v.median for v in r.latency.values()) for r in rows])
    limit_R = (1.0 + tolerance) * best_R * (1.0 + _RULE_RTOL)
    lat_PR = {p: np.array([r.latency[p].median for r in rows]) for p in ALL_PATHS}
    slow_PR = {p: lat > limit_R for p, lat in lat_PR.items()}
    coords_R3 = np.array([aset.coords(r.stats) for r in rows]).reshape(len(rows), 3)
    windows_R = np.array([r.input_windows for r in rows])
    joint_total = sum(r.latency[Route.JOINT].median for r in rows)
    # The split fallback: below payload coordinate x*, outside every anchor, RAIL where it posts
    # fewer phases than JOINT (AnchorSelector.fallback_below). Candidates: no split, then every
    # payload level of the rows (0.01 apart), ascending.
    below_ok_R = fewer_phases(windows_R, fallback_phases_of(aset, Route.JOINT))
    x_R = coords_R3[:, 0]
    levels = (
        np.unique(np.round(x_R[np.isfinite(x_R)], 2)) + 0.005 if split_fallback else np.zeros(0)
    )
    cuts = np.concatenate([[-math.inf], levels])
    lat_rail_R, lat_joint_R = lat_PR[Route.RAIL], lat_PR[Route.JOINT]
    slow_rail_R, slow_joint_R = slow_PR[Route.RAIL], slow_PR[Route.JOINT]

    def score(
        anchored_R: np.ndarray, anchored_lat_R: np.ndarray, anchored_slow_R: np.ndarray
    ) -> tuple[int, float, float]:
        """(over, total, cut) of the best cut for these anchor decisions (first minimal cut
        wins)."""
        base_over = int(anchored_slow_R[anchored_R].sum())
        base_total = float(anchored_lat_R[anchored_R].sum())
        free = ~anchored_R
        below_CR = (x_R[None, :] < cuts[:, None]) & (below_ok_R & free)[None, :]
        joint_CR = free[None, :] & ~below_CR
        over_C = base_over + (below_CR & slow_rail_R).sum(1) + (joint_CR & slow_joint_R).sum(1)
        total_C = base_total + (below_CR * lat_rail_R).sum(1) + (joint_CR * lat_joint_R).sum(1)
        best = min(range(cuts.size), key=lambda c: (int(over_C[c]), round(float(total_C[c]), 12)))
        return int(over_C[best]), float(total_C[best]), float(cuts[best])

    def entry(
        ratio: float | None, dist: float | None, result: tuple[int, float, float], held: int
    ) -> dict[str, Any]:
        over, total, cut = result
        return {
            "payload_ratio": ratio,
            "shape_distance": dist,
            "over_tolerance": over,
            "total_s": total,
            "vs_joint": total / joint_total if joint_total > 0 else 1.0,
            "anchors_held": held,
            "fallback_below_bytes": aset.scales[0] * 2.0**cut if math.isfinite(cut) else None,
        }

    none_R = np.zeros(len(rows), dtype=bool)
    no_anchors = entry(None, None, score(none_R, lat_joint_R, slow_joint_R), 0)
    scores, held_of = [], {}
    for ratio in grid["payload_ratio"]:
        for dist in grid["shape_distance"]:
            reach_AR = AnchorSelector(aset, payload_ratio=ratio, shape_distance=dist).reach_AR(
                coords_R3, windows_R
            )
            # The units where each anchor's path is more than the tolerance off the best.
            fails = [
                set(units_R[reach_AR[i] & slow_PR[a.path] & (units_R != unit)])
                for i, (a, unit) in enumerate(zip(aset.anchors, anchor_units))
            ]
            for hold in (
                True,
                False,
            ):  # with the rule that anchors hold, then without it (it may score better)
                if not hold:
                    fails = [set() for _ in fails]
                held_of[(ratio, dist, hold)] = tuple(
                    a.name for a, f in zip(aset.anchors, fails) if not f
                )
                anchored_R = np.zeros(len(rows), dtype=bool)
                anchored_lat_R, anchored_slow_R = (
                    np.zeros(len(rows)),
                    np.zeros(len(rows), dtype=bool),
                )
                for unit, idx in rows_of_unit.items():
                    others = tuple(
                        a
                        for a, u, f in zip(aset.anchors, anchor_units, fails)
                        if u != unit and f <= {unit}
                    )
                    sel = AnchorSelector(
                        AnchorSet(anchors=others, scales=aset.scales, context=aset.context),
                        payload_ratio=ratio,
                        shape_distance=dist,
                    )
                    for i in idx:
                        r = rows[i]
                        choice = sel.explain(r.stats, input_windows=r.input_windows)
                        if choice.anchor is not None:
                            anchored_R[i] = True
                            anchored_lat_R[i] = r.latency[choice.path].median
                            anchored_slow_R[i] = anchored_lat_R[i] > limit_R[i]
                scores.append(
                    {
                        **entry(
                            ratio,
                            dist,
                            score(anchored_R, anchored_lat_R, anchored_slow_R),
                            len(held_of[(ratio, dist, hold)]),
                        ),
                        "hold_rule": hold,
                    }
                )

    def rank(sc: dict[str, Any]) -> tuple[int, float]:
        return sc["over_tolerance"], round(sc["total_s"], 12)

    best_score = min(scores, key=rank)
    choice = (best_score["payload_ratio"], best_score["shape_distance"], best_score["hold_rule"])
    use_anchors = bool(held_of[choice]) and rank(best_score) < rank(no_anchors)
    chosen = best_score if use_anchors else no_anchors
    left_out = "seed" if by_seed else "routing"
    method = f"leave-one-{left_out}-out on the calibration requests, " + (
        f"anchors that hold across {left_out}s"
        if choice[2]
        else "every anchor (the hold rule scored worse)"
    )
    if not use_anchors and aset.anchors:
        method += "; no setting beats always-JOINT, so no anchors are kept"
    # The path model, scored with the same leave-out: fitted without the unit, deciding its rows.
    model, model_scores, model_score = None, [], None
    if fit_model and rows and all(r.features is not None for r in rows):
        topo_dict = aset.context.topology
        costs = path_costs(
            aset.context.settings, int(topo_dict["num_nodes"]) * int(topo_dict["gpus_per_node"])
        )
        features_RF = np.array([r.features for r in rows], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            target_R = np.log(lat_rail_R / lat_joint_R)
        fits_R = np.isfinite(target_R)  # a request without time on either path teaches nothing
        payload_R = np.array([r.stats.B_mean_bytes for r in rows], dtype=np.float64)
        for gating in PAYLOAD_GATINGS:
            sc = score_path_model(
                features_RF,
                windows_R,
                target_R,
                payload_R,
                units_R,
                lat_rail_R,
                lat_joint_R,
                limit_R,
                costs=costs,
                gating=gating,
            )
            model_scores.append(
                {
                    **entry(None, None, (sc["over_tolerance"], sc["total_s"], -math.inf), 0),
                    "model": True,
                    "gate": gating,
                    "decided": sc["decided"],
                }
            )
        by_gating = {sc["gate"]: sc for sc in model_scores}
        model_score = by_gating[choose_gating(by_gating)]
        if rank(model_score) < rank(chosen):
            model = fit_rail_joint(
                features_RF[fits_R], windows_R[fits_R], target_R[fits_R], costs=costs
            )
        if model is not None:
            gating = model_score["gate"]
            gate_all, gate_windowed = payload_gates(
                payload_R, slow_joint_R, windows_R == 1, gating=gating
            )
            model = dataclasses.replace(
                model, max_payload_bytes=gate_all, max_payload_bytes_windowed=gate_windowed
            )
            over = model_score["over_tolerance"]
            method += (
                f"; the RAIL / JOINT path model (leave-one-{left_out}-out: {over} requests over) "
                f"scored "
                "better than the anchors and decides "
                + (
                    "every layer (no payload gate: none scored better)"
                    if gating == "none"
                    else f"layers up to {gate_all / MiB:.2f} MiB per GPU, JOINT above"
                    if gating == "one"
                    else f"layers up to {gate_all / MiB:.2f} MiB per GPU sent all pairs at once "
                    f"and "
                    f"{gate_windowed / MiB:.2f} MiB in windows (gates per input kind), JOINT above"
                )
            )
    below = chosen["fallback_below_bytes"]
    return {
        "use_anchors": use_anchors,
        "payload_ratio": choice[0],
        "shape_distance": choice[1],
        "hold_rule": choice[2],
        "held": list(held_of[choice]) if use_anchors else [],
        "fallback_below": {"payload_bytes": below, "path": str(Route.RAIL)}
        if below is not None
        else None,
        "model": model.to_dict() if model is not None else None,
        "method": method,
        "left_out": left_out,
        "tolerance": tolerance,
        "scores": [no_anchors, *scores, *model_scores],
        "model_score": model_score,
    }


PAYLOAD_GATE_MARGIN = 1.5
"""``payload_gate``'s margin over the largest payload where JOINT missed the tolerance: one
layer's payload at one T varies by ~10% between generator seeds (8.3-9.1 MiB per GPU at T = 384
on the 4 x 8 GLM workload), and the calibrated T grid steps by 1.33-2x."""


def payload_gate(
    payload_R: np.ndarray, joint_slow_R: np.ndarray, *, margin: float = PAYLOAD_GATE_MARGIN
) -> float:
    """The path model's payload gate (``RailJointModel.max_payload_bytes``): ``margin`` x the
    largest mean remote payload per GPU among the requests on which JOINT is more than the
    tolerance slower than the best fixed path (``joint_slow_R``); 0 when JOINT is within it on
    every request (the model then decides no layer).

    Why: the decision is host time on every layer call (~0.05-0.08 ms at 4 x 8), and above that
    payload the calibration gave selecting nothing to win that the goal needs: JOINT was within
    the tolerance everywhere, and the best path's saving is a small share of a long layer.

    Args:
        payload_R: [R] B_mean bytes of the requests (``TrafficStats.B_mean_bytes``).
        joint_slow_R: [R] bool, JOINT over the tolerance of the request's best path.
    """
    slow = np.asarray(payload_R, dtype=np.float64)[np.asarray(joint_slow_R, dtype=bool)]
    return float(margin * slow.max()) if slow.size else 0.0


PAYLOAD_GATINGS = ("none", "one", "per_kind")
"""The payload gates ``tune_selector`` scores for the path model, in its tie order: no gate, one
gate for both input kinds, a gate per input kind (all node pairs at once / several windows)."""


def payload_gates(
    payload_R: np.ndarray, joint_slow_R: np.ndarray, all_pairs_R: np.ndarray, *, gating: str
) -> tuple[float | None, float | None]:
    """(all pairs at once, several windows) payload gates of ``gating`` (``PAYLOAD_GATINGS``), each
    ``payload_gate`` over the requests it covers; None: no gate.

    Args:
        payload_R, joint_slow_R: as ``payload_gate``.
        all_pairs_R: [R] bool, the request's input is sent all node pairs at once.
    """
    if gating == "none":
        return None, None
    if gating == "one":
        gate = payload_gate(payload_R, joint_slow_R)
        return gate, gate
    if gating == "per_kind":
        all_pairs_R = np.asarray(all_pairs_R, dtype=bool)
        payload_R, joint_slow_R = np.asarray(payload_R), np.asarray(joint_slow_R, dtype=bool)
        return (
            payload_gate(payload_R[all_pairs_R], joint_slow_R[all_pairs_R]),
            payload_gate(payload_R[~all_pairs_R], joint_slow_R[~all_pairs_R]),
        )
    raise ValueError(f"gating must be one of {PAYLOAD_GATINGS}, got {gating!r}")


def choose_gating(scores: dict[str, dict[str, Any]]) -> str:
    """The payload gating ``tune_selector`` keeps from ``score_path_model``'s scores per gating: the
    fewest requests over the tolerance, then the least total time, then the fewest decided
    requests (a decision is host time), then ``PAYLOAD_GATINGS``' order."""
    order = [g for g in PAYLOAD_GATINGS if g in scores]
    return min(
        order,
        key=lambda g: (
            scores[g]["over_tolerance"],
            round(scores[g]["total_s"], 12),
            scores[g]["decided"],
        ),
    )


def score_path_model(
    features_RF: np.ndarray,
    windows_R: np.ndarray,
    log_ratio_R: np.ndarray,
    payload_R: np.ndarray,
    units_R: np.ndarray,
    rail_s_R: np.ndarray,
    joint_s_R: np.ndarray,
    limit_s_R: np.ndarray,
    *,
    costs: PathCosts,
    gating: str,
) -> dict[str, Any]:
    """The path model's leave-one-unit-out score under a payload gating (``tune_selector``): for
    each unit, the model fitted on the other units' rows (``fit_rail_joint``, rows with a finite
    target) and their gates (``payload_gates``) decide the unit's rows, RAIL where it predicts
    RAIL faster, else JOINT.

    Args:
        features_RF: [R, F] the rows' features; windows_R: [R] their input windows.
        log_ratio_R: [R] log(t_RAIL / t_JOINT) (not finite: the row does not teach the fit).
        payload_R: [R] B_mean bytes; units_R: [R] the unit each row belongs to (a seed).
        rail_s_R, joint_s_R: [R] seconds on RAIL and JOINT; limit_s_R: [R] the tolerance's limit
            (``1 + tolerance`` x the row's best path).
        costs: what the features were computed with.

    Returns:
        ``over_tolerance`` (rows whose decided path is over its limit, JOINT where JOINT runs),
        ``total_s`` (the decided paths' seconds), ``decided`` (rows the model decided).
    """
    features_RF, windows_R = np.asarray(features_RF, dtype=np.float64), np.asarray(windows_R)
    log_ratio_R, payload_R = (
        np.asarray(log_ratio_R, dtype=np.float64),
        np.asarray(payload_R, dtype=np.float64),
    )
    units_R = np.asarray(units_R, dtype=object)
    fits_R, all_pairs_R = np.isfinite(log_ratio_R), windows_R == 1
    joint_slow_R = np.asarray(joint_s_R) > np.asarray(limit_s_R)
    rail_R = np.zeros(len(units_R), dtype=bool)
    decided_R = np.zeros(len(units_R), dtype=bool)
    for unit in dict.fromkeys(units_R.tolist()):
        train, idx = (units_R != unit), np.flatnonzero(units_R == unit)
        fitted = fit_rail_joint(
            features_RF[train & fits_R],
            windows_R[train & fits_R],
            log_ratio_R[train & fits_R],
            costs=costs,
        )
        if fitted is None:
            continue  # no model for this unit: its rows run JOINT
        gate_all, gate_windowed = payload_gates(
            payload_R[train], joint_slow_R[train], all_pairs_R[train], gating=gating
        )
        fitted = dataclasses.replace(
            fitted, max_payload_bytes=gate_all, max_payload_bytes_windowed=gate_windowed
        )
        for i in idx:  # the runtime's rule (ModelSelector): the gate, then the prediction
            windows = int(windows_R[i])
            decided_R[i] = fitted.decides(payload_R[i], input_windows=windows)
            predicted = (
                fitted.log_ratio(features_RF[i], input_windows=windows) if decided_R[i] else None
            )
            rail_R[i] = predicted is not None and predicted < 0
    chosen_s_R = np.where(rail_R, rail_s_R, joint_s_R)
    return {
        "over_tolerance": int((chosen_s_R > np.asarray(limit_s_R)).sum()),
        "total_s": float(chosen_s_R.sum()),
        "decided": int(decided_R.sum()),
    }


def with_selector_settings(anchor_set, tuned: dict[str, Any]):
    """``anchor_set`` with the tuned thresholds in ``context.settings.selector`` (scores stay in the
    JSON), keeping only the anchors that hold across seeds under them (``tuned['held']``; none when
    no setting beats always-JOINT): ``anchors_dropped`` records how many passed the keep rule but
    not that check."""
    ctx = anchor_set.context
    held = set(tuned.get("held", [a.name for a in anchor_set.anchors]))
    anchors = tuple(a for a in anchor_set.anchors if a.name in held)
    selector = {
        k: tuned[k] for k in ("payload_ratio", "shape_distance", "method", "left_out", "tolerance")
    }
    if "hold_rule" in tuned:
        selector["hold_rule"] = bool(tuned["hold_rule"])
    selector["anchors_dropped"] = len(anchor_set.anchors) - len(anchors)
    if tuned.get("fallback_below"):
        selector["fallback_below"] = dict(tuned["fallback_below"])
    if tuned.get("model"):
        selector["model"] = dict(tuned["model"])
    return AnchorSet(
        anchors=anchors,
        scales=anchor_set.scales,
        context=dataclasses.replace(ctx, settings={**ctx.settings, "selector": selector}),
    )
