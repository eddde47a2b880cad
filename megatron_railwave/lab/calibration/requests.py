"""Replay requests: one layer's demand to replay on every path, and the generators of the
calibration and held-out validation requests (synthetic routing families, the GLM-4.5-Air routing).

Letters: N nodes, G GPUs per node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_railwave.names import Route
from megatron_railwave.planner import PathPlan, PlanOptions, WaveSchedule, build_plan
from megatron_railwave.selector.path_model import PathCosts, path_features
from megatron_railwave.telemetry.stats import demand_stats
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import SelectorScales, TrafficStats


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayRequest:
    """One layer's demand to replay on every path (a calibration or validation point).

    Attributes:
        name: unique within a run (backends may cache by it).
        records_NGN: [N_src, G, N_dst] int64, CPU, global: records owned by GPU (s, g) for node d.
        record_bytes: payload bytes of one record (hidden size x element size).
        windows: the input's sending windows (replay arrangement) kept by NATIVE / RAIL and used
            for the descriptors; None = all node pairs at once.
        meta: where the request came from (workload, seed, payload scale), for reports.
        demand: the target-mask histograms behind ``records_NGN`` (a ``traffic.DemandCounts`` in
            full form), so a backend moves the exact stage-3 copies (and can run rail chunks);
            None = the model's synthetic delivery fan-out.
    """

    name: str
    records_NGN: torch.Tensor
    record_bytes: int
    windows: WaveSchedule | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    demand: Any = None


def request_plan(
    request: ReplayRequest, topo: RailTopology, path: Route, options: PlanOptions | None = None
) -> PathPlan:
    """The plan a backend executes for ``request`` on ``path`` (windows kept by NATIVE / RAIL)."""
    base = options or PlanOptions()
    opts = dataclasses.replace(
        base, windows=request.windows if request.windows is not None else base.windows
    )
    return build_plan(request.records_NGN, topo, path, options=opts)


def request_windows(request: ReplayRequest) -> int:
    """Sending windows of the request's input (1: all node pairs at once)."""
    return request.windows.num_waves if request.windows is not None else 1


def request_group(request: ReplayRequest) -> str:
    """The routing a request replays: workload, seed and layer (glm) or family (synthetic); the
    same for every T, arrangement and scale of it."""
    m = request.meta
    if "layer" in m:
        return f"{m.get('workload', '')}{m.get('seed', '')}-l{m['layer']}"
    if "family" in m:
        return f"{m.get('workload', '')}-f{m['family']}"
    return request.name


def request_seed(request: ReplayRequest) -> str:
    """The generator seed a request comes from: glm's workload seed (one seed sets the token skew
    and payload level of every layer, and a held-out glm request has another seed), synthetic's
    routing family (its own seed), else the request itself."""
    m = request.meta
    if "layer" in m and "seed" in m:
        return f"{m.get('workload', '')}{m['seed']}"
    return request_group(request)


def request_stats(
    request: ReplayRequest, topo: RailTopology, scales: SelectorScales | None = None
) -> TrafficStats:
    """The selector's descriptors of ``request`` (as the dispatcher computes them)."""
    return demand_stats(
        request.records_NGN,
        topo,
        record_bytes=request.record_bytes,
        scales=scales,
        windows=request.windows,
    )


def request_features(
    request: ReplayRequest, topo: RailTopology, costs: PathCosts
) -> tuple[float, ...] | None:
    """The path model's features of ``request`` (as the dispatcher computes them from the gathered
    counts, with the calibration's ``costs``), None without its target masks."""
    if request.demand is None:
        return None
    return tuple(
        float(v)
        for v in path_features(
            request.demand,
            topo,
            record_bytes=request.record_bytes,
            windows=request.windows,
            costs=costs,
        )
    )


def _default_experts(topo: RailTopology) -> int:
    return topo.world_size * max(1, 128 // topo.world_size)


ARRANGEMENTS = ("none", "ring", "moderate", "extreme")
"""Sending arrangements of a request: 'none' = all node pairs at once (what a training step
sends), else the replay's RING / MODERATE / EXTREME windows (``workloads.arrange``)."""


def token_counts(settings: dict[str, Any]) -> list[int]:
    """The ``tokens`` setting as a list of T per GPU (an int or a list in the settings)."""
    raw = settings.get("tokens", 1024)
    values = [raw] if isinstance(raw, int) and not isinstance(raw, bool) else list(raw)
    if not values or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in values):
        raise ValueError(
            f"settings 'tokens' must be a positive integer or a list of them, got {raw!r}"
        )
    return [int(t) for t in values]


