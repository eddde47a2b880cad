"""``railwave sensitivity``: JOINT / baseline and RAIL / baseline over token skew x fabric x
pattern x seed (`netmodel.sensitivity`), as a table, JSON and a heatmap.

Baseline: DeepEP-like NATIVE (streamed forwarding). Fabrics: ``max-min`` (alpha 0: no goodput
lost to incast) and ``ultraep`` (the saturating incast law with alpha fitted on the paper's UltraEP
case alone, `sensitivity.fit_alpha_ultraep`, or ``--alpha``). With the UltraEP alpha the paper's
incast experiment (NATIVE, RING -> EXTREME, +67.1%) is predicted per seed on the same layers.
Per seed a ratio is of the sums over its layers; over seeds: median, P10, P90. The grid is
``lab.bench.sensitivity_grid``'s.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from megatron_railwave.lab.bench.netmodel_bench import PEERS

    parser = subparsers.add_parser(
        "sensitivity",
        help="JOINT/RAIL over the DeepEP-like baseline across token skew, fabric, pattern and "
        "seeds",
        description="Model JOINT, RAIL and the streamed NATIVE baseline on the synthetic "
        "GLM-4.5-Air routing over "
        "token skew x fabric {max-min, UltraEP-fitted incast} x pattern x seed; median and P10-P90 "
        "over seeds, the path-independent bound, the predicted incast slowdown.",
    )
    # The flags' order is the order of the JSON's "config" (every parsed flag): keep it.
    _args.add_cluster_args(parser, default="h800_4x8")
    _args.add_flag(
        parser,
        "--model",
        help="base netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8; its alpha "
        "is ignored: the fabrics "
        "set it); default the built-in NetModelConfig",
    )
    _args.add_flag(
        parser,
        "--alpha",
        help="alpha of the incast fabric",
        default_text="fitted on the paper's UltraEP case, 4 x 8 only",
    )
    _args.add_flag(
        parser,
        "--skews",
        [0.0, 0.5, 1.0, 1.46],
        type=_args.comma_floats("numbers >= 0", minimum=0.0, inclusive=True),
        metavar="S,S",
        help="token skews (std of log tokens per rank)",
        default_text="0,0.5,1,1.46",
    )
    _args.add_flag(parser, "--pattern", list(_args.ARRANGEMENTS), default_text="all")
    parser.add_argument("--seeds", type=int, default=5, help="routing seeds 0..S-1 (default 5)")
    _args.add_flag(
        parser,
        "--layers",
        [8, 36],
        type=_args.comma_ints("MoE layer numbers"),
        help="MoE layers per seed",
        default_text="8,36: fewer than the 45 to keep the grid's run time manageable",
    )
    _args.add_flag(parser, "--tokens", 2048, help="mean tokens per GPU")
    _args.add_flag(parser, "--payload-scale", "paper")
    _args.add_flag(
        parser,
        "--path-delivery",
        "after_rail",
        help="stage 3 of RAIL / JOINT: after_rail (as the exchange runs) or streamed",
    )
    _args.add_flag(
        parser,
        "--chunks",
        1,
        type=int,
        help="rail chunks per wave of the paths (PlanOptions.chunks; RAIL only with --streamed)",
    )
    parser.add_argument(
        "--streamed",
        action="store_true",
        help="the paths' relay streamed into their rail phases (PlanOptions.streamed)",
    )
    _args.add_flag(
        parser,
        "--peers",
        ["deepep-balanced", "deepep-direct", "megatron"],
        type=_args.comma_choices(PEERS + ("none",)),
        help="peers per cell (netmodel.peers; deepep-balanced = the baseline on the same tokens "
        "split equally over the ranks); 'none' to skip",
    )
    _args.add_flag(
        parser,
        "--incast-layers",
        None,
        type=_args.layer_count_or_list,
        metavar="K|L,L",
        help="layers of the incast prediction: K = the first K MoE layers, or a list; token skew "
        "1.46, every seed",
        default_text="the grid's --layers",
    )
    parser.add_argument(
        "--no-incast-prediction",
        action="store_true",
        help="skip the prediction of the paper's +67.1%% (NATIVE RING -> EXTREME)",
    )
    _args.add_output_args(
        parser,
        json="the grid, its summary and the fit",
        plot="heatmap: median (P10-P90) per cell",
    )
    _args.add_progress_arg(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.bench.netmodel_bench import RECORD_BYTES
    from megatron_railwave.lab.bench.sensitivity_grid import sensitivity_grid
    from megatron_railwave.lab.netmodel.sensitivity import fit_alpha_ultraep

    topo = _common.cluster_from_args(args)
    if args.seeds < 1 or args.tokens < 1:
        raise ValueError(f"need --seeds >= 1 and --tokens >= 1, got {args.seeds} and {args.tokens}")
    _common.glm_layers(args.layers, "--layers", default=[])
    incast_layers = _common.glm_layers(args.incast_layers, "--incast-layers", default=args.layers)
    if args.alpha is not None and args.alpha < 0:
        raise ValueError(f"--alpha must be >= 0, got {args.alpha}")
    peers = [p for p in args.peers if p != "none"]
    base = _common.load_model(args.model)
    baseline = replace(base, alpha=0.0, delivery="streamed")
    fit = None
    if args.alpha is None:
        fit = fit_alpha_ultraep(topo, baseline)
        alpha = fit.alpha
        _render.print_text(
            f"alpha fitted on UltraEP alone (streamed NATIVE vs PERM, dispatch): {alpha} "
            f"(per payload {fit.alpha_per_payload}; PERM / NATIVE at the fit "
            + ", ".join(
                f"{m:g} MiB {v:.2f}x (paper {fit.paper[m]}x)" for m, v in fit.speedup_at_fit.items()
            )
            + ")"
        )
    else:
        alpha = args.alpha
    fabrics = {"max-min": 0.0, "ultraep": alpha}
    record_bytes = RECORD_BYTES
    seeds = list(range(args.seeds))
    scale = args.payload_scale
    rows, summary, incast = sensitivity_grid(
        topo,
        base,
        baseline,
        fabrics=fabrics,
        skews=args.skews,
        seeds=seeds,
        layers=args.layers,
        patterns=args.pattern,
        tokens=args.tokens,
        payload_scale=scale,
        path_delivery=args.path_delivery,
        peers=peers,
        incast_layers=None if args.no_incast_prediction else incast_layers,
        progress=not args.no_progress,
        chunks=args.chunks,
        streamed=args.streamed,
    )
    _print(summary, incast, args)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "handler"}
        config.update(
            # As before the flags shared a type with bench: --peers as written, --payload-scale
            # as the number it stands for.
            peers=",".join(args.peers),
            topology=topo.to_dict(),
            payload_scale=scale,
            record_bytes=record_bytes,
            seeds=seeds,
            fabrics=fabrics,
            incast_layers=incast_layers,
        )
        _common.write_json(
            args.json,
            {
                "config": config,
                "model": base.to_dict(),
                "ultraep_fit": fit.to_dict() if fit else None,
                "summary": summary,
                "incast_prediction": incast,
                "rows": rows,
            },
        )
    if args.plot:
        _plot(
            summary,
            args.plot,
            f"{topo.name}: {topo.num_nodes}x{topo.gpus_per_node}, {len(seeds)} seeds x "
            f"{len(args.layers)} layers; baseline DeepEP-like NATIVE (streamed); "
            f"ultraep alpha {alpha}",
        )
    return 0


def _cell(stats: dict[str, Any]) -> str:
    return f"{stats['median']:.2f} ({stats['p10']:.2f}-{stats['p90']:.2f})"


def _print(
    summary: list[dict[str, Any]], incast: dict[str, Any] | None, args: argparse.Namespace
) -> None:
    from megatron_railwave.lab.netmodel.bounds import BOUNDS

    peers = [
        k[: -len("_over_baseline")]
        for k in summary[0]
        if k.endswith("_over_baseline")
        and k
        not in (
            "joint_over_baseline",
            "rail_over_baseline",
            *(f"{b}_over_baseline" for b in BOUNDS),
        )
    ]
    rows = [
        [
            e["fabric"],
            e["pattern"],
            f"{e['skew']:g}",
            _cell(e["joint_over_baseline"]),
            _cell(e["rail_over_baseline"]),
            *[_cell(e[f"{p}_over_baseline"]) for p in peers],
            *[_cell(e[f"{b}_over_baseline"]) for b in BOUNDS],
            *[f"{e[f'joint_{b}_fraction_median']:.2f}" for b in BOUNDS],
            e["any_routing_resource"],
        ]
        for e in summary
    ]
    _render.print_table(
        f"speedup over DeepEP-like NATIVE (streamed): median (P10-P90) over {args.seeds} seeds, "
        f"layers {','.join(map(str, args.layers))}",
        [
            "fabric",
            "pattern",
            "token skew",
            "JOINT",
            "RAIL",
            *peers,
            "per-record bound",
            "any-routing bound",
            "JOINT of per-record",
            "JOINT of any-routing",
            "any-routing binds",
        ],
        rows,
    )
    if incast:
        for fabric, p in incast.items():
            _render.print_text(
                f"predicted NATIVE EXTREME / RING ({fabric}, sums over {p['layers']} layers per "
                f"seed): "
                f"median {p['median']:.3f} "
                f"(P10-P90 {p['p10']:.3f}-{p['p90']:.3f}, range {p['min']:.3f}-{p['max']:.3f}); "
                f"paper {p['paper']:.3f}"
            )


def _plot(summary: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    fabrics = list(dict.fromkeys(e["fabric"] for e in summary))
    patterns = list(dict.fromkeys(e["pattern"] for e in summary))
    skews = list(dict.fromkeys(e["skew"] for e in summary))
    metrics = [
        ("joint_over_baseline", "JOINT / baseline"),
        ("rail_over_baseline", "RAIL / baseline"),
    ]
    fig, axes = plt.subplots(
        len(metrics), len(fabrics), figsize=(4.6 * len(fabrics), 3.4 * len(metrics)), squeeze=False
    )
    by = {(e["fabric"], e["pattern"], e["skew"]): e for e in summary}
    vmax = max(2.0, max(e[m]["p90"] for e in summary for m, _ in metrics))
    vmin = min(0.5, min(e[m]["p10"] for e in summary for m, _ in metrics))
    norm = TwoSlopeNorm(
        vmin=vmin, vcenter=1.0, vmax=vmax
    )  # red: slower than the baseline, green: faster
    for i, (metric, label) in enumerate(metrics):
        for j, fabric in enumerate(fabrics):
            ax = axes[i][j]
            grid = np.array(
                [[by[(fabric, p, s)][metric]["median"] for p in patterns] for s in skews]
            )
            im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
            for a, s in enumerate(skews):
                for b, p in enumerate(patterns):
                    st = by[(fabric, p, s)][metric]
                    ax.text(
                        b,
                        a,
                        f"{st['median']:.2f}\n{st['p10']:.2f}-{st['p90']:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
            ax.set_xticks(range(len(patterns)), patterns)
            ax.set_yticks(range(len(skews)), [f"{s:g}" for s in skews])
            ax.set_ylabel("token skew")
            ax.set_title(f"{label}, {fabric}", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
