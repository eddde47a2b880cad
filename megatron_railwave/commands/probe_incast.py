"""``railwave probe-incast``: measure how the cluster's receiver ports lose goodput to k-to-1
incast, fit the flow model's alpha to it and say which kind of fabric it is.

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
from typing import Any

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]

PAPER_INCAST_ALPHA_THRESHOLD = 0.5
"""Above this alpha (a port with 3 senders under 50% goodput) the fabric is counted as lossy like
the paper's, where the flow model finds JOINT the best path on every all-pairs layer it was asked
about (docs/selector.md, Results)."""


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
    group = _args.add_measure_args(
        parser,
        warmups=1,
        repeats=5,
        warmups_help="untimed samples per k",
        repeats_help="timed samples per k",
    )
    _args.add_flag(group, "--timeout", 600.0, help="--local run limit")
    output = _args.add_output_args(parser, json="the result")
    _args.add_output_file(
        output,
        "--write-model",
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


def _local_shape(text: str) -> tuple[int, int]:
    try:
        nodes, gpus = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--local takes N,G (e.g. 4,2), got {text!r}") from None
    return nodes, gpus


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.bench.incast_probe import (
        probe_local,
        probe_torchrun,
        summarize_incast_probe,
        write_incast_model,
    )

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
        try:
            base = _common.load_model(args.base_model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--base-model: {exc}") from None
    if args.local is not None:
        nodes, gpus = _local_shape(args.local)
        probe = probe_local(
            nodes,
            gpus,
            nbytes=args.nbytes or (1 << 20),
            repeats=args.repeats,
            warmups=args.warmups,
            max_senders=args.max_senders,
            timeout_s=args.timeout,
        )
    else:
        probe = probe_torchrun(
            gpus_per_node=args.gpus_per_node,
            nbytes=args.nbytes or (64 << 20),
            repeats=args.repeats,
            warmups=args.warmups,
            max_senders=args.max_senders,
        )
        if probe.rank != 0:
            return 0
    times, nodes, gpus = probe.times, probe.nodes, probe.gpus_per_node
    nbytes, backend = probe.nbytes, probe.backend
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
            "lossy like the paper's fabric (paper-incast presets, alpha 4.9121): the flow model "
            "finds JOINT the best path there; path: auto measures it, path: joint skips the "
            "probes (docs/selector.md)"
            if lossy
            else "close to max-min like the default presets (alpha 0.0042)"
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
        write_incast_model(args.write_model, base, summary, args.base_model)
        _render.print_text(f"wrote {args.write_model}")
    return 0
