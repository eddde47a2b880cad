"""Fit of the synthetic GLM-4.5-Air knobs to the paper's published workload statistics.

Letters: N nodes, G GPUs per node, W = N * G ranks, E experts, A NIC adapters per node.

Only statistics the paper publishes about its captured routing are targets (``PUBLISHED``);
its speedups are predictions of the flow model and never enter the fit. A *sample* is one
(step, layer) of the generator on 4 x 8 GPUs; per sample:
  * remote egress per GPU under NATIVE: records (token, remote node) each GPU sends on its rail;
  * NIC shares: per node, each adapter's share of that egress (GPU l on adapter
    ``adapter_of_rail[rail_of_gpu[l]]``; H20: GPU pairs), sorted descending, mean over nodes;
  * source-rail imbalance: max over (node, rail) of the egress / mean (rho_g under NATIVE);
  * expert-load imbalance: max / mean of the (token, expert) assignments per expert;
  * busiest destination-rail share: the largest share of assignments whose expert's GPU sits on
    one rail (GPU index l of every node).
Over the samples: mean NIC shares, median expert max/mean, P10 / P90 of the busiest
destination-rail share, and R^2 of the linear fits of source- and destination-rail imbalance on
expert-load imbalance.

The fit uses expected counts (``expected_sample``: Rosen inclusion probabilities, no token
draws; the many-tokens limit) so that its loss is smooth and deterministic: coordinate descent
with golden-section search on each knob over a bracket, a few sweeps. ``token_skew`` is fitted to
the NIC shares (sum of squared relative errors) on many steps, the other knobs to the layer
statistics (median, percentiles, R^2) on steps x layers. ``sampled_sample``
measures the same statistics on drawn tokens, to check the fit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from megatron_railwave.lab.workloads.glm import (
    GlmAirWorkload,
    glm_air_layer_ids,
    inclusion_WE,
    layer_model,
)
from megatron_railwave.telemetry.capture import demand_from_topk_ids
from megatron_railwave.topology import RailTopology

__all__ = [
    "golden_section_min",
    "PUBLISHED",
    "FIT_KNOBS",
    "Published",
    "LayerSample",
    "WorkloadFit",
    "expected_sample",
    "sampled_sample",
    "collect_samples",
    "workload_statistics",
    "fit_statistics",
    "compare_to_published",
    "workload_report",
    "fit_workload",
    "FIT_LAYERS",
    "NIC_STEPS",
    "NIC_LAYERS",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """One statistic the paper publishes about its routing, and how close ours must come."""

    value: float
    source: str
    fitted: bool = True
    """False: reported next to ours, not a fitting target."""
    tolerance: float = 0.10
    """Relative tolerance of the goal (issue 13: within 10%)."""


PUBLISHED: dict[str, Published] = {
    **{
        f"nic_share_{i + 1}": Published(
            value=v, source="Fig. 8 / sec. 4.3: NATIVE, H20, MODERATE, four NIC positions"
        )
        for i, v in enumerate((0.5412, 0.2433, 0.1485, 0.0669))
    },
    "expert_max_mean_p50": Published(
        value=8.3,
        source="sec. 2.3: six cases with expert max/mean 8.2-8.4 (we take the midpoint as the "
        "median)",
    ),
    "dst_rail_share_p10": Published(
        value=0.155,
        source="sec. 2.3: busiest destination-rail shares 15.5%-24.1% in those six cases; ours: "
        "P10..P90 over all samples (the expected range of six draws spans about P10..P90; "
        "the six cases were chosen at similar expert max/mean, which we do not condition on)",
    ),
    "dst_rail_share_p90": Published(value=0.241, source="as dst_rail_share_p10"),
    "r2_dst": Published(
        value=0.296,
        source="sec. 2.3: R^2 of destination-rail imbalance on expert-load "
        "imbalance, 900 step-layer pairs",
    ),
    "r2_src": Published(
        value=0.019,
        fitted=False,
        source="sec. 2.3: R^2 of source-rail imbalance on expert-load imbalance, 900 step-layer "
        "pairs (not fitted: any generator whose rail skew does not come from hot experts "
        "gives ~0; sampling error at 900 pairs ~0.009)",
    ),
}
"""The paper's published workload statistics (arXiv 2610.03415; /work/shared/seeds)."""

FIT_KNOBS: dict[str, tuple[float, float]] = {
    "token_skew": (0.0, 2.5),
    "hot_ratio": (4.0, 14.0),
    "dest_gpu_skew": (0.0, 0.9),
    "dest_rail_balance": (0.0, 1.0),
    "hot_ratio_spread": (0.0, 0.6),
}
"""Fitted ``GlmAirWorkload`` knobs and their search brackets, in coordinate-descent order.
``token_skew`` is fitted to the NIC shares (``NIC_STEPS`` x ``NIC_LAYERS``), the others to the
layer statistics (steps x ``FIT_LAYERS``). ``pref_strength`` is stated, not fitted: the published
statistics do not pin it (a fit with it drifts to its bracket's end, 8, for a loss change below
the R^2 noise; docs/workloads.md)."""

