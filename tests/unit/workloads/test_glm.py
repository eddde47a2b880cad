"""Synthetic GLM-4.5-Air routing: shape, determinism, expert-load and source-rail skew ranges."""

import numpy as np
import pytest

from megatron_railwave.planner import build_plan
from megatron_railwave.workloads import (
    GLM45_AIR,
    GlmAirWorkload,
    glm_air_demands,
    glm_air_layer_ids,
    glm_air_trace,
)
from megatron_railwave.topology import RailTopology

TOPO = RailTopology(num_nodes=4, gpus_per_node=8)


def test_glm_air_trace_shape_and_meta():
    trace = glm_air_trace(TOPO, GlmAirWorkload(num_tokens=32, layers=(1, 45)))
    assert trace.layer_ids == (1, 45)
    assert trace.layers[0].topk_ids_WTK.shape == (32, 32, 8)
    assert (trace.meta.model, trace.meta.num_experts, trace.meta.topk, trace.meta.hidden_size,
            trace.meta.dtype) == ("GLM-4.5-Air", 128, 8, 4096, "bf16")
    assert trace.meta.record_bytes == 8192
    assert GLM45_AIR.layer_numbers == tuple(range(1, 46))


def test_glm_air_is_deterministic_per_seed_and_step():
    work = GlmAirWorkload(num_tokens=64, layers=(7,))
    a = glm_air_layer_ids(TOPO, 7, work)
    assert np.array_equal(a, glm_air_layer_ids(TOPO, 7, work))
    other_step = GlmAirWorkload(num_tokens=64, layers=(7,), step=1)
    assert not np.array_equal(a, glm_air_layer_ids(TOPO, 7, other_step))
    # The demand path uses the same routing as the trace path.
    demand = glm_air_demands(TOPO, work)[7]
    assert demand.records_WNM.equal(glm_air_trace(TOPO, work).demand(7).records_WNM)


def test_glm_air_skew_spans_layers():
    # 45 layers x 32 GPUs x 256 tokens: rho_g under NATIVE from ~1 to well above 3, while
    # every layer's max/mean expert load stays near 8.
    demands = glm_air_demands(TOPO, GlmAirWorkload(num_tokens=256))
    assert list(demands) == list(range(1, 46))
    rho = [build_plan(d, TOPO, "native").stats(record_bytes=8192).rho_g for d in demands.values()]
    load = [d.experts_WE.sum(dim=0).double() for d in demands.values()]
    ratio = [float(v.max() / v.mean()) for v in load]
    assert min(rho) < 1.15 and max(rho) > 4.0
    assert sum(r > 3.0 for r in rho) >= 5
    assert 7.0 < min(ratio) and max(ratio) < 9.0


def test_glm_air_workload_validation():
    with pytest.raises(ValueError, match=r"layers \[0, 46\] are not MoE layers of GLM-4.5-Air \(1..45\)"):
        GlmAirWorkload(layers=(0, 3, 46))
    with pytest.raises(ValueError, match=r"own_node_prob must be in \[0, 1\], got 1.5"):
        GlmAirWorkload(own_node_prob=1.5)
    with pytest.raises(ValueError, match=r"own_node_prob \+ hot_node_prob must be <= 1, got 0.8 \+ 0.3"):
        GlmAirWorkload(own_node_prob=0.8, hot_node_prob=0.3)
    with pytest.raises(ValueError, match=r"not divisible by the 48 ranks"):
        glm_air_layer_ids(RailTopology(num_nodes=6, gpus_per_node=8), 1)
