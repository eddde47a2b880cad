"""First hardware run of the DeepEP backend: one rank of a multi-node job (torchrun, NCCL).

NOT YET RUN ON HARDWARE. On a lent rail cluster (>= 2 nodes x 8 GPUs, DeepEP 2.1 installed on
every node) launch it on every node with ``scripts/deepep_hardware_check.sh``. Per rank it

1. builds the torch backend and the DeepEP backend (``exchange.build_exchange``) on the EP group
   of all ranks (EP rank e on node e // G as local GPU e % G: the node-major order DeepEP assumes);
2. runs one layer, forward and backward, per (backend, path) with the same seeded routing
   (GLM-4.5-Air shape by default: T = 4096, H = 4096 bf16, E = 128, top-8) and experts
   ``y = tokens * probs`` (so out = hidden * probs.sum(-1), checked too);
3. checks bitwise equality: every DeepEP path and every torch path against torch NATIVE
   (outputs, input gradients, probs gradients);
4. times each variant (forward + backward of dispatch and combine, the count exchange and
   planning included; ``--samples`` rounds, variants interleaved round-robin, each sample the
   slowest rank), next to Megatron's ``alltoall`` dispatcher when megatron-core imports;
5. writes ``$OUT/deepep_hardware.json`` on rank 0 and exits 1 if any equality fails.

``--device cpu --deepep-buffer fake`` runs the same script on gloo with the fake Buffer of
``megatron_railwave.testing`` (passed as ``build_exchange(..., deepep_api=...)``; a smoke test of
the script itself: ``torchrun --nproc-per-node 4 scripts/deepep_hardware_check.py --device
cpu --deepep-buffer fake --gpus-per-node 2 --tokens 64 --hidden 256 --experts 8 --topk 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_railwave.exchange import (  # noqa: E402
    build_exchange,
    build_rail_groups,
    destroy_deepep_buffers,
)
from megatron_railwave.names import ROUTES  # noqa: E402
from megatron_railwave.topology import RailTopology  # noqa: E402

PATHS = tuple(map(str, ROUTES))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/deepep_hw"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--deepep-buffer",
        choices=["real", "fake"],
        default="real",
        help="real: the deep_ep wheel; fake: the CPU fake of megatron_railwave.testing (gloo)",
    )
    p.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-sms", type=int, default=20)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--no-alltoall", action="store_true", help="skip Megatron's alltoall dispatcher")
    return p.parse_args()


def rank_inputs(args, rank: int, device: torch.device):
    """(hidden [T, H], probs [T, E] float32, routing [T, E] bool, grad [T, H]), seeded by rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    scores = torch.rand(args.tokens, args.experts, generator=gen)
    routing = torch.zeros_like(scores, dtype=torch.bool).scatter_(
        1, scores.topk(args.topk, dim=1).indices, True
    )
    probs = torch.softmax(torch.randn(args.tokens, args.experts, generator=gen), dim=1) * routing
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(DTYPES[args.dtype])
    grad = torch.randn(args.tokens, args.hidden, generator=gen).to(DTYPES[args.dtype])
    return tuple(t.to(device) for t in (hidden, probs, routing, grad))


def railwave_variant(exchange, path: str):
    def run(hidden, probs, routing):
        layer = exchange.gather_demand(hidden, probs, routing)
        d = exchange.dispatch(
            hidden,
            probs,
            routing,
            exchange.prepare(layer, exchange.plan(layer, path), hidden, probs),
        )
        return exchange.combine(d.tokens * d.probs.unsqueeze(1).to(d.tokens.dtype), d.handle)

    return run


def alltoall_variant(args, world: int):
    if args.device == "cpu":  # the CPU smoke run: Megatron-Core needs the package's CPU shims
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

        apply_megatron_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=1,
        ffn_hidden_size=args.hidden,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=world,
        tensor_model_parallel_size=1,
        params_dtype=DTYPES[args.dtype],
        bf16=args.dtype == "bf16",
        use_cpu_initialization=args.device == "cpu",
        moe_permute_fusion=False,
        moe_grouped_gemm=False,
        add_bias_linear=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    e_loc, rank = args.experts // world, dist.get_rank()
    disp = MoEAlltoAllTokenDispatcher(
        e_loc,
        list(range(rank * e_loc, (rank + 1) * e_loc)),
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )

    def run(hidden, probs, routing):
        x, p = disp.dispatch_preprocess(hidden, routing, probs)
        x, p = disp.token_dispatch(x, p)
        x, _, p = disp.dispatch_postprocess(x, p)
        y = disp.token_combine(disp.combine_preprocess(x * p.unsqueeze(1).to(x.dtype)))
        return disp.combine_postprocess(y)

    return run


