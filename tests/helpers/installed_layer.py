"""A 2-rank CPU MoE layer run from an INSTALLED megatron-railwave (tests/integration/
test_install.py).

Run as a script by the python of a venv that has the wheel, from a folder outside the
repository: ``python installed_layer.py CLUSTER OUT.json``. It imports nothing from the checkout
(the test copies this file into an empty folder first); the CPU shims and the launcher are the
installed package's own. Two gloo processes build a real Megatron-Core MoELayer (EP 2,
SequentialMLP) with ``moe_token_dispatcher_type='railwave'`` after
``install({"cluster": CLUSTER})``, then the same layer with Megatron's ``alltoall`` and the same
weights, one forward and backward each.

OUT.json: per rank, the installed package's file, the dispatcher's topology (name, N, G),
whether the compiled CPU ops served the layer, the output's largest magnitude and the largest
differences to ``alltoall`` of the output [S, B, H] and of the input's gradient [S, B, H].
"""

from __future__ import annotations

import json
import sys

SEQ, BATCH, HIDDEN, FFN, EXPERTS, TOPK = 8, 2, 16, 32, 4, 2


def _layer(world: int, kind: str):  # noqa: ANN202 - a Megatron MoELayer
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=kind,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world,
        tensor_model_parallel_size=1,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    kwargs = {"config": config, "layer_number": 1, "pg_collection": pgs}
    # A ModuleSpec in Megatron-Core 0.15, a functools.partial builder in 0.19.
    layer = build_module(spec, **kwargs) if isinstance(spec, ModuleSpec) else spec(**kwargs)
    layer.set_layer_number(1)
    return layer


def _forward_backward(layer, x, weight):  # noqa: ANN001, ANN202
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def rank_main(rank: int, world: int, cluster: str) -> dict:
    import megatron_railwave
    from megatron_railwave.lab.bench.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import torch
    from megatron.core import parallel_state

    from megatron_railwave import ops

    megatron_railwave.install({"cluster": cluster, "path": "joint", "metrics": False})
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    try:
        gen = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
        weight = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
        torch.manual_seed(0)
        railwave = _layer(world, "railwave")
        alltoall = _layer(world, "alltoall")
        alltoall.load_state_dict(railwave.state_dict())
        out_rw, grad_rw = _forward_backward(railwave, x, weight)
        out_a2a, grad_a2a = _forward_backward(alltoall, x, weight)
        topo = railwave.token_dispatcher.topology
        return {
            "package_file": megatron_railwave.__file__,
            "topology": [topo.name, topo.num_nodes, topo.gpus_per_node],
            "compiled_cpu_ops": ops.compiled_for(torch.device("cpu")),
            "output_abs_max": float(out_rw.abs().max()),
            "max_output_diff": float((out_rw - out_a2a).abs().max()),
            "max_input_grad_diff": float((grad_rw - grad_a2a).abs().max()),
        }
    finally:
        parallel_state.destroy_model_parallel()


def main() -> None:
    cluster, out = sys.argv[1], sys.argv[2]
    from megatron_railwave.lab.bench.launch import run_gloo_processes

    results = run_gloo_processes(rank_main, 2, cluster, timeout_s=300.0)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
