"""Smoke run for the first multi-GPU machine: one rank of a 2-node x 8-GPU job (torchrun, NCCL).

NOT YET RUN ON HARDWARE. Launch it on both nodes with ``scripts/cluster_smoke_2x8.sh``. Per rank
it builds the rail groups with a small ``timeout_s`` (default 60 s, so a hang ends as a named
error, not at the NCCL watchdog's 10 minutes) and runs ONE layer (forward and backward) per
variant, in this order:

* ``torch/<path>`` for every path of ``names.ROUTES`` (the torch backend: count exchange, node
  and rail groups);
* ``torch/joint+streamed`` and ``torch/flow-waves+streamed`` (the relay streamed into the rail
  phases, planned per call as the online selector's '+streamed' candidates are, with 2 rail
  chunks so that one wave has two rail phases; the report says whether the relay streamed);
* ``torch-fixed/joint`` (fixed-capacity mode, ``max_tokens_per_rank`` = T: status words, no
  host sync);
* ``deepep/<path>`` for every path when ``deep_ep`` imports (``--deepep-buffer real``) or
  with the CPU fake (``--deepep-buffer fake``); ``none`` skips DeepEP.

Every variant is checked bitwise against ``torch/native`` (output, input and probs gradients;
all-reduced, so every rank agrees). The first variant that raises stops the run (its error text
is kept: a failed collective leaves the groups unusable). The DeepEP Buffer is destroyed
(``destroy_deepep_buffers``) before ``destroy_process_group``. Rank 0 writes
``<out>/cluster_smoke.json``; exit status 0 when every variant ran and matched, 1 otherwise.

``--dry-run`` prints the variants and the layout as JSON without starting torch.distributed
(the argument test on CPU, tests/unit/test_cluster_smoke_script.py). A CPU smoke of the script
itself: ``torchrun --nproc-per-node 4 scripts/cluster_smoke_2x8.py --device cpu --gpus-per-node
2 --deepep-buffer fake --tokens 64 --hidden 256 --experts 8 --topk 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The DeepEP hardware check's seeded inputs, paths and dtypes (this folder is sys.path[0]).
from deepep_hardware_check import DTYPES, PATHS, rank_inputs, start_process_group  # noqa: E402

from megatron_railwave.names import parse_candidate  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/cluster_smoke"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--deepep-buffer", choices=["real", "fake", "none"], default="real")
    p.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 16)))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--dry-run", action="store_true", help="print the variants, start nothing")
    args = p.parse_args(argv)
    if args.gpus_per_node < 1 or args.world_size % args.gpus_per_node:
        p.error(
            f"--world-size {args.world_size} is not a multiple of --gpus-per-node "
            f"{args.gpus_per_node}; launch whole nodes"
        )
    if args.experts % args.world_size:
        p.error(f"--experts {args.experts} is not divisible by the EP size {args.world_size}")
    if not 0 < args.timeout_s <= 600:
        p.error(f"--timeout-s {args.timeout_s} must be in (0, 600]: a smoke run must end")
    return args


def variant_names(args: argparse.Namespace) -> list[str]:
    # The streamed relay (torch only), planned per call as the online selector's '+streamed'
    # candidates are; 2 rail chunks, so that 2 nodes (one wave) have rail phases to stream into.
    streamed = [f"torch/{p}+streamed" for p in ("joint", "flow-waves")]
    names = [f"torch/{p}" for p in PATHS] + streamed + ["torch-fixed/joint"]
    if args.deepep_buffer != "none":
        names += [f"deepep/{p}" for p in PATHS]
    return names


def one_layer(exchange, path: str, inputs, *, fixed: bool):
    """Forward + backward of one layer (experts y = tokens * probs): ((output, hidden grad, probs
    grad), whether its plan streamed the relay)."""
    hidden, probs, routing, grad = inputs
    hidden, probs = hidden.detach().requires_grad_(True), probs.detach().requires_grad_(True)
    route, streamed = parse_candidate(path)
    if fixed:
        handle = exchange.prepare_capacity(hidden, probs, routing, route)
    else:
        layer = exchange.gather_demand(hidden, probs, routing, delivery_counts=route.min_max)
        plan = exchange.plan(layer, route, streamed=True if streamed else None)
        streamed = plan.streamed
        handle = exchange.prepare(layer, plan, hidden, probs)
    d = exchange.dispatch(hidden, probs, routing, handle)
    out = exchange.combine(d.tokens * d.probs.unsqueeze(1).to(d.tokens.dtype), d.handle)
    (out.float() * grad.float()).sum().backward()
    return (out.detach(), hidden.grad, probs.grad), streamed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = variant_names(args)
    layout = {
        "nodes": args.world_size // args.gpus_per_node,
        "gpus_per_node": args.gpus_per_node,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "experts": args.experts,
        "topk": args.topk,
        "timeout_s": args.timeout_s,
    }
    if args.dry_run:
        print(json.dumps({"dry_run": True, "layout": layout, "variants": names}))
        return 0

    import torch.distributed as dist

    from megatron_railwave.exchange import (
        build_exchange,
        build_rail_groups,
        destroy_deepep_buffers,
    )
    from megatron_railwave.planner import PlanOptions
    from megatron_railwave.topology import RailTopology

    device, rank, world = start_process_group(args.device)
    if world != args.world_size:
        print(f"rank {rank}: WORLD_SIZE is {world}, --world-size {args.world_size}", flush=True)
    topo = RailTopology(num_nodes=world // args.gpus_per_node, gpus_per_node=args.gpus_per_node)
    groups = build_rail_groups(None, topo, timeout_s=args.timeout_s)
    common = dict(
        num_experts=args.experts,
        topk=args.topk,
        hidden_size=args.hidden,
        hidden_dtype=DTYPES[args.dtype],
        timeout_s=args.timeout_s,
    )
    inputs = rank_inputs(args, rank, device)
    results: dict[str, dict] = {}
    base = None
    for name in names:
        backend, path = name.split("/")
        t0 = time.perf_counter()
        try:
            if backend == "deepep":
                api = None
                if args.deepep_buffer == "fake":
                    from megatron_railwave.testing.deepep_fake import fake_deepep_api

                    api = fake_deepep_api(topo.gpus_per_node)
                ex = build_exchange(topo, groups, backend="deepep", deepep_api=api, **common)
            else:
                capacity = args.tokens if backend == "torch-fixed" else None
                chunks = 2 if path.endswith("+streamed") else 1
                ex = build_exchange(
                    topo,
                    groups,
                    backend="torch",
                    max_tokens_per_rank=capacity,
                    options=PlanOptions(chunks=chunks),
                    **common,
                )
            got, relay_streamed = one_layer(ex, path, inputs, fixed=backend == "torch-fixed")
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the report names what failed, then stops
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: {name} failed: {type(exc).__name__}: {exc}", flush=True)
            break
        base = got if base is None else base
        equal = torch.tensor(
            [int(all(torch.equal(a, b) for a, b in zip(got, base)))], device=device
        )
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        seconds = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        results[name] = {
            "ok": True,
            "bitwise_equal_to_torch_native": bool(equal.item()),
            "seconds_slowest_rank": float(seconds.item()),
            "relay_streamed": relay_streamed,
        }
    ok = len(results) == len(names) and all(
        r["ok"] and r["bitwise_equal_to_torch_native"] for r in results.values()
    )
    if rank == 0:
        report = {
            "schema": "railwave.cluster_smoke/1",
            "layout": layout,
            "env": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "deepep_buffer": args.deepep_buffer,
            },
            "variants": results,
            "not_run": [n for n in names if n not in results],
            "ok": ok,
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cluster_smoke.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report), flush=True)
    # The DeepEP Buffer first (explicitly_destroy=True), then the process group: a Buffer alive
    # past destroy_process_group() is a known teardown hang.
    destroy_deepep_buffers()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
