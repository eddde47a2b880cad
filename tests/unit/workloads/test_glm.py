"""Synthetic GLM-4.5-Air routing: shape, determinism, and what each knob does."""

import numpy as np
import pytest

from megatron_railwave.lab.workloads import (
    GLM45_AIR,
    GlmAirWorkload,
    collect_samples,
    glm_air_demands,
    glm_air_layer_ids,
    glm_air_trace,
    sampled_sample,
    workload_statistics,
)
from megatron_railwave.planner import build_plan
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=4, gpus_per_node=8)


def test_glm_air_trace_shape_and_meta():
    work = GlmAirWorkload(num_tokens=32, layers=(1, 45))
    trace = glm_air_trace(TOPO, work)
    assert trace.layer_ids == (1, 45)
    tokens_W = work.tokens_per_rank(32)
    ids = trace.layers[0].topk_ids_WTK
    assert ids.shape == (32, tokens_W.max(), 8)
    # Rank w has tokens_W[w] tokens; the rows after them are empty (-1), the others hold 8 experts.
    assert np.array_equal((ids >= 0).all(axis=-1).sum(axis=1), tokens_W)
    assert np.array_equal((ids < 0).all(axis=-1).sum(axis=1), tokens_W.max() - tokens_W)
    assert (
        trace.meta.model,
        trace.meta.num_experts,
        trace.meta.topk,
        trace.meta.hidden_size,
        trace.meta.dtype,
    ) == ("GLM-4.5-Air", 128, 8, 4096, "bf16")
    assert trace.meta.record_bytes == 8192
    assert trace.meta.extra["token_skew"] == work.token_skew
    assert GLM45_AIR.layer_numbers == tuple(range(1, 46))


def test_glm_air_is_deterministic_per_seed_and_step():
    work = GlmAirWorkload(num_tokens=64, layers=(7,))
    a = glm_air_layer_ids(TOPO, 7, work)
    assert np.array_equal(a, glm_air_layer_ids(TOPO, 7, work))
    for other in (
        GlmAirWorkload(num_tokens=64, layers=(7,), step=1),
        GlmAirWorkload(num_tokens=64, layers=(7,), seed=1),
    ):
        b = glm_air_layer_ids(TOPO, 7, other)
        assert a.shape != b.shape or not np.array_equal(a, b)
    # The demand path uses the same routing as the trace path.
    demand = glm_air_demands(TOPO, work)[7]
    assert demand.records_WNM.equal(glm_air_trace(TOPO, work).demand(7).records_WNM)


def test_token_counts_per_rank():
    even = GlmAirWorkload(num_tokens=300, token_skew=0.0)
    assert even.tokens_per_rank(32).tolist() == [300] * 32
    skewed = GlmAirWorkload(num_tokens=300).tokens_per_rank(4096)
    assert skewed.min() >= 1 and abs(skewed.mean() / 300 - 1) < 0.1  # mean T (s = 1.x: a 10% band)
    assert np.std(np.log(skewed)) == pytest.approx(GlmAirWorkload().token_skew, rel=0.1)
    # Per step, the same for every layer (one micro-batch passes all layers).
    assert np.array_equal(
        GlmAirWorkload(step=3).tokens_per_rank(32), GlmAirWorkload(step=3).tokens_per_rank(32)
    )
    assert not np.array_equal(
        GlmAirWorkload(step=3).tokens_per_rank(32), GlmAirWorkload(step=4).tokens_per_rank(32)
    )