def _variants(
    name: str,
    demand: Any,
    topo: RailTopology,
    *,
    arrangements: Sequence[str],
    payload_scales: Sequence[float],
    record_bytes: int,
    meta: dict[str, Any],
    sequence: str,
    position: int,
) -> list[ReplayRequest]:
    """``demand`` under every arrangement at every payload scale.

    ``sequence`` + arrangement + scale names the run of consecutive layers a request belongs to
    and ``position`` its place there (validation counts path changes along it)."""
    from megatron_railwave.lab.workloads import scaled_demand

    out = []
    for arr in arrangements:
        if arr not in ARRANGEMENTS:
            raise ValueError(f"arrangement {arr!r} is unknown; choose from {list(ARRANGEMENTS)}")
        windows = None
        arranged = demand
        if arr != "none":
            from megatron_railwave.lab.workloads import arrange

            arranged, windows = arrange(demand, arr, topo)
        for scale in payload_scales:
            scaled = arranged if scale == 1 else scaled_demand(arranged, scale)
            out.append(
                ReplayRequest(
                    name=f"{name}-{arr}-x{scale:g}",
                    records_NGN=scaled.records_NGN(),
                    record_bytes=record_bytes,
                    windows=windows,
                    demand=scaled,
                    meta={
                        **meta,
                        "arrangement": arr,
                        "scale": float(scale),
                        "sequence": f"{sequence}-{arr}-x{scale:g}",
                        "position": position,
                    },
                )
            )
    return out


def synthetic_requests(
    topo: RailTopology,
    *,
    families: Sequence[int],
    payload_scales: Sequence[float],
    record_bytes: int,
    tokens: int | Sequence[int] = 1024,
    num_experts: int | None = None,
    topk: int = 8,
    arrangements: Sequence[str] = ("none",),
) -> list[ReplayRequest]:
    """Requests from ``workloads.synthetic_routing_maps``: one routing per family seed (its own
    locality and hot-expert ratio, so rho_g varies) and T, under each arrangement at every
    payload scale (counts x scale). Families play the role of consecutive layers.
    """
    from megatron_railwave.lab.workloads import synthetic_routing_maps
    from megatron_railwave.traffic import DemandCounts

    num_experts = num_experts or _default_experts(topo)
    out = []
    for t in token_counts({"tokens": tokens}):
        for pos, fam in enumerate(families):
            rng = np.random.default_rng([int(fam), 0xCA11B])
            locality, hot = float(rng.uniform(0.0, 8.0)), float(rng.uniform(2.0, 10.0))
            maps = synthetic_routing_maps(
                topo,
                num_tokens=t,
                num_experts=num_experts,
                topk=topk,
                seed=int(fam),
                hot_ratio=hot,
                locality=locality,
            )
            out += _variants(
                f"syn{fam}-T{t}",
                DemandCounts.from_routing_maps(maps, topo),
                topo,
                arrangements=arrangements,
                payload_scales=payload_scales,
                record_bytes=record_bytes,
                meta={
                    "workload": "synthetic",
                    "family": int(fam),
                    "locality": locality,
                    "hot_ratio": hot,
                    "tokens": t,
                },
                sequence=f"syn-T{t}",
                position=pos,
            )
    return out


def glm_requests(
    topo: RailTopology,
    *,
    layers: Sequence[int] | None,
    step: int,
    seed: int,
    payload_scales: Sequence[float],
    record_bytes: int,
    tokens: int | Sequence[int] = 1024,
    arrangements: Sequence[str] = ("none",),
) -> list[ReplayRequest]:
    """Requests from the synthetic GLM-4.5-Air routing (``workloads.glm``): layers at one step,
    at every T per GPU in ``tokens``."""
    from megatron_railwave.lab.workloads import GlmAirWorkload, glm_air_demands

    out = []
    for t in token_counts({"tokens": tokens}):
        work = GlmAirWorkload(
            num_tokens=t, seed=seed, step=step, layers=tuple(layers) if layers else None
        )
        for layer, demand in glm_air_demands(topo, work).items():
            out += _variants(
                f"glm{seed}-s{step}-l{layer}-T{t}",
                demand,
                topo,
                arrangements=arrangements,
                payload_scales=payload_scales,
                record_bytes=record_bytes,
                meta={"workload": "glm", "layer": layer, "step": step, "seed": seed, "tokens": t},
                sequence=f"glm{seed}-s{step}-T{t}",
                position=int(layer),
            )
    return out


def glm_seeds(settings: dict[str, Any]) -> list[int]:
    """The glm workload seeds of ``settings``: ``seed`` (one) plus ``extra_seeds`` (more routings
    of the same layers, to cover more skew levels)."""
    return [int(settings["seed"])] + [int(v) for v in settings.get("extra_seeds", [])]


