"""`make demo`: train the tiny GLM-4.5-Air-shaped model with railwave and with alltoall.

Runs examples/train_glm_tiny.py twice on 8 CPU processes over gloo (4 emulated nodes x 2 GPUs):
once with ``--moe-token-dispatcher-type railwave`` (printing each step's loss and each MoE
layer's path, and writing the per-layer communication log) and once with Megatron's ``alltoall``,
then prints the losses side by side and, from that run's own log (``out/demo_logs``, one set of
files per run), what railwave did per layer: path, B, rho_g, kappa, relayed records, waves, bytes
per rail, tokens per expert, overload factor, dispatch and combine times (``railwave report``'s
table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(dispatcher: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(HERE / "train_glm_tiny.py"), "--nprocs", str(args.nprocs),
           "--steps", str(args.steps), "--moe-token-dispatcher-type", dispatcher, "--json", str(out)]
    if dispatcher == "railwave":
        cmd += ["--railwave-path", args.railwave_path, "--gpus-per-node", str(args.gpus_per_node),
                "--railwave-log-dir", str(args.out_dir / "demo_logs")]
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
    print(f"layer paths (last step): {rail.get('layer_paths')}")
    ok = worst <= 1e-4 * max(1.0, abs(ref["losses"][0]))
    print(f"max |loss difference| = {worst:.2e} -> {'MATCH' if ok else 'MISMATCH'}")
    _print_layer_table(args.out_dir / "demo_logs", rail["railwave_run"])
    return 0 if ok else 1


def _print_layer_table(log_dir: Path, run: str) -> None:
    """What railwave did per MoE layer, from this run's own communication log (slowest rank)."""
    from megatron_railwave.commands.report import layer_table, summarize_logs
    from megatron_railwave.telemetry.commlog import read_logs, split_runs

    summary = summarize_logs(split_runs(read_logs(log_dir))[run])
    header, rows = layer_table(summary)
    print(f"\nrailwave per layer, run {run} ({summary['num_calls']} layer calls; {log_dir}; "
          f"`railwave report {log_dir} --run {run}` for plots):")
    cells = [header] + [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    sys.exit(main())
