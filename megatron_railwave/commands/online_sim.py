"""``railwave online-sim``: the online selector over many steps with the flow model as the clock.

Runs ``lab.bench.online_sim`` (see there for the workload, the noise and the policies) for each
``--seed`` and prints per run: the totals of online, the per-layer oracle, always-NATIVE,
always-JOINT (every always-X in the JSON) and the per-call oracle on the same draws; the goals
(charged total <= 1.02x the per-epoch oracle, online <= 1.03x the per-layer oracle, below
always-NATIVE and always-JOINT) as met or missed; and the cost: the online selector's host
microseconds per layer call (timing words + observe + descriptors + decide, thread CPU time;
``--decision-cost``: each part's mean and percentiles over every call, next to ``demand_stats`` on
the same counts) and the bytes it adds to the count message. ``--learned`` writes what the online
selector learned (last seed) as the learned-paths report a training job's ``online_out`` writes.

JSON written by ``--json``: ``settings``, ``models`` (per flow-model file: ``base``, the flow
model's seconds per epoch, layer and path, the counts and the planning times, which
``--base-from`` reuses; ``runs`` (per seed: ``summary`` and ``layers``, each with the path per step,
its mode, the online, oracle and fixed totals).
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "online-sim",
        help="the online path selector over many steps, timed by the flow model",
        description="Run the online selector on the synthetic GLM-4.5-Air routing for --steps "
        "steps with "
        "per-call noise, the flow model as the clock, and compare it with the per-layer oracle, "
        "the per-epoch oracle, always-NATIVE and always-JOINT on the same draws.",
    )
    _args.add_cluster_args(parser, default="h800_4x8")
    _args.add_flag(
        parser,
        "--model",
        "h800_4x8",
        metavar="YAML[,YAML]",
        help="flow-model parameters; several (comma-separated) share one routing",
    )
    _args.add_flag(parser, "--workload", "glm45-air")
    _args.add_flag(parser, "--tokens", 4096)
    _args.add_flag(
        parser,
        "--layers",
        help="MoE layers",
        default_text="all 45",
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="routing seed (default 0)")
    _args.add_flag(parser, "--steps", 200)
    parser.add_argument(
        "--routing-every",
        type=int,
        default=50,
        metavar="K",
        help="steps per routing epoch: the routing moves to the workload's next step every K "
        "steps (default 50)",
    )
    _args.add_flag(
        parser,
        "--seed",
        [0],
        type=_args.comma_ints("seeds (e.g. 0,1,2)"),
        metavar="S[,S]",
        help="noise seed(s)",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.05,
        metavar="F",
        help="log-normal sigma of each call's time (default 0.05)",
    )
    _args.add_flag(parser, "--chunks", 1, help="rail chunks per wave of PERM / JOINT")
    parser.add_argument(
        "--streamed",
        action="store_true",
        help="also time every route with its relay streamed into its rail phases ('+streamed' "
        "variants: the oracles take the best of both, and --candidates may name them)",
    )
    parser.add_argument(
        "--candidates",
        default=None,
        metavar="P,P",
        help="the online selector's candidate paths (the config's online.candidates; joint "
        "required) (default the config's default: joint,rail,perm,native)",
    )
    parser.add_argument(
        "--base-from",
        default=None,
        metavar="JSON",
        help="reuse the flow-model times and counts of an earlier --json (same --model list and "
        "routing; no simulation)",
    )
    parser.add_argument(
        "--decision-cost",
        action="store_true",
        help="print the online selector's host work per layer call part by part (timing words, "
        "observe, descriptors, decide: mean and percentiles over every call of the run) next to "
        "demand_stats on the same counts",
    )
    output = _args.add_output_args(parser, json="the per-layer results")
    _args.add_output_file(
        output,
        "--learned",
        metavar="YAML",
        help="write what the online selector learned (last seed): the online_out report",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.config import OnlineSettings
    from megatron_railwave.lab.bench.online_sim import (
        base_from_json,
        base_times,
        base_to_json,
        base_variants,
        learned_report,
        simulate_online,
    )
    from megatron_railwave.planner import PlanOptions
    from megatron_railwave.selector.learned import write_learned_paths
    from megatron_railwave.traffic import SelectorScales

    if args.tokens < 1 or args.steps < 1 or args.routing_every < 1:
        raise ValueError("--tokens, --steps and --routing-every must be >= 1")
    settings = (
        OnlineSettings(candidates=tuple(p for p in args.candidates.split(",") if p.strip()))
        if args.candidates is not None
        else OnlineSettings()
    )
    topo = _common.cluster_from_args(args)
    model_files = [m for m in args.model.split(",") if m.strip()]
    models = [_common.load_model(m) for m in model_files]
    scales = SelectorScales().resolve(topo)
    record_bytes = 4096 * 2  # GLM-4.5-Air hidden 4096, bf16
    epochs = (args.steps + args.routing_every - 1) // args.routing_every
    _render.print_text(
        f"flow model(s) {', '.join(model_files)} on {topo.name}: {epochs} routing epochs x "
        f"{len(args.layers) if args.layers else 45} layers x "
        f"{len(base_variants(streamed=args.streamed))} paths ..."
    )
    if args.base_from:
        import json

        earlier_run = json.loads(open(args.base_from).read())
        earlier = earlier_run["models"]
        was = earlier_run.get("settings", {})
        plan_was = (was.get("chunks", 1), was.get("streamed", False))
        if plan_was != (args.chunks, args.streamed):
            raise ValueError(
                f"--base-from {args.base_from}: its times were planned with chunks={plan_was[0]}, "
                f"streamed={plan_was[1]}; this run asks for chunks={args.chunks}, "
                f"streamed={args.streamed}. Pass the same --chunks / --streamed, or drop "
                "--base-from"
            )
        missing = [m for m in model_files if m not in earlier]
        if missing:
            raise ValueError(
                f"--base-from {args.base_from}: no base times for model(s) {missing} (it has "
                f"{list(earlier)})"
            )
        bases = [base_from_json(earlier[m]["base"], record_bytes) for m in model_files]
    else:
        bases = base_times(
            topo,
            models,
            epochs=epochs,
            tokens=args.tokens,
            workload_seed=args.workload_seed,
            layers=tuple(args.layers) if args.layers else None,
            record_bytes=record_bytes,
            options=PlanOptions(chunks=args.chunks),
            variants=base_variants(streamed=args.streamed),
            progress=True,
        )
    out_models: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for model_file, base in zip(model_files, bases):
        runs: dict[str, Any] = {}
        for seed in args.seed:
            result = simulate_online(
                base,
                topo,
                steps=args.steps,
                routing_every=args.routing_every,
                seed=seed,
                noise=args.noise,
                settings=settings,
                scales=scales,
            )
            _print_run(model_file, seed, result["summary"], topo.world_size, args.decision_cost)
            runs[str(seed)] = {k: v for k, v in result.items() if not k.startswith("_")}
        out_models[model_file] = {"base": base_to_json(base), "runs": runs}
        if args.learned:
            target = args.learned if len(models) == 1 else _suffixed(args.learned, model_file)
            write_learned_paths(learned_report(result, topo), target)
            _render.print_text(f"wrote {target}")
    if args.json:
        _common.write_json(
            args.json,
            {
                "settings": {
                    "cluster": topo.name,
                    "models": model_files,
                    "workload": args.workload,
                    "tokens": args.tokens,
                    "workload_seed": args.workload_seed,
                    "steps": args.steps,
                    "routing_every": args.routing_every,
                    "seeds": args.seed,
                    "noise": args.noise,
                    "chunks": args.chunks,
                    "streamed": args.streamed,
                    "candidates": list(settings.candidates),
                    "base_wall_s": bases[0].wall_s,
                },
                "models": out_models,
            },
        )
    return 0


def _suffixed(path: str, model_file: str) -> str:
    """``path`` with the model file's stem before the extension (one learned file per model)."""
    from pathlib import Path

    p = Path(path)
    return str(p.with_name(f"{p.stem}.{Path(model_file).stem}{p.suffix}"))