def run_once(fn, inputs):
    hidden, probs, routing, grad = inputs
    hidden, probs = hidden.detach().requires_grad_(True), probs.detach().requires_grad_(True)
    out = fn(hidden, probs, routing)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), hidden.grad, probs.grad


def start_process_group(device_kind: str) -> tuple[torch.device, int, int]:
    """(device, rank, world) of this torchrun rank: its GPU (LOCAL_RANK) under NCCL, or the CPU
    under gloo."""
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if device_kind == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def main() -> int:
    args = parse_args()
    device, rank, world = start_process_group(args.device)
    topo = RailTopology(num_nodes=world // args.gpus_per_node, gpus_per_node=args.gpus_per_node)
    groups = build_rail_groups(None, topo, timeout_s=300)
    common = dict(
        num_experts=args.experts,
        topk=args.topk,
        hidden_size=args.hidden,
        hidden_dtype=DTYPES[args.dtype],
    )
    deepep_api = None  # the wheel
    if args.deepep_buffer == "fake":
        from megatron_railwave.testing.deepep_fake import fake_deepep_api

        deepep_api = fake_deepep_api(topo.gpus_per_node)
    exchanges = {
        "torch": build_exchange(topo, groups, backend="torch", **common),
        "deepep": build_exchange(
            topo,
            groups,
            backend="deepep",
            deepep_api=deepep_api,
            deepep_num_sms=args.num_sms,
            **common,
        ),
    }
    variants = {f"{b}/{p}": railwave_variant(ex, p) for b, ex in exchanges.items() for p in PATHS}
    if not args.no_alltoall:
        try:
            variants["alltoall"] = alltoall_variant(args, world)
        except ImportError as exc:
            print(f"rank {rank}: Megatron's alltoall skipped ({exc})", flush=True)
    inputs = rank_inputs(args, rank, device)

    results = {name: run_once(fn, inputs) for name, fn in variants.items()}
    base = results["torch/native"]
    expected = inputs[0].float() * inputs[1].sum(dim=1, keepdim=True)
    equal = {
        name: all(torch.equal(a, b) for a, b in zip(res, base))
        for name, res in results.items()
        if name != "alltoall"
    }
    max_err = {
        name: float((res[0].float() - expected).abs().max()) for name, res in results.items()
    }
    flags = torch.tensor([int(v) for v in equal.values()], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    equal = dict(zip(equal, (bool(v) for v in flags.tolist())))

    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmups + args.samples):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_once(variants[name], inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = torch.tensor([(time.perf_counter() - t0) * 1e3], device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            if i >= args.warmups:
                times[name].append(float(ms))
    if rank == 0:
        report = {
            "layout": {"nodes": topo.num_nodes, "gpus_per_node": topo.gpus_per_node, **vars(args)},
            "env": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "deepep_buffer": args.deepep_buffer,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            },
            "bitwise_equal_to_torch_native": equal,
            "max_abs_err_vs_hidden_times_probs": max_err,
            "median_ms_forward_backward": {n: statistics.median(v) for n, v in times.items()},
            "samples_ms": times,
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "deepep_hardware.json").write_text(json.dumps(report, indent=1))
        for name in names:
            print(
                f"{name:14s} {report['median_ms_forward_backward'][name]:9.3f} ms  "
                f"equal={equal.get(name, '-')}  max_err={max_err[name]:.3g}",
                flush=True,
            )
    ok = all(equal.values())
    dist.barrier()
    # The DeepEP Buffer (explicitly_destroy=True) goes before its process group: a Buffer alive
    # past destroy_process_group() is a known teardown hang.
    destroy_deepep_buffers()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
