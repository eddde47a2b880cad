"""Synthetic GLM-4.5-Air routing: 45 MoE layers, 128 experts, top-8, hidden 4096, bf16.

Letters: W ranks (N nodes x G GPUs), T tokens per rank, E experts, K top-k.

The generator stands in for the paper's captured training routing. Each layer has
  * an expert popularity ``a * z_e`` (z ~ N(0, 1), fixed per layer and seed), with the scale ``a``
    solved per layer so that the expected max/mean expert load is ``hot_ratio`` (about 8);
  * a skew level in [0, 1]: the 45 layers take the levels of ``linspace(0, 1, 45)`` in a seeded
    order, so every trace has nearly balanced layers and strongly skewed ones;
  * per-rank preferences (they change with the step, like the data): each rank *focuses* on one
    node with log-weight bonus ``skew * focus_strength`` on that node's experts: its own node
    (probability ``own_node_prob``), the node of the layer's most popular expert
    (``hot_node_prob``) or a random remote one; *dispersed* ranks (probability
    ``dispersed_prob``, at least one per layer) ignore the focus and route over all nodes.
A rank focused on its own node sends almost no remote records, one focused on a remote node
about one per token, a dispersed one up to N - 1 per token: source rails become hot. Focusing on
the popular node keeps the hottest expert hot for many ranks, so the popularity scale stays
moderate (at most ``max_popularity_scale``: a token's 8 most likely experts hold about 30-70% of
its rank's routing probability, not a fixed set) while max/mean expert load stays near 8. Under
NATIVE on 4 x 8 GPUs rho_g runs from about 1 (skew 0) to 4-5 (skew 1), unrelated to the
expert-load imbalance.

Expected loads use Rosen's approximation of successive-sampling inclusion probabilities,
``p_e = 1 - exp(-lambda * w_e)`` with ``sum_e p_e = K`` per rank; tokens are drawn exactly by
``synthetic.sample_topk_ids``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..topology import RailTopology
from ..traffic import DemandCounts
from ..capture import demand_from_topk_ids
from .synthetic import sample_topk_ids
from ..capture import LayerTrace, Trace, TraceMeta

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


GLM45_AIR = ModelSpec(name="GLM-4.5-Air", first_moe_layer=1, num_moe_layers=45, num_experts=128,
                      topk=8, hidden_size=4096, dtype="bf16")


@dataclass(frozen=True, kw_only=True, slots=True)
class GlmAirWorkload:
    """Knobs of the synthetic GLM-4.5-Air routing (defaults reproduce the documented ranges)."""

    num_tokens: int = 4096
    """T, tokens per GPU per layer."""
    seed: int = 0
    """Fixes the layers' popularity and skew order; same seed and step, same trace."""
    step: int = 0
    """Training step stand-in: per-rank preferences and tokens change with it."""
    layers: tuple[int, ...] | None = None
    """Layer numbers to generate (default all MoE layers of ``model``)."""
    hot_ratio: float = 8.0
    """Target max/mean expert load of every layer."""
    focus_strength: float = 8.0
    """Log-weight bonus of a focused rank's node at skew 1."""
    own_node_prob: float = 0.6
    """Probability that a rank focuses on its own node."""
    hot_node_prob: float = 0.3
    """Probability that a rank focuses on the node of the layer's most popular expert (the rest
    focus on a random remote node)."""
    dispersed_prob: float = 0.08
    """Probability that a rank ignores the focus (routes over all nodes)."""
    max_popularity_scale: float = 2.5
    """Cap of the popularity scale a; where it binds, max/mean expert load ends below hot_ratio."""
    model: ModelSpec = GLM45_AIR

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be positive, got {self.num_tokens}")
        if self.seed < 0 or self.step < 0:
            raise ValueError(f"seed and step must be >= 0, got seed={self.seed} step={self.step}")
        if self.hot_ratio < 1:
            raise ValueError(f"hot_ratio must be >= 1 (max/mean), got {self.hot_ratio}")
        for name in ("own_node_prob", "hot_node_prob", "dispersed_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.own_node_prob + self.hot_node_prob > 1:
            raise ValueError(
                f"own_node_prob + hot_node_prob must be <= 1, got {self.own_node_prob} + {self.hot_node_prob}"
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
        """Skew level in [0, 1] of every MoE layer (depends on the seed only)."""
        numbers = self.model.layer_numbers
        levels = np.random.default_rng([self.seed, 0x5EED]).permutation(np.linspace(0.0, 1.0, len(numbers)))
        return {layer: float(level) for layer, level in zip(numbers, levels)}


def _inclusion_WE(log_w_WE: np.ndarray, topk: int) -> np.ndarray:
    """Rosen's approximation of per-rank inclusion probabilities (rows sum to K)."""
    w = np.exp(log_w_WE - log_w_WE.max(axis=1, keepdims=True))
    lo, hi = np.full(w.shape[0], 1e-12), np.full(w.shape[0], 1e12)
    for _ in range(50):  # geometric bisection on lambda (1e-12..1e12), vectorised over ranks
        mid = np.sqrt(lo * hi)
        low = (1.0 - np.exp(-mid[:, None] * w)).sum(axis=1) < topk
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return 1.0 - np.exp(-hi[:, None] * w)


def _popularity_scale(z_E: np.ndarray, bonus_WE: np.ndarray, topk: int, target: float,
                      cap: float) -> float:
    """Scale a with expected max/mean expert load of exp(a z + bonus) equal to ``target``."""
    def ratio(a: float) -> float:
        load_E = _inclusion_WE(a * z_E[None, :] + bonus_WE, topk).sum(axis=0)
        return float(load_E.max() / load_E.mean())

    lo, hi = 0.0, cap
    if ratio(hi) < target:  # unreachable under the cap: take the cap
        return hi
    for _ in range(24):  # 8 / 2**24: far below the sampling noise
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def _layer_weights(topo: RailTopology, work: GlmAirWorkload, layer: int, skew: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, float]:
    model, world, n = work.model, topo.world_size, topo.num_nodes
    z_E = np.random.default_rng([work.seed, layer, 1]).standard_normal(model.num_experts)
    node_of_expert_E = np.arange(model.num_experts) // (model.num_experts // n)
    node_of_rank_W = np.arange(world) // topo.gpus_per_node
    hot_node = int(node_of_expert_E[np.argmax(z_E)])
    u_W = rng.random(world)
    remote_W = (node_of_rank_W + rng.integers(1, max(n, 2), world)) % n
    focus_W = np.where(u_W < work.own_node_prob, node_of_rank_W,
                       np.where(u_W < work.own_node_prob + work.hot_node_prob, hot_node, remote_W))
    if n == 1:
        focus_W[:] = 0
    dispersed_W = rng.random(world) < work.dispersed_prob
    dispersed_W[rng.integers(world)] = True  # someone always sends everywhere: the hot rail
    strength_W = np.where(dispersed_W, 0.0, skew * work.focus_strength)
    bonus_WE = strength_W[:, None] * (node_of_expert_E[None, :] == focus_W[:, None])
    scale = _popularity_scale(z_E, bonus_WE, model.topk, work.hot_ratio, work.max_popularity_scale)
    log_w_WE = scale * z_E[None, :] + bonus_WE
    return np.exp(log_w_WE - log_w_WE.max(axis=1, keepdims=True)), scale


def glm_air_layer_ids(topo: RailTopology, layer: int, work: GlmAirWorkload | None = None) -> np.ndarray:
    """[W, T, K] int16 top-k ids of one layer, rows ascending; global. Deterministic."""
    work = work or GlmAirWorkload()
    if work.model.num_experts % topo.world_size:
        raise ValueError(
            f"{work.model.name} has {work.model.num_experts} experts, not divisible by the "
            f"{topo.world_size} ranks of topology {topo.name!r}"
        )
    skew = work.skew_of_layer()[layer]
    rng = np.random.default_rng([work.seed, work.step, layer, 2])
    weights_WE, _ = _layer_weights(topo, work, layer, skew, rng)
    return sample_topk_ids(weights_WE, num_tokens=work.num_tokens, topk=work.model.topk, rng=rng)


def glm_air_trace(topo: RailTopology, work: GlmAirWorkload | None = None) -> Trace:
    """A ``Trace`` of the synthetic routing (ids, so routing maps can be built for the exchange)."""
    work = work or GlmAirWorkload()
    layers = tuple(LayerTrace(layer=layer, topk_ids_WTK=glm_air_layer_ids(topo, layer, work))
                   for layer in work.layer_numbers)
    model = work.model
    knobs = {k: v for k, v in asdict(work).items() if k not in ("model", "layers")}
    meta = TraceMeta(model=model.name, topology=topo, num_experts=model.num_experts, topk=model.topk,
                     hidden_size=model.hidden_size, dtype=model.dtype, step=work.step,
                     extra={"generator": "glm_air", **knobs})
    return Trace(meta=meta, layers=layers)


def glm_air_demands(topo: RailTopology, work: GlmAirWorkload | None = None) -> dict[int, DemandCounts]:
    """Demand counts per layer number, without building [T, E] maps (same routing as the trace)."""
    work = work or GlmAirWorkload()
    return {layer: demand_from_topk_ids(glm_air_layer_ids(topo, layer, work), topo, work.model.num_experts)
            for layer in work.layer_numbers}