NIC_STEPS = range(100)
NIC_LAYERS = (1, 16, 31)
"""The NIC shares' sample: token counts change per step only, so the shares need many steps
(100 token draws x 4 nodes) and few layers."""

FIT_LAYERS = tuple(range(1, 46))
"""Layers of the layer statistics' sample at every step: all 45, so that 20 steps give the 900
pairs the statistics are reported on (a 300-pair subset let R^2, whose sampling error is ~0.03
at 900 pairs, land 18% off on the 900)."""


def _is_nic(name: str) -> bool:
    return name.startswith("nic_share_")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSample:
    """What the statistics need of one (step, layer)."""

    egress_W: np.ndarray
    """[W] float64, remote records each rank sends under NATIVE (one per token and remote node)."""
    load_E: np.ndarray
    """[E] float64, (token, expert) assignments per expert."""


def expected_sample(topo: RailTopology, layer: int, work: GlmAirWorkload) -> LayerSample:
    """Expected counts of one layer (no draws): loads sum inclusion probabilities; a token reaches
    a node unless none of its experts there is chosen (Rosen: inclusions independent)."""
    log_w_WE, tokens_W = layer_model(topo, layer, work)
    p_WE = inclusion_WE(log_w_WE, work.model.topk)
    tokens = tokens_W.astype(np.float64)
    n, world = topo.num_nodes, topo.world_size
    miss_WN = np.exp(np.log1p(-np.minimum(p_WE, 1 - 1e-15)).reshape(world, n, -1).sum(axis=-1))
    reach_WN = 1.0 - miss_WN
    reach_WN[np.arange(world), np.arange(world) // topo.gpus_per_node] = 0.0
    return LayerSample(egress_W=tokens * reach_WN.sum(axis=1), load_E=tokens @ p_WE)


def sampled_sample(topo: RailTopology, layer: int, work: GlmAirWorkload) -> LayerSample:
    """Counts of one layer from drawn tokens (``glm_air_layer_ids``)."""
    demand = demand_from_topk_ids(
        glm_air_layer_ids(topo, layer, work), topo, work.model.num_experts
    )
    records_WN = demand.records_WN.numpy().astype(np.float64)
    world = topo.world_size
    records_WN[np.arange(world), np.arange(world) // topo.gpus_per_node] = 0.0
    return LayerSample(
        egress_W=records_WN.sum(axis=1),
        load_E=demand.experts_WE.sum(dim=0).numpy().astype(np.float64),
    )


def _r2(x: np.ndarray, y: np.ndarray) -> float:
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1] ** 2)


def workload_statistics(samples: Sequence[LayerSample], topo: RailTopology) -> dict[str, float]:
    """The statistics of ``PUBLISHED`` (plus a few descriptive ones) over ``samples``."""
    n, g = topo.num_nodes, topo.gpus_per_node
    adapter_G = np.asarray([topo.adapter_of_rail[r] for r in topo.rail_of_gpu])
    num_adapters = int(adapter_G.max()) + 1
    rail_G = np.asarray(topo.rail_of_gpu)
    shares, rho, ratio, dst = [], [], [], []
    for s in samples:
        egress_NG = s.egress_W.reshape(n, g)
        per_adapter = np.zeros((n, num_adapters))
        np.add.at(per_adapter, (slice(None), adapter_G), egress_NG)
        total = per_adapter.sum(axis=1, keepdims=True)
        sent = total[:, 0] > 0
        shares.append(-np.sort(-per_adapter[sent] / total[sent], axis=1).mean(axis=0))
        per_rail = np.zeros((n, topo.num_rails))
        np.add.at(per_rail, (slice(None), rail_G), egress_NG)
        rho.append(per_rail.max() / per_rail.mean() if per_rail.mean() > 0 else 1.0)
        ratio.append(s.load_E.max() / s.load_E.mean())
        load_G = s.load_E.reshape(n * g, -1).sum(axis=1).reshape(n, g)  # experts contiguous per GPU
        dst_rail = np.zeros(topo.num_rails)
        np.add.at(dst_rail, rail_G, load_G.sum(axis=0))
        dst.append(dst_rail.max() / dst_rail.sum())
    rho_a, ratio_a, dst_a = np.asarray(rho), np.asarray(ratio), np.asarray(dst)

    out = {f"nic_share_{i + 1}": float(v) for i, v in enumerate(np.mean(shares, axis=0))}
    out.update(
        {
            "expert_max_mean_p50": float(np.median(ratio_a)),
            "dst_rail_share_p10": float(np.percentile(dst_a, 10)),
            "dst_rail_share_p90": float(np.percentile(dst_a, 90)),
            "r2_dst": _r2(ratio_a, dst_a),
            "r2_src": _r2(ratio_a, rho_a),
            "rho_g_p50": float(np.median(rho_a)),
            "rho_g_p90": float(np.percentile(rho_a, 90)),
            "samples": float(len(rho_a)),
        }
    )
    return out