def _print_run(
    model_file: str, seed: int, s: dict[str, Any], world: int, decision_cost: bool = False
) -> None:
    t, r = s["totals_s"], s["ratio_to_oracle"]
    _render.print_text(
        f"{model_file}, seed {seed}: online {t['online']:.3f} s = {r['online']:.4f}x the "
        f"per-layer oracle "
        f"({t['oracle_per_layer']:.3f} s); always-NATIVE {r['always_native']:.4f}x, always-JOINT "
        f"{r['always_joint']:.4f}x, always-RAIL {r['always_rail']:.4f}x"
        + (
            f", always-JOINT+streamed {r['always_joint+streamed']:.4f}x"
            if "always_joint+streamed" in r
            else ""
        )
        + ", per-call oracle "
        f"{r['oracle_per_call']:.4f}x" + f"; {s['probe_calls']} probe calls of {s['calls']}; "
        f"{s['layers_final_on_oracle_path']}/{s['num_layers']} "
        f"layers end on the oracle's path"
    )
    e = s["ratio_to_epoch_oracle"]
    _render.print_text(
        f"  charged (exchange + host {t['host_s'] * 1e3:.2f} ms + probe planning "
        f"{t['probe_planning_s'] * 1e3:.2f} ms"
        + ("" if s["planning_measured"] else ", planning not measured")
        + f"): {t['online_charged']:.3f} s = {e['online_charged']:.4f}x the per-epoch hindsight "
        f"oracle ({t['oracle_per_epoch']:.3f} s), {r['online_charged']:.4f}x the per-layer oracle"
    )
    g = s["goals"]
    _render.print_text(
        "  goals: charged <= 1.02x per-epoch oracle "
        + ("MET" if g["charged_within_1.02x_epoch_oracle"] else "MISSED")
        + ", <= 1.03x oracle "
        + ("MET" if g["within_1.03x_oracle"] else "MISSED")
        + ", below always-NATIVE "
        + ("MET" if g["below_always_native"] else "MISSED")
        + ", below always-JOINT "
        + ("MET" if g["below_always_joint"] else "MISSED")
    )
    c = s["cost"]
    cpu = c["cpu_us_per_call"]
    _render.print_text(
        f"  cost (this host, thread CPU per layer call): words + observe + descriptors + decide "
        f"{cpu['total']['mean']:.1f} us "
        f"mean, {cpu['total']['p50']:.1f} us median (descriptors {cpu['descriptors']['mean']:.1f} "
        f"us; demand_stats on "
        f"the same counts {c['reference_descriptors_cpu_us_per_call']:.1f} us); count message "
        f"+{c['extra_bytes_per_peer_message']} bytes per peer message "
        f"({c['extra_bytes_per_rank_per_layer_call']} bytes "
        f"per rank per layer call over {world} peers)"
    )
    if decision_cost:
        _render.print_table(
            "  online selector host work per layer call (thread CPU us, every call of the run)",
            ["part", "mean", "p50", "p90", "p99", "max"],
            [
                [part, *(round(cpu[part][k], 1) for k in ("mean", "p50", "p90", "p99", "max"))]
                for part in ("words", "observe", "descriptors", "decide", "total")
            ]
            + [
                [
                    "demand_stats (reference)",
                    round(c["reference_descriptors_cpu_us_per_call"], 1),
                    "",
                    "",
                    "",
                    "",
                ],
                ["one clock read (in each part)", round(c["clock_read_us"], 1), "", "", "", ""],
            ],
        )