def calibration_requests(
    topo: RailTopology, settings: dict[str, Any], *, record_bytes: int
) -> list[ReplayRequest]:
    """The requests that ``settings`` (``workload``, ``families`` or ``layers``, ``seed``,
    ``payload_scales``, ``tokens``: one T or a list) describe; stored in the anchors file for
    validation."""
    scales, arrs = settings["payload_scales"], settings.get("arrangements", ("none",))
    if settings.get("workload", "synthetic") == "glm":
        return [
            req
            for seed in glm_seeds(settings)
            for req in glm_requests(
                topo,
                layers=settings.get("layers"),
                step=0,
                seed=seed,
                payload_scales=scales,
                record_bytes=record_bytes,
                tokens=token_counts(settings),
                arrangements=arrs,
            )
        ]
    return synthetic_requests(
        topo,
        families=settings["families"],
        payload_scales=scales,
        record_bytes=record_bytes,
        tokens=token_counts(settings),
        num_experts=settings.get("num_experts"),
        topk=settings.get("topk", 8),
        arrangements=arrs,
    )


def held_out_settings(
    settings: dict[str, Any],
    *,
    seed: int,
    count: int | None = None,
    layers: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Settings of validation requests that share nothing with calibration's ``settings``.

    glm: another workload seed (``seed``: other expert popularity and skew per layer) and layers
    calibration did not use (``layers``, default: every GLM-4.5-Air MoE layer outside the
    calibrated ones; the first ``count`` of them when given). synthetic: ``count`` routing
    families (default as many as calibration had) numbered from ``seed`` upwards, none of them
    calibrated. Payload scales, T and arrangements stay those of calibration.

    Raises:
        ValueError: the result would overlap calibration (``check_held_out``).
    """
    out = {k: v for k, v in settings.items() if k not in ("layers", "families", "extra_seeds")}
    out["seed"] = int(seed)
    if settings.get("workload", "synthetic") == "glm":
        from megatron_railwave.lab.workloads import GLM45_AIR

        if layers is None:
            used = set(settings.get("layers") or GLM45_AIR.layer_numbers)
            layers = [layer for layer in GLM45_AIR.layer_numbers if layer not in used]
            if not layers:
                raise ValueError(
                    "calibration used every GLM-4.5-Air MoE layer, so no layer is held out; "
                    "calibrate on a subset (railwave calibrate --layers, e.g. the odd ones)"
                )
        out["layers"] = (
            sorted(int(v) for v in layers)[:count] if count else sorted(int(v) for v in layers)
        )
    else:
        n = count or len(settings["families"])
        out["families"] = [int(seed) + i for i in range(n)]
    check_held_out(settings, out)
    return out


def check_held_out(calibration: dict[str, Any], validation: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the validation settings are held out from calibration's.

    glm: different workload seeds and disjoint layer sets (calibration's ``layers`` None = all).
    synthetic: disjoint family seeds.
    """
    workload = calibration.get("workload", "synthetic")
    if validation.get("workload", "synthetic") != workload:
        raise ValueError(
            f"validation workload {validation.get('workload')!r} differs from calibration's "
            f"{workload!r}"
        )
    if workload == "glm":
        from megatron_railwave.lab.workloads import GLM45_AIR

        shared_seeds = sorted(set(glm_seeds(validation)) & set(glm_seeds(calibration)))
        if shared_seeds:
            raise ValueError(
                f"held-out requests need another GLM seed than calibration's "
                f"{glm_seeds(calibration)} "
                f"(shared: {shared_seeds}); pass railwave validate --seed with another value"
            )
        cal_layers = set(calibration.get("layers") or GLM45_AIR.layer_numbers)
        val_layers = set(validation.get("layers") or GLM45_AIR.layer_numbers)
        shared = sorted(cal_layers & val_layers)
        if shared:
            raise ValueError(
                f"held-out layers {shared} were calibrated; pass railwave validate --layers "
                "with layers calibration did not use"
            )
        return
    shared = sorted(set(calibration["families"]) & set(validation["families"]))
    if shared:
        raise ValueError(
            f"held-out routing families {shared} were calibrated; pass railwave validate --seed "
            f"above {max(calibration['families'])}"
        )


def validation_requests(
    topo: RailTopology,
    settings: dict[str, Any],
    *,
    seed: int,
    count: int | None = None,
    layers: Sequence[int] | None = None,
    record_bytes: int,
) -> list[ReplayRequest]:
    """Held-out requests (``held_out_settings``) for validating anchors calibrated with
    ``settings``, ordered by sequence then layer, so path changes between consecutive layers can be
    counted."""
    held = held_out_settings(settings, seed=seed, count=count, layers=layers)
    requests = calibration_requests(topo, held, record_bytes=record_bytes)
    return sorted(requests, key=lambda r: (r.meta["sequence"], r.meta["position"]))
