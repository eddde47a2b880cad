"""`make demo`: train the tiny GLM-4.5-Air-shaped model with railwave and with alltoall.

Runs examples/train_glm_tiny.py twice on 8 CPU processes over gloo (4 emulated nodes x 2 GPUs):
once with ``--moe-token-dispatcher-type railwave`` (printing each step's loss and each MoE
layer's path, and writing the per-layer communication log) and once with Megatron's ``alltoall``,
then prints the losses side by side and, from that run's own log (``out/demo_logs``, one set of
files per run), what railwave did per layer: path, B, rho_g, kappa, relayed records, waves, bytes
per rail, tokens per expert, overload factor, dispatch and combine times (``railwave report``'s
table), and ends with a summary: the ops railwave ran on (compiled or the pure-torch reference),
the losses' verdict, each layer's path and bytes, and where to look next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(dispatcher: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "train_glm_tiny.py"),
        "--nprocs",
        str(args.nprocs),
        "--steps",
        str(args.steps),
        "--moe-token-dispatcher-type",
        dispatcher,
        "--json",
        str(out),
    ]
    if dispatcher == "railwave":
        cmd += [
            "--railwave-path",
            args.railwave_path,
            "--gpus-per-node",
            str(args.gpus_per_node),
            "--railwave-log-dir",
            str(args.out_dir / "demo_logs"),
        ]
    print(f"\n=== {dispatcher} ===\n$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--railwave-path", default="auto")
    parser.add_argument("--out-dir", type=Path, default=Path("out"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rail = _run("railwave", args, args.out_dir / "demo_railwave.json")
    ref = _run("alltoall", args, args.out_dir / "demo_alltoall.json")
    print("\nstep | railwave loss | alltoall loss | |diff|")
    worst = 0.0
    for i, (a, b) in enumerate(zip(rail["losses"], ref["losses"]), 1):
        worst = max(worst, abs(a - b))
        print(f"{i:4d} | {a:13.6f} | {b:13.6f} | {abs(a - b):.2e}")
    ok = worst <= 1e-4 * max(1.0, abs(ref["losses"][0]))
    print(f"max |loss difference| = {worst:.2e} -> {'MATCH' if ok else 'MISMATCH'}")
    log_dir, run = args.out_dir / "demo_logs", rail["railwave_run"]
    summary = _print_layer_table(log_dir, run)
    _print_summary(rail, ok, worst, summary, log_dir, run)
    return 0 if ok else 1


def _print_layer_table(log_dir: Path, run: str) -> dict:
    """What railwave did per MoE layer, from this run's own communication log (slowest rank);
    returns ``railwave report``'s summary of the run."""
    from megatron_railwave.commands.report import layer_table
    from megatron_railwave.lab.log_summary import summarize_logs
    from megatron_railwave.telemetry.commlog import read_logs, split_runs

    summary = summarize_logs(split_runs(read_logs(log_dir))[run])
    header, rows = layer_table(summary)
    print(
        f"\nrailwave per layer, run {run} ({summary['num_calls']} layer calls, slowest rank; "
        f"{log_dir}):"
    )
    cells = [header] + [
        [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
    return summary


def _print_summary(
    rail: dict, ok: bool, worst: float, summary: dict, log_dir: Path, run: str
) -> None:
    """The few lines to read first: what ran, whether it trained the same, what each layer did,
    where to go next."""
    print("\n=== summary ===")
    print(
        f"railwave: {rail['nprocs']} CPU processes (gloo), {rail['steps']} steps, ops "
        f"{rail.get('railwave_ops') or 'unknown'}"
    )
    print(
        f"losses against Megatron's alltoall: {'match' if ok else 'DIFFER'} (max |diff| "
        f"{worst:.2e}, "
        f"tolerance 1e-4 x max(1, |first loss|))"
    )
    for layer in summary["layers"]:
        paths = ", ".join(f"{p} {share:.0%}" for p, share in layer["path_mix"].items() if share > 0)
        sent = sum(layer["rail_bytes"]) / 1024
        print(
            f"  MoE layer {layer['layer']}: {paths} of {layer['calls']} calls; per call (mean) "
            f"the dispatch sends "
            f"{sent:.1f} KiB over {len(layer['rail_bytes'])} rails in {layer['num_waves']:g} "
            f"wave(s), "
            f"{layer['relayed_records']:g} records relayed to balance the rails"
        )
    print(f"next: railwave report {log_dir} --run {run}   (this run's table, plots and JSON)")
    print(
        "      docs/usage.md   (the three lines for your own Megatron job);  docs/index.md   "
        "(every document)"
    )


if __name__ == "__main__":
    sys.exit(main())
