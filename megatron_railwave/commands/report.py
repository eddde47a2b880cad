"""``railwave report LOG_DIR``: summary table and plots of RailWave's per-layer JSONL logs.

A log directory may hold several runs (each run writes its own files and tags its records with
its ``run`` id): ``report`` summarises each run on its own, or the one named with ``--run``; it
never mixes runs.

Per-rank logs repeat each layer call on every rank: the path and the descriptors are global, the
times rank-local, so a call (layer, step, micro-batch, pass) counts once and its time is the slowest
rank's dispatch + combine (``lab.log_summary``). Table per layer: calls, path mix, P50/P95 of
dispatch + combine, mean B, rho_g, kappa, relayed records, waves, bytes per rail, overload factor
and the rail shares (mean over nodes of the busiest and idlest rail's share of remote egress).

Plots (matplotlib, Agg) in ``--out`` (default ``LOG_DIR/report``; one subdirectory per run when
several are reported):
  * ``path_choice.png``: path per layer (rows) and step (columns);
  * ``nic_shares.png``: per path, the mean share of each node's remote egress carried by its
    busiest, second busiest, ... rail (the paper's NIC-share view);
  * ``latency.png``: distribution of dispatch + combine per path;
  * ``online.png`` (runs with the online selector only): per layer (the first 12), the selector's
    median measured exchange time of each path where the call fell, over steps (training calls),
    and the path each call ran (filled: exploit; hollow: probe or re-probe).
The per-layer table then also gives the share of calls that probed and the fallbacks to JOINT.

JSON written by ``--json``: one run: its summary (``run``, ``layers``, ``paths``, ...); several:
``{"runs": {run: summary}}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.lab.log_summary import PATHS, layer_calls, summarize_logs

__all__ = ["register", "run", "write_plots", "layer_table"]
COLORS = {
    "native": "#7f7f7f",
    "rail": "#1f77b4",
    "perm": "#ff7f0e",
    "joint": "#2ca02c",
    "flow": "#d62728",
    "flow-waves": "#9467bd",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="summarise RailWave JSONL logs (table and PNG plots)",
        description="Per-layer path mix, P50/P95 dispatch+combine and rail shares of a RailWave "
        "log "
        "directory, with plots of path choice, NIC shares per path and latencies.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="directory of railwave*.jsonl files")
    parser.add_argument("--no-plots", action="store_true", help="table (and JSON) only")
    parser.add_argument(
        "--run",
        default=None,
        metavar="ID",
        help="summarise only this run (default: each run of LOG_DIR on its own)",
    )
    _args.add_output_args(
        parser, json="the summary", out="directory of the plots (default LOG_DIR/report)"
    )
    parser.set_defaults(handler=run)


def _kib(values: list[float]) -> str:
    return "/".join(f"{v / 1024:.1f}" for v in values) if values else "-"


def layer_table(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the per-layer table (``railwave report`` and ``make demo``)."""
    header = [
        "layer",
        "calls",
        "path",
        "B MiB",
        "rho_g",
        "kappa",
        "relayed",
        "waves",
        "KiB per rail",
        "tok/expert min/max/std",
        "overload",
        "dispatch ms",
        "combine ms",
    ]
    rows = []
    for r in summary["layers"]:
        mix = [f"{p} {r['path_mix'][p]:.0%}" for p in PATHS if r["path_mix"][p] > 0]
        rows.append(
            [
                r["layer"],
                r["calls"],
                " ".join(mix) if len(mix) > 1 else mix[0].split()[0] if mix else "-",
                r["B_mean_MiB"],
                r["rho_g"],
                r["kappa"],
                r["relayed_records"],
                r["num_waves"],
                _kib(r["rail_bytes"]),
                f"{r['tokens_per_expert_min']:.0f}/{r['tokens_per_expert_max']:.0f}/"
                f"{r['tokens_per_expert_std']:.1f}",
                r["overload_factor"],
                r["dispatch_ms"],
                r["combine_ms"],
            ]
        )
    return header, rows