def _local_share(work: GlmAirWorkload) -> float:
    local = total = 0
    for layer in work.layer_numbers:
        ids = glm_air_layer_ids(TOPO, layer, work).astype(np.int64)
        node_of_rank = (np.arange(32) // 8)[:, None, None]
        valid = ids >= 0
        local += int(((ids // 32 == node_of_rank) & valid).sum())
        total += int(valid.sum())
    return local / total


def test_locality_is_one_over_n_unless_configured():
    layers = tuple(range(1, 46, 4))
    share = _local_share(GlmAirWorkload(num_tokens=64, layers=layers))
    assert share == pytest.approx(1 / 4, abs=0.04)  # no node-limited routing: ~1/N of the choices
    assert _local_share(GlmAirWorkload(num_tokens=64, layers=layers, own_node_bias=2.0)) > 0.45


def test_varying_token_counts_raise_rho_g():
    layers = tuple(range(1, 46, 5))

    def rho(skew: float) -> float:
        demands = glm_air_demands(
            TOPO, GlmAirWorkload(num_tokens=128, layers=layers, token_skew=skew)
        )
        return float(
            np.median(
                [
                    build_plan(d, TOPO, "native").stats(record_bytes=8192).rho_g
                    for d in demands.values()
                ]
            )
        )

    even, skewed = rho(0.0), rho(GlmAirWorkload().token_skew)
    assert even < 1.5 and skewed > 3.0, (even, skewed)


def test_dest_gpu_skew_concentrates_receivers():
    # Same target max/mean expert load; c -> 1 puts the hot experts on the same GPUs, so the
    # busiest destination GPU and destination rail receive a larger share.
    layers = tuple(range(1, 46, 3))

    def busiest(c: float) -> tuple[float, float]:
        work = GlmAirWorkload(num_tokens=64, layers=layers, dest_gpu_skew=c, hot_ratio_spread=0.0)
        gpu, rail = [], []
        for layer in layers:
            load_E = sampled_sample(TOPO, layer, work).load_E
            per_gpu = load_E.reshape(32, 4).sum(axis=1)
            gpu.append(per_gpu.max() / per_gpu.sum())
            rail.append(per_gpu.reshape(4, 8).sum(axis=0).max() / per_gpu.sum())
        return float(np.median(gpu)), float(np.median(rail))

    low, high = busiest(0.0), busiest(0.8)
    assert high[0] > 1.3 * low[0] and high[1] > low[1], (low, high)


def test_dest_rail_balance_makes_the_busiest_destination_rail_lighter():
    # Same target max/mean expert load (expected counts, no draws); b = 1 takes each rail's mean
    # popularity off its 16 experts, so a hot expert's rail-mates are colder than average and the
    # busiest destination rail carries a smaller share. Placement is unchanged.
    layers = tuple(range(1, 46, 3))

    def busiest_rail(b: float) -> tuple[float, float]:
        work = GlmAirWorkload(layers=layers, dest_rail_balance=b, hot_ratio_spread=0.0)
        stats = workload_statistics(collect_samples(TOPO, work, steps=(0, 1)), TOPO)
        return stats["expert_max_mean_p50"], stats["dst_rail_share_p90"]

    (ratio_free, rail_free), (ratio_balanced, rail_balanced) = busiest_rail(0.0), busiest_rail(1.0)
    assert ratio_balanced == pytest.approx(ratio_free, rel=1e-3)
    assert rail_balanced < 0.85 * rail_free, (rail_free, rail_balanced)


def test_hot_ratio_sets_expert_load_imbalance():
    work = GlmAirWorkload(num_tokens=512, layers=(4, 17, 33), hot_ratio_spread=0.0, token_skew=0.3)
    for layer in work.layer_numbers:
        load = sampled_sample(TOPO, layer, work).load_E
        assert load.max() / load.mean() == pytest.approx(work.hot_ratio, rel=0.1)


def test_sampled_statistics_on_h20_adapters():
    # H20: GPU pairs share an adapter, so there are 4 NIC shares per node, summing to 1.
    h20 = RailTopology(
        num_nodes=4, gpus_per_node=8, adapter_of_rail=(0, 0, 1, 1, 2, 2, 3, 3), name="h20"
    )
    stats = workload_statistics(
        collect_samples(
            h20, GlmAirWorkload(num_tokens=64, layers=(2, 9)), steps=(0,), sample=sampled_sample
        ),
        h20,
    )
    shares = [stats[f"nic_share_{i}"] for i in range(1, 5)]
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)


def test_glm_air_workload_validation():
    with pytest.raises(
        ValueError, match=r"layers \[0, 46\] are not MoE layers of GLM-4.5-Air \(1..45\)"
    ):
        GlmAirWorkload(layers=(0, 3, 46))
    with pytest.raises(ValueError, match=r"dest_gpu_skew must be in \[0, 1\), got 1.0"):
        GlmAirWorkload(dest_gpu_skew=1.0)
    with pytest.raises(ValueError, match=r"dest_rail_balance must be in \[0, 1\], got 1.5"):
        GlmAirWorkload(dest_rail_balance=1.5)
    with pytest.raises(ValueError, match=r"token_skew must be >= 0, got -0.5"):
        GlmAirWorkload(token_skew=-0.5)
    with pytest.raises(ValueError, match=r"pref_set_size must be in \[0, 128\]"):
        GlmAirWorkload(pref_set_size=200)
    with pytest.raises(ValueError, match=r"not divisible by the 48 ranks"):
        glm_air_layer_ids(RailTopology(num_nodes=6, gpus_per_node=8), 1)
