"""``railwave calibrate``: profile the four paths on replay requests and write the anchors file.

Requests: ``--workload synthetic`` (``workloads.synthetic_routing_maps``: ``--families`` routing
seeds from ``--seed``, each with its own locality and hot-expert ratio) or ``--workload glm``
(synthetic GLM-4.5-Air layers at step 0, ``--layers``, default the odd-numbered MoE layers so that
``railwave validate`` has the even ones held out), at every T per GPU of ``--tokens`` (decode-like
128 up to training sizes, e.g. 128,512,2048,4096), each under every ``--arrangements`` sending
arrangement (none = all node pairs at once, as a training step sends; ring / moderate / extreme:
``workloads.arrange``) at every ``--payload-scales`` factor (record counts x factor).
Each request: ``--warmups`` discarded calls per path, ``--repeats`` interleaved rounds, medians.
An anchor is kept when the fastest path is not JOINT, it and JOINT are repeatable
(p90/p10 <= ``--max-spread``) and it beats JOINT by at least ``--min-gain`` (5%) conservatively:
p90(best) <= (1 - ``--min-gain``) x p10(JOINT).

The anchors file goes to ``--write-anchors`` (``--out`` before: deprecated, it still works for
one release). JSON written by ``--json``: ``anchors`` (the file's content) and ``requests`` (one
row per request: coords, B_mean_bytes, rho_g, kappa, best, kept, gain, reason, latency_s per
path).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from megatron_railwave.commands import _args, _common, _render
from megatron_railwave.names import PAPER_ROUTES

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="profile the four paths on replay requests and write the selector anchors",
        description="Profile NATIVE, RAIL, PERM and JOINT on replay requests (warm-ups, "
        "interleaved "
        "rounds, medians) and keep an anchor where a path beats JOINT repeatably and "
        "conservatively.",
    )
    _args.add_cluster_args(parser)
    _args.add_replay_measure_args(
        parser,
        model_help="netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8)",
        model_default_text="the built-in NetModelConfig",
    )
    parser.add_argument(
        "--retune",
        default=None,
        metavar="JSON[,JSON]",
        help="measure nothing: re-tune the selector over the rows of earlier `calibrate --json` "
        "files "
        "of this --cluster (their context and keep decisions; several: the same calibration at "
        "other T values, merged) and write --write-anchors (and --json)",
    )
    group = parser.add_argument_group("requests")
    _args.add_flag(
        group, "--workload", "synthetic", choices=["synthetic", "glm"], help="request generator"
    )
    group.add_argument(
        "--families", type=int, default=8, help="synthetic routing families (default 8)"
    )
    _args.add_flag(
        group,
        "--layers",
        help="glm: MoE layer numbers",
        default_text="the odd ones, 1,3,...,45; validation holds out the rest",
    )
    _args.add_flag(group, "--seed", 0, help="first family seed / glm seed")
    _args.add_flag(
        group,
        "--extra-seeds",
        [],
        type=_args.comma_ints("seeds", allow_empty=True),
        metavar="S,S",
        help="glm: more workload seeds of the same layers (more skew levels covered)",
        default_text="none",
    )
    _args.add_flag(
        group,
        "--arrangements",
        list(_args.ARRANGEMENTS),
        type=_args.comma_choices(_args.ARRANGEMENTS),
        metavar="A,A",
        help="sending arrangements: none (all pairs at once, as in training), "
        "ring, moderate, extreme",
        default_text="all four",
    )
    _args.add_flag(
        group,
        "--payload-scales",
        [1.0],
        type=_args.comma_floats("positive numbers (e.g. 1,2,4)", minimum=0.0, inclusive=False),
        metavar="X,X",
        help="payload factors applied to every routing, on top of --tokens",
        default_text="1",
    )
    _args.add_flag(
        group,
        "--tokens",
        [128, 512, 2048, 4096],
        type=_args.comma_ints("tokens per GPU >= 1 (e.g. 128,4096)", minimum=1),
        metavar="T,T",
        help="tokens per GPU, one request set per value",
    )
    _args.add_workload_args(group, hidden=4096, dtype="bf16", seed=None)
    _args.add_flag(
        group,
        "--chunks",
        1,
        help="rail chunks per wave of the PERM / JOINT plans (PlanOptions.chunks, recorded as "
        "context.settings.chunks; a RailWave config using the file must set the same chunks)",
        default_text="1, whole waves",
    )
    rule = parser.add_argument_group("keep rule")
    rule.add_argument("--max-spread", type=float, default=1.2, help="max p90/p10 (default 1.2)")
    rule.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="min conservative gain over JOINT, p90 vs p10 (default 0.05)",
    )
    output = _args.add_output_args(parser, json="every request's numbers")
    _args.add_output_file(
        output,
        "--write-anchors",
        metavar="YAML",
        help="the anchors file to write (required)",
        required=True,
        renamed_from="--out",
    )
    parser.set_defaults(handler=run)


def print_latencies(title: str, rows: list[dict[str, Any]]) -> None:
    _render.print_table(
        title,
        [
            "request",
            "log2(B/ref)",
            "(rho-1)/s",
            "(kappa-1)/s",
            "native ms",
            "rail ms",
            "perm ms",
            "joint ms",
            "best",
            "gain",
            "kept",
        ],
        [
            [
                r["request"],
                *r["coords"],
                *[r["latency_s"][p]["median"] * 1e3 for p in tuple(map(str, PAPER_ROUTES))],
                r["best"],
                f"{r['gain']:+.1%}",
                r["reason"],
            ]
            for r in rows
        ],
    )


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab import calibration

    if args.retune is not None:
        return _retune(args)
    if args.backend is None:
        raise ValueError("--backend is required (unless --retune re-tunes an earlier calibration)")
    from megatron_railwave.traffic import dtype_bytes

    topo = _common.cluster_from_args(args)
    _common.check_replay_measure_args(args)
    if args.hidden < 1 or args.families < 1:
        raise ValueError(
            f"--hidden and --families must be >= 1, got {args.hidden}, {args.families}"
        )
    if args.max_spread < 1 or not 0 <= args.min_gain < 1:
        raise ValueError(
            f"need --max-spread >= 1 and 0 <= --min-gain < 1, got {args.max_spread}, "
            f"{args.min_gain}"
        )
    from megatron_railwave.planner import PlanOptions

    options = PlanOptions(
        chunks=args.chunks
    )  # rejects chunks outside 1..MAX_CHUNKS, naming the field
    record_bytes = args.hidden * dtype_bytes(args.dtype)
    settings: dict[str, Any] = {
        "workload": args.workload,
        "seed": args.seed,
        "tokens": list(args.tokens),
        "payload_scales": list(args.payload_scales),
        "arrangements": list(args.arrangements),
    }
    if args.workload == "glm":
        from megatron_railwave.lab.workloads import GLM45_AIR

        if args.extra_seeds:
            settings["extra_seeds"] = list(args.extra_seeds)
        settings["layers"] = args.layers or [
            layer for layer in GLM45_AIR.layer_numbers if layer % 2 == 1
        ]
    else:
        settings["families"] = list(range(args.seed, args.seed + args.families))
    model = _common.load_model(args.model)
    backend = calibration.make_backend(args.backend, topo, options=options, model=model)
    requests = calibration.calibration_requests(topo, settings, record_bytes=record_bytes)
    result = calibration.calibrate(
        backend,
        requests,
        topo,
        hidden_size=args.hidden,
        dtype=args.dtype,
        warmups=args.warmups,
        repeats=args.repeats,
        max_spread=args.max_spread,
        min_gain=args.min_gain,
        settings={
            "requests": settings,
            "model_file": args.model,
            "model": model.to_dict(),
            "chunks": args.chunks,
        },
        progress=not args.no_progress,
    )
    print_latencies(
        f"calibration on {topo.name} with {backend.name} (median of {args.repeats})",
        [r.to_dict() for r in result.rows],
    )
    return _tune_and_write(args, result)


def _retune(args: argparse.Namespace) -> int:
    import json

    from megatron_railwave.lab import calibration

    topo = _common.cluster_from_args(args)
    files = [f for f in args.retune.split(",") if f]
    results = []
    for name in files:
        try:
            with open(name) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--retune {name!r}: cannot read it as JSON ({exc})") from None
        results.append(calibration.result_from_json(data, source=f"--retune {name!r}", topo=topo))
    result = (
        calibration.merge_results(results, [repr(f) for f in files])
        if len(results) > 1
        else results[0]
    )
    _render.print_text(
        f"re-tuning over {len(result.rows)} calibration rows of {', '.join(files)} "
        f"({len(result.anchor_set.anchors)} passed the keep rule); nothing is measured"
    )
    lacking = sum(r.features is None for r in result.rows)
    if lacking:
        _render.print_text(
            f"{lacking} rows carry no path-model features of this version (written before it): "
            "regenerating their requests from context.settings.requests to compute them"
        )
        result = calibration.with_features(result, topo, progress=not args.no_progress)
    return _tune_and_write(args, result)


def _tune_and_write(args: argparse.Namespace, result) -> int:
    from megatron_railwave.lab import calibration
    from megatron_railwave.selector.anchors import save_anchors

    tuned = calibration.tune_selector(result)
    anchor_set = calibration.with_selector_settings(result.anchor_set, tuned)
    save_anchors(anchor_set, args.write_anchors)
    rows = [r.to_dict() for r in result.rows]
    kept = anchor_set.anchors
    passed = len(result.anchor_set.anchors)
    if not tuned["use_anchors"] and passed:
        _render.print_text(
            f"{passed} requests passed the keep rule, but no selector setting beats always-JOINT "
            f"when a {tuned['left_out']} is left out: the file keeps none"
        )
    paths = ", ".join(f"{p}: {n}" for p, n in sorted(Counter(str(a.path) for a in kept).items()))
    _render.print_text(
        f"kept {len(kept)} of {len(rows)} requests as anchors ({paths or 'none: always JOINT'}; "
        f"{passed} passed the keep rule, {passed - len(kept)} of them do not hold across "
        f"{tuned['left_out']}s); wrote {args.write_anchors}"
    )
    below = tuned.get("fallback_below")
    _render.print_text(
        f"selector thresholds ({tuned['method']}): payload ratio {tuned['payload_ratio']}, "
        f"shape distance {tuned['shape_distance']}, outside the anchors "
        + (
            f"{below['path'].upper()} below B_mean {below['payload_bytes'] / 2**20:.3f} MiB where "
            f"it posts fewer "
            "phases, else JOINT"
            if below
            else "JOINT"
        )
        + " (recorded in context.settings.selector; the runtime and railwave validate use them "
        "unless a RailWave "
        "config sets payload_ratio / shape_distance)"
    )
    model_score = tuned.get("model_score")
    if model_score is None:
        _render.print_text(
            "path model: not scored (rows without features: calibrations written before the path "
            "model, or requests without target masks)"
        )
    else:
        _render.print_text(
            f"path model, leave-one-{tuned['left_out']}-out, per payload gating ("
            + "; ".join(
                f"{sc['gate']}: {sc['over_tolerance']} over, {sc['vs_joint']:.5f} of always-JOINT, "
                f"{sc['decided']} decided"
                for sc in tuned["scores"]
                if sc.get("model")
            )
            + f"), gating {model_score['gate']}: {model_score['over_tolerance']} requests over "
            f"{1 + tuned['tolerance']:.2f}x of their best path, total "
            f"{model_score['vs_joint']:.4f} of always-JOINT: "
            + (
                "better than the anchors, recorded in context.settings.selector.model: the "
                "runtime decides with it"
                if tuned.get("model")
                else "not better than the anchors, not recorded"
            )
        )
    if args.json:
        from megatron_railwave.selector.path_model import FEATURE_NAMES

        _common.write_json(
            args.json,
            {
                "anchors": anchor_set.to_dict(),
                "features": list(FEATURE_NAMES),
                "requests": rows,
                "selector": tuned,
            },
        )
    return 0