def write_plots(
    records: list[dict[str, Any]], summary: dict[str, Any], out_dir: str | Path
) -> list[Path]:
    """The three PNGs (see the module docstring); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    calls = layer_calls(records)
    layers = sorted({int(c["layer"]) for c in calls})
    steps = sorted({int(c["step"]) for c in calls})
    grid = np.full((len(layers), len(steps)), np.nan)
    li, si = {v: i for i, v in enumerate(layers)}, {v: i for i, v in enumerate(steps)}
    for c in calls:
        if c["path"] in PATHS:
            grid[li[int(c["layer"])], si[int(c["step"])]] = PATHS.index(c["path"])
    files = []

    fig, ax = plt.subplots(
        figsize=(max(4.0, 0.25 * len(steps) + 2), max(3.0, 0.2 * len(layers) + 1.5))
    )
    ax.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        interpolation="nearest",
        vmin=-0.5,
        vmax=3.5,
        cmap=ListedColormap([COLORS[p] for p in PATHS]),
    )
    ax.set_yticks(range(len(layers)), [str(v) for v in layers], fontsize=6)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title("path choice per layer and step")
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in PATHS],
        labels=list(PATHS),
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=7,
    )
    files.append(_save(fig, out / "path_choice.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    per_path = summary["paths"]
    width = 0.8 / max(1, len(per_path))
    for k, (p, row) in enumerate(per_path.items()):
        shares = np.asarray(row["nic_shares"]) * 100
        ax.bar(np.arange(shares.size) + k * width, shares, width, label=p, color=COLORS.get(p))
    ax.set_xlabel("rail rank within node (busiest first)")
    ax.set_ylabel("share of node's remote egress (%)")
    ax.set_title("NIC shares per path")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "nic_shares.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [p for p in PATHS if any(c["path"] == p for c in calls)]
    data = [[c["comm_ms"] for c in calls if c["path"] == p] for p in names]
    if data:
        ax.boxplot(data, tick_labels=names, showfliers=True)
    ax.set_ylabel("dispatch + combine (ms, slowest rank)")
    ax.set_title("latency distribution per path")
    files.append(_save(fig, out / "latency.png"))
    online = [c for c in calls if c.get("selector_mode") and c.get("pass_kind", "train") == "train"]
    if online:
        files.append(_online_plot(online, out / "online.png"))
    return files


def _online_plot(calls: list[dict[str, Any]], path: Path) -> Path:
    """``online.png`` (module docstring)."""
    import matplotlib.pyplot as plt

    layers = sorted({int(c["layer"]) for c in calls})[:12]
    cols = min(3, len(layers))
    rows = (len(layers) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False, sharex=True
    )
    for ax, layer in zip(axes.flat, layers):
        cs = sorted(
            (c for c in calls if int(c["layer"]) == layer),
            key=lambda c: (int(c["step"]), int(c.get("microbatch", 0))),
        )
        x = np.arange(len(cs))
        for p in PATHS:
            y = [((c.get("measured_ms") or {}).get(p)) for c in cs]
            ax.plot(x, [np.nan if v is None else v for v in y], color=COLORS[p], lw=1, label=p)
            ran = [
                (i, v) for i, (c, v) in enumerate(zip(cs, y)) if c["path"] == p and v is not None
            ]
            for i, v in ran:
                probing = cs[i].get("selector_mode") in ("probe", "reprobe")
                ax.plot(i, v, "o", ms=3, color=COLORS[p], mfc="none" if probing else COLORS[p])
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_ylabel("measured ms", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(
        "online selector: median measured time per path (lines), path run (dots; hollow = probe)",
        fontsize=8,
    )
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.outputs import check_output_dir
    from megatron_railwave.telemetry.commlog import read_logs, split_runs

    plot_dir = Path(args.out) if args.out else Path(args.log_dir) / "report"
    runs = split_runs(read_logs(args.log_dir))
    if args.run is not None:
        if args.run not in runs:
            raise ValueError(
                f"--run {args.run!r} is not in {args.log_dir} (runs there: {', '.join(runs)})"
            )
        runs = {args.run: runs[args.run]}
    if not args.no_plots:
        check_output_dir(plot_dir, "--out")
    summaries = {}
    for run_id, records in runs.items():
        summary = summarize_logs(records)
        summaries[run_id] = summary
        header, rows = layer_table(summary)
        _render.print_table(
            f"{args.log_dir} run {run_id}: {summary['num_calls']} layer calls "
            f"({summary['num_records']} records; "
            f"passes: {', '.join(summary['passes'])})",
            header,
            rows,
        )
        _render.print_table(
            "rail shares and latency (slowest rank)",
            ["layer", "P50 ms", "P95 ms", "max rail share", "min rail share"],
            [
                [
                    r["layer"],
                    r["p50_ms"],
                    r["p95_ms"],
                    f"{r['rail_share_max']:.1%}",
                    f"{r['rail_share_min']:.1%}",
                ]
                for r in summary["layers"]
            ],
        )
        online = [r for r in summary["layers"] if "online_probe_share" in r]
        if online:
            _render.print_table(
                "online selector",
                ["layer", "probing calls", "fallback calls"],
                [
                    [r["layer"], f"{r['online_probe_share']:.1%}", r["online_fallback_calls"]]
                    for r in online
                ],
            )
        if not args.no_plots:
            files = write_plots(records, summary, plot_dir if len(runs) == 1 else plot_dir / run_id)
            _render.print_text("wrote " + ", ".join(str(f) for f in files))
    if args.json:
        _common.write_json(
            args.json,
            next(iter(summaries.values())) if len(summaries) == 1 else {"runs": summaries},
        )
    return 0
