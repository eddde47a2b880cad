"""A 2-rank CPU MoE layer run from an INSTALLED megatron-railwave (tests/integration/
test_install.py).

Run as a script by the python of a venv that has the wheel, from a folder outside the
repository that holds only this file and a copy of ``moe_layer.py`` (the test harness that
builds a real Megatron-Core MoELayer on CPU ranks): ``python installed_layer.py CLUSTER
OUT.json``. Nothing comes from the checkout; the CPU shims and the launcher are the installed
package's own. Two gloo processes run the layer (EP 2, SequentialMLP, canonical weights) with
``moe_token_dispatcher_type='railwave'`` after ``install({"cluster": CLUSTER})``, then with
Megatron's ``alltoall``, one forward and backward each.

OUT.json: per rank, the installed package's file, the topology the dispatcher built (name, N,
G), whether the compiled CPU ops served the layer, the output's largest magnitude and the largest
differences to ``alltoall`` of the output [S, B, H] and of the input's gradient [S, B, H].
"""

from __future__ import annotations

import json
import sys

LAYER = dict(num_experts=4, topk=2, hidden=16, ffn_hidden=32, seq_len=8, micro_batch=2, seed=3)


def rank_main(rank: int, world: int, cluster: str) -> dict:
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()  # before Megatron-Core's first import (the dispatcher's)
    import torch
    from moe_layer import build_and_run_moe_layer  # the copy beside this file

    import megatron_railwave
    from megatron_railwave import ops
    from megatron_railwave.dispatcher import RailWaveTokenDispatcher

    built = []
    original_init = RailWaveTokenDispatcher.__init__

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        original_init(self, *args, **kwargs)
        built.append([self.topology.name, self.topology.num_nodes, self.topology.gpus_per_node])

    RailWaveTokenDispatcher.__init__ = init
    megatron_railwave.install({"cluster": cluster, "path": "joint", "metrics": False})
    railwave = build_and_run_moe_layer(rank, world, "railwave", **LAYER)
    alltoall = build_and_run_moe_layer(rank, world, "alltoall", **LAYER)
    return {
        "package_file": megatron_railwave.__file__,
        "topology": built,
        "compiled_cpu_ops": ops.compiled_for(torch.device("cpu")),
        "output_abs_max": float(abs(railwave["output"]).max()),
        "max_output_diff": float(abs(railwave["output"] - alltoall["output"]).max()),
        "max_input_grad_diff": float(abs(railwave["input_grad"] - alltoall["input_grad"]).max()),
    }


def main() -> None:
    cluster, out = sys.argv[1], sys.argv[2]
    from megatron_railwave.lab.bench.launch import run_gloo_processes

    results = run_gloo_processes(rank_main, 2, cluster, timeout_s=300.0)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
