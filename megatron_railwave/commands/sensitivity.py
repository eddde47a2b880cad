"""``railwave sensitivity``: JOINT / baseline and RAIL / baseline over token skew x fabric x
pattern x seed (`netmodel.sensitivity`), as a table, JSON and a heatmap.

Baseline: DeepEP-like NATIVE (streamed forwarding). Fabrics: ``max-min`` (alpha 0: no goodput
lost to incast) and ``ultraep`` (the saturating incast law with alpha fitted on the paper's UltraEP
case alone, `sensitivity.fit_alpha_ultraep`, or ``--alpha``). With the UltraEP alpha the paper's
incast experiment (NATIVE, RING -> EXTREME, +67.1%) is predicted per seed on the same layers.
Per seed a ratio is of the sums over its layers; over seeds: median, P10, P90.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from megatron_railwave.commands import _common, _outputs, _render

__all__ = ["register", "run"]

_PATTERNS = ("none", "ring", "moderate", "extreme")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sensitivity",
        help="JOINT/RAIL over the DeepEP-like baseline across token skew, fabric, pattern and "
        "seeds",
        description="Model JOINT, RAIL and the streamed NATIVE baseline on the synthetic "
        "GLM-4.5-Air routing over "
        "token skew x fabric {max-min, UltraEP-fitted incast} x pattern x seed; median and P10-P90 "
        "over seeds, the path-independent bound, the predicted incast slowdown.",
    )
    _common.add_cluster_args(parser, default="h800_4x8")
    parser.add_argument(
        "--model",
        default=None,
        metavar="YAML",
        help="base netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8; its alpha "
        "is ignored: the fabrics set it); default the built-in NetModelConfig",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="alpha of the incast fabric (default: fitted on the paper's UltraEP case, 4 x 8 only)",
    )
    parser.add_argument(
        "--skews",
        type=_floats,
        default=[0.0, 0.5, 1.0, 1.46],
        metavar="S,S",
        help="token skews (std of log tokens per rank; default 0,0.5,1,1.46)",
    )
    parser.add_argument(
        "--pattern",
        type=_patterns,
        default=list(_PATTERNS),
        metavar="P,P",
        help="arrangements: none (all pairs at once), ring, moderate, extreme (default all)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="routing seeds 0..S-1 (default 5)")
    parser.add_argument(
        "--layers",
        type=_layers,
        default=[8, 36],
        metavar="L,L",
        help="MoE layers per seed (default 8,36: fewer than the 45 to keep the grid's run time "
        "manageable)",
    )
    parser.add_argument(
        "--tokens", type=int, default=2048, help="mean tokens per GPU (default 2048)"
    )
    parser.add_argument(
        "--payload-scale",
        default="paper",
        metavar="X|paper",
        help="multiply every record count (default paper: workloads.PAPER_PAYLOAD_SCALE)",
    )
    parser.add_argument(
        "--path-delivery",
        choices=["after_rail", "streamed"],
        default="after_rail",
        help="stage 3 of RAIL / JOINT: after_rail (as the exchange runs; default) or streamed",
    )
    parser.add_argument(
        "--peers",
        default="deepep-balanced,deepep-direct,megatron",
        metavar="P,P",
        help="peers per cell (netmodel.peers; deepep-balanced = the baseline on the same tokens "
        "split "
        "equally over the ranks); 'none' to skip (default deepep-balanced,deepep-direct,megatron)",
    )
    parser.add_argument(
        "--incast-layers",
        type=_layer_count,
        default=None,
        metavar="K|L,L",
        help="layers of the incast prediction: K = the first K MoE layers, or a list (default: "
        "the grid's --layers); token skew 1.46, every seed",
    )
    parser.add_argument(
        "--no-incast-prediction",
        action="store_true",
        help="skip the prediction of the paper's +67.1%% (NATIVE RING -> EXTREME)",
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="write the grid, its summary and the fit"
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="heatmap: median (P10-P90) per cell"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("json", "plot"))


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected numbers >= 0 separated by commas, got {text!r}")
    return values


def _patterns(text: str) -> list[str]:
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not values or any(v not in _PATTERNS for v in values):
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(_PATTERNS)} separated by commas, got {text!r}"
        )
    return values


def _layers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected MoE layer numbers separated by commas, got {text!r}"
        )
    return values


def _layer_count(text: str) -> list[int]:
    values = _layers(text)
    return values if "," in text else [-values[0]]  # negative: "the first K layers"


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from megatron_railwave.commands.bench import _payload_scale, layer_demands
    from megatron_railwave.lab.netmodel import NetModelConfig, load_netmodel_config
    from megatron_railwave.lab.netmodel.sensitivity import (
        fit_alpha_ultraep,
        layer_cell,
        predict_incast_slowdown,
        summarize_grid,
    )
    from megatron_railwave.lab.workloads import GLM45_AIR, arrange, scaled_demand

    topo = _common.cluster_from_args(args)
    if args.seeds < 1 or args.tokens < 1:
        raise ValueError(f"need --seeds >= 1 and --tokens >= 1, got {args.seeds} and {args.tokens}")
    bad = [v for v in args.layers if v not in GLM45_AIR.layer_numbers]
    if bad:
        raise ValueError(
            f"--layers: {bad} are not MoE layers of GLM-4.5-Air ({GLM45_AIR.layer_numbers[0]}.."
            f"{GLM45_AIR.layer_numbers[-1]})"
        )
    bad = [v for v in (args.incast_layers or []) if v > 0 and v not in GLM45_AIR.layer_numbers]
    if bad:
        raise ValueError(
            f"--incast-layers: {bad} are not MoE layers of GLM-4.5-Air; give K (the first K) or a "
            f"list"
        )
    if args.alpha is not None and args.alpha < 0:
        raise ValueError(f"--alpha must be >= 0, got {args.alpha}")
    from megatron_railwave.commands.bench import PEERS

    peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"--peers: {bad} are unknown; choose from {', '.join(PEERS)} or none")
    scale = _payload_scale(args.payload_scale)
    base = load_netmodel_config(args.model) if args.model else NetModelConfig()
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
    record_bytes = GLM45_AIR.hidden_size * 2
    seeds = list(range(args.seeds))
    rows: list[dict[str, Any]] = []
    total = len(args.skews) * len(seeds) * len(args.layers) * len(args.pattern) * len(fabrics)
    arranged: dict[
        tuple[int, int], dict[str, tuple[Any, Any]]
    ] = {}  # (seed, layer): skew 1.46 RING / EXTREME
    with tqdm(total=total, desc="sensitivity", disable=args.no_progress, leave=False) as bar:
        for skew in args.skews:
            for seed in seeds:
                for layer in args.layers:
                    demand0 = layer_demands(
                        topo, layer=layer, step=0, tokens=args.tokens, seed=seed, token_skew=skew
                    )
                    even0 = (
                        layer_demands(
                            topo,
                            layer=layer,
                            step=0,
                            tokens=args.tokens,
                            seed=seed,
                            token_skew=skew,
                            balanced_tokens=True,
                        )
                        if "deepep-balanced" in peers
                        else None
                    )
                    for pattern in args.pattern:
                        demand, windows = (
                            (demand0, None)
                            if pattern == "none"
                            else arrange(demand0, pattern, topo)
                        )
                        demand = scaled_demand(demand, scale)
                        balanced = None
                        if even0 is not None:
                            even, even_w = (
                                (even0, None)
                                if pattern == "none"
                                else arrange(even0, pattern, topo)
                            )
                            balanced = (scaled_demand(even, scale), even_w)
                        if skew == 1.46 and pattern in ("ring", "extreme"):
                            arranged.setdefault((seed, layer), {})[pattern] = (demand, windows)
                        for fabric, a in fabrics.items():
                            cell = layer_cell(
                                demand,
                                windows,
                                topo,
                                baseline=replace(baseline, alpha=a),
                                paths_model=replace(base, alpha=a, delivery=args.path_delivery),
                                record_bytes=record_bytes,
                                peers=peers,
                                balanced=balanced,
                            )
                            rows.append(
                                {
                                    "skew": skew,
                                    "fabric": fabric,
                                    "pattern": pattern,
                                    "seed": seed,
                                    "layer": layer,
                                    **cell,
                                }
                            )
                            bar.update(1)
    summary = summarize_grid(rows)
    incast = None
    incast_layers = args.layers
    if args.incast_layers is not None:
        incast_layers = (
            list(GLM45_AIR.layer_numbers[: -args.incast_layers[0]])
            if args.incast_layers[0] < 0
            else args.incast_layers
        )
    if not args.no_incast_prediction:

        def layer_sets(seed: int):
            out = []
            for layer in incast_layers:
                if set(arranged.get((seed, layer), ())) != {"ring", "extreme"}:
                    demand0 = layer_demands(
                        topo, layer=layer, step=0, tokens=args.tokens, seed=seed
                    )
                    arranged[(seed, layer)] = {
                        p: (scaled_demand(d, scale), w)
                        for p in ("ring", "extreme")
                        for d, w in [arrange(demand0, p, topo)]
                    }
                v = arranged[(seed, layer)]
                out.append((v["ring"][0], v["ring"][1], v["extreme"][0], v["extreme"][1]))
            return out

        incast = {
            fabric: {
                **predict_incast_slowdown(
                    topo,
                    replace(baseline, alpha=a),
                    seeds=seeds,
                    layer_sets=layer_sets,
                    record_bytes=record_bytes,
                ),
                "layers": len(incast_layers),
            }
            for fabric, a in fabrics.items()
        }
    _print(summary, incast, args)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "handler"}
        config.update(
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
    peers = [
        k[: -len("_over_baseline")]
        for k in summary[0]
        if k.endswith("_over_baseline")
        and k not in ("joint_over_baseline", "rail_over_baseline", "ideal_over_baseline")
    ]
    rows = [
        [
            e["fabric"],
            e["pattern"],
            f"{e['skew']:g}",
            _cell(e["joint_over_baseline"]),
            _cell(e["rail_over_baseline"]),
            *[_cell(e[f"{p}_over_baseline"]) for p in peers],
            _cell(e["ideal_over_baseline"]),
            f"{e['joint_ideal_fraction_median']:.2f}",
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
            "ideal (bound)",
            "JOINT of ideal",
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
