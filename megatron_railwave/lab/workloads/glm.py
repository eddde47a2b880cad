"""Synthetic GLM-4.5-Air routing: 45 MoE layers, 128 experts, top-8, hidden 4096, bf16.

Letters: W ranks (N nodes x G GPUs), T tokens per rank, E experts, K top-k.

The generator stands in for the paper's captured training routing. GLM-4.5-Air has no
node-limited routing and places experts contiguously (expert e on rank e // (E / W)), so by
symmetry about 1/N of a token's experts are on its own node; nothing here favours the own node
unless ``own_node_bias`` says so. What makes rails unequal is modelled where it comes from:
  * per-rank token counts (per step, the same for every layer, as one micro-batch passes all
    layers): variable-length RL micro-batches and packed sequences give ranks different token
    counts, ``T_w = T * m_w`` with ``log m_w ~ N(-s^2 / 2, s^2)``, ``s = token_skew`` (mean T);
    the ``[W, T_max, K]`` ids pad the shorter ranks with -1 rows (empty tokens, as
    ``merge_captures`` pads captured ranks);
  * per-rank preferences for *sets* of experts (per step and layer; a topic or a language makes
    a micro-batch favour some experts): each rank draws ``pref_set_size`` experts uniformly,
    wherever they live, and adds the log-weight ``pref_strength * level`` to them, where the
    layer's ``level`` in [0, 1] (``skew_of_layer``) says how specialised that layer's routing is;
  * expert popularity ``a * z_e`` (per seed, step and layer: loads drift with the data and the
    router's expert-bias updates), with
    ``z_e = sqrt(1 - c) * eps_e + sqrt(c) * gamma_gpu(e)``, ``c = dest_gpu_skew``: the part of the
    popularity that the experts of one GPU share, i.e. how much hot experts concentrate on some
    GPUs (and so on some destination rails and receivers). The scale ``a`` is solved per layer and
    step so that the expected max/mean expert load is the layer's target
    ``hot_ratio * exp(hot_ratio_spread * xi)``, ``xi ~ N(0, 1)`` per (seed, step, layer);
    ``dest_rail_balance = b`` then removes the share b of each destination rail's mean ``z``
    (over the experts on that rail, GPU l of every node) from its experts: popularity
    anti-correlated among the experts that share a rail (placement stays contiguous).
The default knobs are fitted to the paper's published workload statistics only (``workloads.fit``,
docs/workloads.md); its speedups are never a fitting target.

Expected loads use Rosen's approximation of successive-sampling inclusion probabilities,
``p_e = 1 - exp(-lambda * w_e)`` with ``sum_e p_e = K`` per rank; tokens are drawn exactly by
``synthetic.sample_topk_ids``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from megatron_railwave.lab.workloads.synthetic import sample_topk_ids
from megatron_railwave.telemetry.capture import LayerTrace, Trace, TraceMeta, demand_from_topk_ids
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts

__all__ = [
    "ModelSpec",
    "GLM45_AIR",
    "GlmAirWorkload",
    "glm_air_layer_ids",
    "glm_air_trace",
    "glm_air_demands",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """The MoE shape of a model (what a routing replay needs)."""

    name: str
    first_moe_layer: int
    """Layer number of the first MoE layer (GLM-4.5-Air: layer 0 is dense)."""
    num_moe_layers: int
    num_experts: int
    """Routed experts (the shared expert is not dispatched)."""
    topk: int
    hidden_size: int
    dtype: str = "bf16"

    @property
    def layer_numbers(self) -> tuple[int, ...]:
        return tuple(range(self.first_moe_layer, self.first_moe_layer + self.num_moe_layers))


GLM45_AIR = ModelSpec(
    name="GLM-4.5-Air",
    first_moe_layer=1,
    num_moe_layers=45,
    num_experts=128,
    topk=8,
    hidden_size=4096,
    dtype="bf16",
)


PAPER_PAYLOAD_SCALE = 1.895
"""Record-count factor that scales this generator's layers (T = 2048 per GPU, seed 0, step 0) to
the paper's layer times: NATIVE under the RING arrangement on H800 4 x 8 (flow model, the
packaged netmodel h800_4x8) then sums to the paper's 1.801 s over the 45 MoE layers
(docs/netmodel.md; generator of commit 7b1ef53, was 2.19 before its refit). ``railwave bench
--payload-scale paper`` and ``make bench-paper`` use it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GlmAirWorkload:
    """Knobs of the synthetic GLM-4.5-Air routing.

    The defaults of ``token_skew``, ``hot_ratio``, ``hot_ratio_spread``, ``dest_gpu_skew`` and
    ``dest_rail_balance`` are the fit of ``workloads.fit.fit_workload`` (``railwave workloads fit``)
    to the paper's published statistics; the others are stated (``pref_strength``: an earlier fit's
    value, which the published statistics do not pin).
    """

    num_tokens: int = 4096
    """T, mean tokens per GPU per layer (ranks differ by ``token_skew``; ids are padded to the
    largest rank's count with -1 rows)."""
    seed: int = 0
    """Fixes the layers' levels and, with the step, everything else; same seed and step, same
    trace."""
    step: int = 0
    """Training step stand-in: token counts, popularity, preferences and tokens change with it."""
    layers: tuple[int, ...] | None = None
    """Layer numbers to generate (default all MoE layers of ``model``)."""
    token_skew: float = 1.46
    """s, standard deviation of log tokens per rank (0: every rank has T tokens)."""
    pref_strength: float = 4.09
    """Log-weight bonus of a rank's preferred expert set in a layer of level 1 (stated: an earlier
    fit's value; the published statistics do not pin it)."""
    pref_set_size: int = 8
    """Experts in a rank's preferred set (stated: one token's worth, K)."""
    hot_ratio: float = 8.11
    """Median over layers of the target max/mean expert load."""
    hot_ratio_spread: float = 0.296
    """Standard deviation of the log target max/mean expert load over layers."""
    dest_gpu_skew: float = 0.246
    """c in [0, 1): share of the expert-popularity variance common to the experts of one GPU
    (0: hot experts fall on GPUs independently; towards 1: whole GPUs are hot)."""
    dest_rail_balance: float = 0.284
    """b in [0, 1]: share of each destination rail's mean popularity ``z`` (over its experts, those
    of GPU l on every node) taken off its experts, i.e. popularity anti-correlated among experts
    that share a rail (0: no such coupling; 1: every rail's experts have mean ``z`` 0, so a hot
    expert's rail-mates are colder than average). Changes popularity, not placement."""
    own_node_bias: float = 0.0
    """Log-weight bonus of the experts on a rank's own node (0: no node-limited routing, about
    1 / N of the choices are local)."""
    model: ModelSpec = GLM45_AIR

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        if self.seed < 0 or self.step < 0:
            raise ValueError(f"seed and step must be >= 0, got seed={self.seed} step={self.step}")
        if self.hot_ratio < 1:
            raise ValueError(f"hot_ratio must be >= 1 (max/mean), got {self.hot_ratio}")
        for name in ("token_skew", "pref_strength", "hot_ratio_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.dest_gpu_skew < 1:
            raise ValueError(f"dest_gpu_skew must be in [0, 1), got {self.dest_gpu_skew}")
        if not 0 <= self.dest_rail_balance <= 1:
            raise ValueError(f"dest_rail_balance must be in [0, 1], got {self.dest_rail_balance}")
        if not 0 <= self.pref_set_size <= self.model.num_experts:
            raise ValueError(
                f"pref_set_size must be in [0, {self.model.num_experts}] (experts of "
                f"{self.model.name}), "
                f"got {self.pref_set_size}"
            )
        known = self.model.layer_numbers
        bad = [v for v in (self.layers or ()) if v not in known]
        if bad:
            raise ValueError(
                f"layers {bad} are not MoE layers of {self.model.name} ({known[0]}..{known[-1]})"
            )

    @property
    def layer_numbers(self) -> tuple[int, ...]:
        return tuple(self.layers) if self.layers is not None else self.model.layer_numbers

    def skew_of_layer(self) -> dict[int, float]:
        """Level in [0, 1] of every MoE layer: how strongly its ranks prefer their expert sets
        (``linspace(0, 1, layers)`` in a seeded order; depends on the seed only)."""
        numbers = self.model.layer_numbers
        levels = np.random.default_rng([self.seed, 0x5EED]).permutation(
            np.linspace(0.0, 1.0, len(numbers))
        )
        return {layer: float(level) for layer, level in zip(numbers, levels)}

    def hot_ratio_of_layer(self, layer: int) -> float:
        """Target max/mean expert load of ``layer`` at this step."""
        xi = np.random.default_rng([self.seed, self.step, layer, 0x407]).standard_normal()
        return float(max(1.0, self.hot_ratio * np.exp(self.hot_ratio_spread * xi)))

    def tokens_per_rank(self, world: int) -> np.ndarray:
        """[W] int64 tokens of every rank at this step (at least 1; mean about ``num_tokens``)."""
        z = np.random.default_rng([self.seed, self.step, 0x70C]).standard_normal(world)
        s = self.token_skew
        return np.maximum(1, np.rint(self.num_tokens * np.exp(s * z - 0.5 * s * s))).astype(
            np.int64
        )


def inclusion_WE(log_w_WE: np.ndarray, topk: int) -> np.ndarray:
    """[W, E] Rosen's approximation of per-rank inclusion probabilities (rows sum to K).

    Solves ``sum_e 1 - exp(-lambda w_e) = K`` per row by Newton's method from
    ``lambda = K / sum w``, where the sum is <= K (1 - exp(-x) <= x); the sum is concave in
    lambda, so the iterates rise monotonically to the root.
    """
    w = np.exp(log_w_WE - log_w_WE.max(axis=1, keepdims=True))
    lam = topk / w.sum(axis=1)
    for _ in range(100):
        e = np.exp(-lam[:, None] * w)
        gap = topk - (1.0 - e).sum(axis=1)
        if gap.max() < 1e-10 * topk:
            break
        lam = lam + gap / (w * e).sum(axis=1)
    return 1.0 - np.exp(-lam[:, None] * w)


_MAX_SCALE = 6.0
"""Upper end of the popularity-scale search; where even it misses the target, it is taken."""


def _popularity_scale(
    z_E: np.ndarray, bonus_WE: np.ndarray, tokens_W: np.ndarray, topk: int, target: float
) -> float:
    """Scale a with expected max/mean expert load of exp(a z + bonus), tokens-weighted, =
    ``target``."""

    def gap(a: float) -> float:
        load_E = tokens_W @ inclusion_WE(a * z_E[None, :] + bonus_WE, topk)
        return float(load_E.max() / load_E.mean()) - target

    lo, hi = 0.0, _MAX_SCALE
    g_lo, g_hi = gap(lo), gap(hi)
    if g_hi <= 0 or g_lo >= 0:  # unreachable under the cap, or already there without popularity
        return hi if g_hi <= 0 else lo
    a = hi
    for _ in range(40):  # regula falsi, Illinois variant: a ratio within 1e-4 of the target
        a = hi - g_hi * (hi - lo) / (g_hi - g_lo)
        g = gap(a)
        if abs(g) < 1e-4 * target:
            break
        if g > 0:
            hi, g_hi = a, g
            g_lo *= 0.5
        else:
            lo, g_lo = a, g
            g_hi *= 0.5
    return a


def layer_model(
    topo: RailTopology, layer: int, work: GlmAirWorkload
) -> tuple[np.ndarray, np.ndarray]:
    """The routing distribution of one layer at ``work.step``.

    Returns:
        ([W, E] float64 log expert weights per rank, [W] int64 tokens per rank).
    """
    model, world = work.model, topo.world_size
    if model.num_experts % world:
        raise ValueError(
            f"{model.name} has {model.num_experts} experts, not divisible by the "
            f"{world} ranks of topology {topo.name!r}"
        )
    num_experts = model.num_experts
    per_gpu = num_experts // world
    pop = np.random.default_rng([work.seed, work.step, layer, 1])
    c = work.dest_gpu_skew
    z_E = np.sqrt(1.0 - c) * pop.standard_normal(num_experts) + np.sqrt(c) * np.repeat(
        pop.standard_normal(world), per_gpu
    )
    if work.dest_rail_balance:
        rail_E = np.asarray(topo.rail_of_gpu)[np.arange(world) % topo.gpus_per_node].repeat(per_gpu)
        rail_mean_R = np.bincount(rail_E, weights=z_E, minlength=topo.num_rails) / np.maximum(
            np.bincount(rail_E, minlength=topo.num_rails), 1
        )
        z_E = z_E - work.dest_rail_balance * rail_mean_R[rail_E]
    tokens_W = work.tokens_per_rank(world)
    pref = np.random.default_rng([work.seed, work.step, layer, 3])
    bonus_WE = np.zeros((world, num_experts))
    if work.pref_set_size and work.pref_strength:
        chosen_WS = np.argsort(pref.random((world, num_experts)), axis=1)[:, : work.pref_set_size]
        np.put_along_axis(
            bonus_WE, chosen_WS, work.pref_strength * work.skew_of_layer()[layer], axis=1
        )
    if work.own_node_bias:
        node_of_expert_E = np.arange(num_experts) // (per_gpu * topo.gpus_per_node)
        node_of_rank_W = np.arange(world) // topo.gpus_per_node
        bonus_WE += work.own_node_bias * (node_of_expert_E[None, :] == node_of_rank_W[:, None])
    scale = _popularity_scale(
        z_E, bonus_WE, tokens_W.astype(np.float64), model.topk, work.hot_ratio_of_layer(layer)
    )
    return scale * z_E[None, :] + bonus_WE, tokens_W


def glm_air_layer_ids(
    topo: RailTopology, layer: int, work: GlmAirWorkload | None = None
) -> np.ndarray:
    """[W, T_max, K] int16 top-k ids of one layer, rows ascending, -1 rows past a rank's tokens;
    global. Deterministic."""
    work = work or GlmAirWorkload()
    log_w_WE, tokens_W = layer_model(topo, layer, work)
    weights_WE = np.exp(log_w_WE - log_w_WE.max(axis=1, keepdims=True))
    rng = np.random.default_rng([work.seed, work.step, layer, 2])
    return sample_topk_ids(weights_WE, num_tokens=tokens_W, topk=work.model.topk, rng=rng)


def glm_air_trace(topo: RailTopology, work: GlmAirWorkload | None = None) -> Trace:
    """A ``Trace`` of the synthetic routing (ids, so routing maps can be built for the exchange)."""
    work = work or GlmAirWorkload()
    layers = tuple(
        LayerTrace(layer=layer, topk_ids_WTK=glm_air_layer_ids(topo, layer, work))
        for layer in work.layer_numbers
    )
    model = work.model
    knobs = {k: v for k, v in asdict(work).items() if k not in ("model", "layers")}
    meta = TraceMeta(
        model=model.name,
        topology=topo,
        num_experts=model.num_experts,
        topk=model.topk,
        hidden_size=model.hidden_size,
        dtype=model.dtype,
        step=work.step,
        extra={"generator": "glm_air", **knobs},
    )
    return Trace(meta=meta, layers=layers)


def glm_air_demands(
    topo: RailTopology, work: GlmAirWorkload | None = None
) -> dict[int, DemandCounts]:
    """Demand counts per layer number, without building [T, E] maps (same routing as the trace)."""
    work = work or GlmAirWorkload()
    return {
        layer: demand_from_topk_ids(
            glm_air_layer_ids(topo, layer, work), topo, work.model.num_experts
        )
        for layer in work.layer_numbers
    }
