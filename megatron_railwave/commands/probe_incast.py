"""``railwave probe-incast``: measure how the cluster's receiver ports lose goodput to k-to-1
incast, fit the flow model's alpha to it and say which kind of fabric the selector files assume.

Letters: N nodes, G GPUs per node, W = N * G ranks.

Two ways to run it (``bench.incast_probe`` has the method):
  * on a cluster, one process per GPU under ``torchrun`` (``--torchrun``): the default process
    group from the environment, NCCL when CUDA is there (each rank on ``LOCAL_RANK``'s device),
    else gloo; rank r is GPU r % G of node r // G. Rank 0 prints and writes. Not yet run on
    hardware;
  * ``--local N,G``: W gloo processes on this machine (loopback has no rails: a mechanics check).

JSON (``--json``, schema ``railwave.incast_probe/1``): ``nodes``, ``gpus_per_node``, ``backend``,
``nbytes``, ``port_gbps``, ``alpha``, ``fitted_senders``, ``sender_limited``,
``goodput_at_3_senders``, ``rows`` (per k: ``senders``, ``median_s``, ``port_goodput_gbps``,
``slowdown``) and ``samples_s`` (per k). ``--write-model`` writes a netmodel YAML with the measured
alpha (k_free 1, k_sat 2) on top of ``--base-model``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_railwave.commands import _common, _outputs, _render

__all__ = ["register", "run"]

PAPER_INCAST_ALPHA_THRESHOLD = 0.5
"""Above this alpha (a port with 3 senders under 50% goodput) the fabric is counted as lossy like
the paper's: the selector files calibrated on the about max-min presets do not hold there."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe-incast",
        help="measure k-to-1 incast goodput on the cluster and fit the flow model's alpha",
        description="Nodes 1..k send to node 0 at once on every rail (k = 1..N-1); the slowdown "
        "beyond "
        "max-min sharing gives the flow model's incast alpha for this fabric.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--torchrun",
        action="store_true",
        help="run in the process group torchrun set up (one process per GPU)",
    )
    where.add_argument(
        "--local", default=None, metavar="N,G", help="N x G gloo processes on this machine"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="with --torchrun: GPUs per node (default LOCAL_WORLD_SIZE)",
    )
    parser.add_argument(
        "--nbytes",
        type=int,
        default=None,
        help="bytes each sending GPU sends per sample (default 64 MiB with --torchrun, 1 MiB "
        "local)",
    )
    parser.add_argument(
        "--max-senders",
        type=int,
        default=4,
        metavar="K",
        help="largest k (default 4: the fit uses k <= 3, one more shows the saturation; node 0 "
        "holds K receive buffers of --nbytes per GPU)",
    )
    parser.add_argument(
        "--port-gbps",
        type=float,
        default=None,
        help="a receiver port's line rate in Gb/s (e.g. 400): the max-min reference when one "
        "sender cannot fill the port alone; warns when it does not",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per k (default 5)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed samples per k (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="--local run limit (default 600)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument(
        "--write-model",
        default=None,
        metavar="YAML",
        help="write a netmodel config with the measured alpha (on top of --base-model)",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        metavar="YAML",
        help="netmodel config whose other parameters --write-model keeps (e.g. "
        "h20_4x8, a packaged name; default the built-in NetModelConfig, the H800 values)",
    )
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("json", "write_model"))