def collect_samples(
    topo: RailTopology,
    work: GlmAirWorkload,
    *,
    steps: Sequence[int],
    sample: Callable[[RailTopology, int, GlmAirWorkload], LayerSample] = expected_sample,
) -> list[LayerSample]:
    """One sample per (step, layer) of ``work.layer_numbers``."""
    return [
        sample(topo, layer, replace(work, step=step))
        for step in steps
        for layer in work.layer_numbers
    ]


def _loss(stats: dict[str, float], *, nic: bool | None = None) -> float:
    """Sum of squared relative errors of the fitted statistics (NIC shares only / none of them)."""
    return sum(
        ((stats[k] - p.value) / p.value) ** 2
        for k, p in PUBLISHED.items()
        if p.fitted and k in stats and (nic is None or _is_nic(k) == nic)
    )


def fit_statistics(
    topo: RailTopology,
    work: GlmAirWorkload,
    *,
    steps: Sequence[int],
    nic_steps: Sequence[int] = NIC_STEPS,
    parts: tuple[str, ...] = ("layers", "nic"),
) -> dict[str, float]:
    """Expected-count statistics as the fit sees them: the layer statistics over ``steps`` x
    ``work.layer_numbers``, the NIC shares over ``nic_steps`` x ``NIC_LAYERS``."""
    out: dict[str, float] = {}
    if "layers" in parts:
        out.update(
            {
                k: v
                for k, v in workload_statistics(
                    collect_samples(topo, work, steps=steps), topo
                ).items()
                if not _is_nic(k)
            }
        )
    if "nic" in parts:
        nic = workload_statistics(
            collect_samples(topo, replace(work, layers=NIC_LAYERS), steps=nic_steps), topo
        )
        out.update({k: v for k, v in nic.items() if _is_nic(k)})
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadFit:
    """Result of ``fit_workload``."""

    knobs: dict[str, float]
    """The fitted knobs (round to the printed precision for ``GlmAirWorkload`` defaults)."""
    expected: dict[str, float]
    """Statistics of the fitted knobs on the fit's samples (expected counts)."""
    loss: float
    start_loss: float
    """Loss of the starting knobs (all fitted statistics)."""
    evaluations: int
    seconds: float
    steps: tuple[int, ...]
    history: list[dict[str, Any]] = field(default_factory=list)
    """Per coordinate step: the knob, its new value and the loss."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def golden_section_min(
    f: Callable[[float], float], lo: float, hi: float, *, tol: float, include_ends: bool = False
) -> tuple[float, float]:
    """(x, f(x)) at the minimum of ``f`` on [lo, hi] by golden-section search (f unimodal there).

    Args:
        tol: stop when the bracket is shorter than ``tol`` (absolute, in x units).
        include_ends: also evaluate ``lo`` and ``hi`` and return one of them when it is lower
            (a monotone loss pins the minimum at a bound, which the search only approaches).
    """
    inv = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - inv * (b - a), a + inv * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - inv * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv * (b - a)
            fd = f(d)
    candidates = [(fc, c), (fd, d)]
    if include_ends:
        candidates += [(f(lo), lo), (f(hi), hi)]
    fx, x = min(candidates)
    return x, fx


def fit_workload(
    topo: RailTopology,
    *,
    start: GlmAirWorkload | None = None,
    steps: Sequence[int] = range(20),
    layers: Sequence[int] | None = FIT_LAYERS,
    nic_steps: Sequence[int] = NIC_STEPS,
    knobs: Sequence[str] = tuple(FIT_KNOBS),
    sweeps: int = 2,
    tol: float = 0.02,
    log: Callable[[str], None] | None = None,
) -> WorkloadFit:
    """Fit ``FIT_KNOBS`` of ``start`` to the fitted statistics of ``PUBLISHED``.

    Args:
        topo: the cluster whose adapters define the NIC shares (the paper's: ``h20_4x8``).
        start: the first guess and the stated knobs (default ``GlmAirWorkload()``).
        steps: steps sampled; the loss is the sum of squared relative errors of the fitted
            statistics on their expected counts. Token counts change per step only, so the NIC
            shares need many steps.
        layers: layers sampled at every step (None: those of ``start``).
        nic_steps: steps of the NIC shares' sample (``NIC_LAYERS`` at each).
        knobs: the knobs to fit (names of ``FIT_KNOBS``, in that order); the others stay.
        sweeps: coordinate-descent sweeps over ``knobs``.
        tol: golden-section stop, as a fraction of each bracket.
    """
    unknown = [k for k in knobs if k not in FIT_KNOBS]
    if unknown:
        raise ValueError(f"knobs {unknown} cannot be fitted; choose from {list(FIT_KNOBS)}")
    t0 = time.perf_counter()
    work = start or GlmAirWorkload()
    if layers is not None:
        work = replace(work, layers=tuple(layers))
    steps = tuple(steps)
    calls = 0

    def group_loss(w: GlmAirWorkload, nic: bool) -> float:
        nonlocal calls
        calls += 1
        stats = fit_statistics(
            topo, w, steps=steps, nic_steps=nic_steps, parts=("nic",) if nic else ("layers",)
        )
        return _loss(stats, nic=nic)

    start_loss = _loss(fit_statistics(topo, work, steps=steps, nic_steps=nic_steps))
    history = []
    for sweep in range(sweeps):
        for knob in knobs:
            lo, hi = FIT_KNOBS[knob]
            nic = knob == "token_skew"
            best = group_loss(work, nic)
            value, loss = golden_section_min(
                lambda v, work=work, knob=knob, nic=nic: group_loss(
                    replace(work, **{knob: v}), nic
                ),
                lo,
                hi,
                tol=tol * (hi - lo),
            )
            if loss < best:
                work, best = replace(work, **{knob: value}), loss
            history.append(
                {
                    "sweep": sweep,
                    "knob": knob,
                    "value": getattr(work, knob),
                    "group": "nic" if nic else "layers",
                    "group_loss": best,
                }
            )
            if log:
                log(
                    f"sweep {sweep} {knob} = {getattr(work, knob):.4g}  "
                    f"{'NIC' if nic else 'layer'} loss {best:.4g}"
                )
    stats = fit_statistics(topo, work, steps=steps, nic_steps=nic_steps)
    loss = _loss(stats)
    return WorkloadFit(
        knobs={k: float(getattr(work, k)) for k in knobs},
        expected=stats,
        loss=loss,
        start_loss=start_loss,
        evaluations=calls,
        seconds=time.perf_counter() - t0,
        steps=steps,
        history=history,
    )


def compare_to_published(stats: dict[str, float]) -> list[dict[str, Any]]:
    """One row per published statistic: ours next to the paper's, relative error, within
    tolerance."""
    rows = []
    for name, pub in PUBLISHED.items():
        ours = stats[name]
        rel = (ours - pub.value) / pub.value
        rows.append(
            {
                "statistic": name,
                "published": pub.value,
                "ours": ours,
                "rel_err": rel,
                "within": abs(rel) <= pub.tolerance,
                "tolerance": pub.tolerance,
                "fitted": pub.fitted,
                "source": pub.source,
            }
        )
    return rows


def workload_report(
    topo: RailTopology,
    work: GlmAirWorkload,
    *,
    steps: Sequence[int],
    nic_steps: Sequence[int] = NIC_STEPS,
    sampled_steps: Sequence[int] = (),
    sampled_tokens: int = 1024,
) -> dict[str, Any]:
    """The statistics of ``work`` next to the published ones: on expected counts over ``steps``
    (NIC shares: ``nic_steps`` x ``NIC_LAYERS``) and, where ``sampled_steps`` is given, on drawn
    tokens (``sampled_tokens`` mean per GPU; every layer; NIC shares over those few steps only)."""
    t0 = time.perf_counter()
    expected = fit_statistics(topo, work, steps=steps, nic_steps=nic_steps)
    out: dict[str, Any] = {
        "knobs": {k: v for k, v in asdict(work).items() if k not in ("model", "layers")},
        "cluster": topo.name,
        "steps": list(steps),
        "layers": list(work.layer_numbers),
        "nic_steps": list(nic_steps),
        "nic_layers": list(NIC_LAYERS),
        "expected": {"statistics": expected, "rows": compare_to_published(expected)},
    }
    if sampled_steps:
        drawn = replace(work, num_tokens=sampled_tokens)
        sampled = workload_statistics(
            collect_samples(topo, drawn, steps=sampled_steps, sample=sampled_sample), topo
        )
        out["sampled"] = {
            "statistics": sampled,
            "rows": compare_to_published(sampled),
            "steps": list(sampled_steps),
            "tokens": sampled_tokens,
        }
    out["seconds"] = time.perf_counter() - t0
    return out