def _local_shape(text: str) -> tuple[int, int]:
    try:
        nodes, gpus = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--local takes N,G (e.g. 4,2), got {text!r}") from None
    return nodes, gpus


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.bench.incast_probe import incast_probe_worker, summarize_incast_probe

    if args.repeats < 1 or args.warmups < 0 or (args.nbytes is not None and args.nbytes < 1):
        raise ValueError(
            f"need --repeats >= 1, --warmups >= 0, --nbytes >= 1, got {args.repeats}, "
            f"{args.warmups}, {args.nbytes}"
        )
    if (
        args.max_senders < 2
        or not args.timeout > 0
        or (args.port_gbps is not None and not args.port_gbps > 0)
    ):
        raise ValueError(
            f"need --max-senders >= 2, --timeout > 0 and --port-gbps > 0, got {args.max_senders}, "
            f"{args.timeout}, {args.port_gbps}"
        )
    if args.gpus_per_node is not None and (args.local is not None or args.gpus_per_node < 1):
        raise ValueError(
            f"--gpus-per-node is for --torchrun and must be >= 1 (--local takes N,G), got "
            f"{args.gpus_per_node}"
        )
    base = None
    if args.write_model:  # fail before any measurement on a bad base
        from megatron_railwave.lab.netmodel import NetModelConfig, load_netmodel_config

        if args.base_model is None:
            base = NetModelConfig()
        else:
            try:
                base = load_netmodel_config(args.base_model)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--base-model: {exc}") from None
    if args.local is not None:
        from megatron_railwave.lab.bench.launch import run_gloo_processes

        nodes, gpus = _local_shape(args.local)
        if nodes < 3 or gpus < 1:
            raise ValueError(
                f"--local needs N >= 3 nodes (k = 2 senders at least) and G >= 1, got {args.local}"
            )
        nbytes = args.nbytes or (1 << 20)
        times = run_gloo_processes(
            incast_probe_worker,
            nodes * gpus,
            gpus,
            nbytes,
            args.repeats,
            args.warmups,
            args.max_senders,
            timeout_s=args.timeout,
        )[0]
        backend = "gloo (local)"
    else:
        import torch
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "0"))
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        gpus = args.gpus_per_node or int(local_world or "0")
        if world < 1 or gpus < 1 or world % gpus or world // gpus < 3:
            raise ValueError(
                f"--torchrun needs WORLD_SIZE = N x G with N >= 3 (torchrun sets WORLD_SIZE and "
                f"LOCAL_WORLD_SIZE; or pass --gpus-per-node), got WORLD_SIZE={world}, G={gpus}"
            )
        rank_env, local_rank = (
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("LOCAL_RANK", "0")),
        )
        if local_rank != rank_env % gpus:
            # The probe's node of a rank is rank // G: it must be the machine the rank runs on.
            raise ValueError(
                f"rank {rank_env} has LOCAL_RANK {local_rank}, not rank % G = {rank_env % gpus}: "
                f"launch "
                f"one process per GPU with torchrun --nproc-per-node G so that rank r is GPU r % "
                f"G of "
                f"node r // G (G = "
                f"{gpus}{'' if local_world is None else ', LOCAL_WORLD_SIZE ' + local_world})"
            )
        nodes = world // gpus
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            nbytes = args.nbytes or (64 << 20)
            times = incast_probe_worker(
                dist.get_rank(), world, gpus, nbytes, args.repeats, args.warmups, args.max_senders
            )
            backend = dist.get_backend()
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    summary = summarize_incast_probe(times, nbytes, port_gbps=args.port_gbps)
    _render.print_table(
        f"k-to-1 incast into node 0, {nodes} x {gpus} ({backend}), {nbytes} bytes per sending GPU, "
        f"median of {args.repeats}",
        ["senders k", "median ms", "port goodput Gb/s", "slowdown vs max-min"],
        [
            [r["senders"], r["median_s"] * 1e3, r["port_goodput_gbps"], r["slowdown"]]
            for r in summary["rows"]
        ],
    )
    lossy = summary["alpha"] > PAPER_INCAST_ALPHA_THRESHOLD
    _render.print_text(
        f"alpha = {summary['alpha']:.4f} from k = {summary['fitted_senders']} (a port with 3 "
        f"senders at "
        f"{summary['goodput_at_3_senders']:.1%} goodput); "
        + (
            "lossy like the paper's fabric (paper-incast presets, alpha 4.9121): the shipped "
            "selector files assume "
            "a fabric without incast loss; set path: joint or calibrate on this alpha "
            "(docs/selector.md)"
            if lossy
            else "close to max-min like the default presets (alpha 0.0042), which the shipped "
            "selector files assume"
        )
        + (
            ""
            if backend == "nccl"
            else f"; {backend} on CPU has no rails: this run checks the mechanics only"
        )
    )
    if summary["sender_limited"]:
        _render.print_text(
            f"warning: one sender reached {summary['rows'][0]['port_goodput_gbps']:.1f} of "
            f"{args.port_gbps:g} Gb/s: the port is not full with one sender, so the slowdowns use "
            "the line rate as the max-min reference; a larger --nbytes may fill it"
        )
    out: dict[str, Any] = {
        "schema": "railwave.incast_probe/1",
        "nodes": nodes,
        "gpus_per_node": gpus,
        "backend": backend,
        **summary,
        "samples_s": {str(k): v for k, v in times.items()},
    }
    if args.json:
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    if args.write_model:
        _write_model(args.write_model, base, summary, args.base_model)
        _render.print_text(f"wrote {args.write_model}")
    return 0


def _write_model(path: str, base: Any, summary: dict[str, Any], base_path: str) -> None:
    import dataclasses

    import yaml

    model = dataclasses.replace(
        base, alpha=round(summary["alpha"], 4), k_free=1, k_sat=summary["k_sat"]
    )
    data = {
        "model": model.to_dict(),
        "calibration": {
            "method": "railwave probe-incast (k-to-1 slowdown beyond max-min, least squares)",
            "base_model": base_path or "built-in NetModelConfig",
            "nbytes": summary["nbytes"],
            "port_gbps": summary["port_gbps"],
            "fitted_senders": summary["fitted_senders"],
            "rows": summary["rows"],
        },
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# Network model parameters with the incast alpha measured by railwave probe-incast.\n"
        )
        yaml.safe_dump(data, f, sort_keys=False)
