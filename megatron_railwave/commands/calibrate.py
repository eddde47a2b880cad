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

JSON written by ``--json``: ``anchors`` (the file's content) and ``requests`` (one row per request:
coords, B_mean_bytes, rho_g, kappa, best, kept, gain, reason, latency_s per path).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from megatron_railwave.commands import _common, _outputs, _render
from megatron_railwave.names import ROUTES

__all__ = ["register", "run", "parse_floats", "load_model", "model_dict"]


def parse_floats(text: str) -> list[float]:
    """argparse type of a comma-separated list of positive numbers."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected positive numbers separated by commas (e.g. 1,2,4), got {text!r}"
        )
    return values


def _token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected tokens per GPU >= 1 separated by commas (e.g. 128,4096), got {text!r}"
        )
    return values


def _layers(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected layer numbers separated by commas, got {text!r}"
        ) from None


def _arrangements(text: str) -> list[str]:
    allowed = ("none", "ring", "moderate", "extreme")
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(allowed)} separated by commas, got {text!r}"
        )
    return values


def add_measure_args(parser: argparse.ArgumentParser, *, backend_required: bool = True) -> None:
    group = parser.add_argument_group("measurement")
    group.add_argument(
        "--backend",
        choices=["netmodel"],
        required=backend_required,
        default=None,
        help="what times the paths: netmodel (the flow model; the only backend so far)",
    )
    group.add_argument(
        "--model",
        default=None,
        metavar="YAML",
        help="netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8; default: "
        "calibrate: the built-in NetModelConfig; validate: the model recorded in the anchors file)",
    )
    group.add_argument(
        "--warmups", type=int, default=5, help="discarded calls per path (default 5)"
    )
    group.add_argument(
        "--repeats", type=int, default=10, help="interleaved rounds per request (default 10)"
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="profile the four paths on replay requests and write the selector anchors",
        description="Profile NATIVE, RAIL, PERM and JOINT on replay requests (warm-ups, "
        "interleaved "
        "rounds, medians) and keep an anchor where a path beats JOINT repeatably and "
        "conservatively.",
    )
    _common.add_cluster_args(parser)
    add_measure_args(parser, backend_required=False)
    parser.add_argument("--out", required=True, metavar="YAML", help="anchors file to write")
    parser.add_argument(
        "--retune",
        default=None,
        metavar="JSON[,JSON]",
        help="measure nothing: re-tune the selector over the rows of earlier `calibrate --json` "
        "files "
        "of this --cluster (their context and keep decisions; several: the same calibration at "
        "other T values, merged) and write --out (and --json)",
    )
    group = parser.add_argument_group("requests")
    group.add_argument(
        "--workload",
        choices=["synthetic", "glm"],
        default="synthetic",
        help="request generator (default synthetic)",
    )
    group.add_argument(
        "--families", type=int, default=8, help="synthetic routing families (default 8)"
    )
    group.add_argument(
        "--layers",
        type=_layers,
        default=None,
        metavar="L,L",
        help="glm: MoE layer numbers (default the odd ones, 1,3,...,45; validation holds out the "
        "rest)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="first family seed / glm seed (default 0)"
    )
    group.add_argument(
        "--extra-seeds",
        type=_layers,
        default=[],
        metavar="S,S",
        help="glm: more workload seeds of the same layers (more skew levels covered; default none)",
    )
    group.add_argument(
        "--arrangements",
        type=_arrangements,
        default=["none", "ring", "moderate", "extreme"],
        metavar="A,A",
        help="sending arrangements: none (all pairs at once, as in training), "
        "ring, moderate, extreme (default all four)",
    )
    group.add_argument(
        "--payload-scales",
        type=parse_floats,
        default=[1.0],
        metavar="X,X",
        help="payload factors applied to every routing, on top of --tokens (default 1)",
    )
    group.add_argument(
        "--tokens",
        type=_token_list,
        default=[128, 512, 2048, 4096],
        metavar="T,T",
        help="tokens per GPU, one request set per value (default 128,512,2048,4096)",
    )
    group.add_argument(
        "--hidden", type=int, default=4096, metavar="H", help="hidden size (default 4096)"
    )
    group.add_argument(
        "--chunks",
        type=int,
        default=1,
        metavar="C",
        help="rail chunks per wave of the PERM / JOINT plans (PlanOptions.chunks, recorded as "
        "context.settings.chunks; a RailWave config using the file must set the same chunks; "
        "default 1, whole waves)",
    )
    group.add_argument("--dtype", default="bf16", help="payload element type (default bf16)")
    rule = parser.add_argument_group("keep rule")
    rule.add_argument("--max-spread", type=float, default=1.2, help="max p90/p10 (default 1.2)")
    rule.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="min conservative gain over JOINT, p90 vs p10 (default 0.05)",
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="also write every request's numbers"
    )
    parser.set_defaults(handler=run)
    _outputs.declare_outputs(parser, files=("out", "json"))


def load_model(path: str | None):
    """The ``NetModelConfig`` of ``--model`` (None: the built-in defaults)."""
    from megatron_railwave.lab.netmodel import NetModelConfig, load_netmodel_config

    return load_netmodel_config(path) if path else NetModelConfig()


def model_dict(model) -> dict[str, Any]:
    """The model's parameters as recorded in the anchors file (provenance; validate reuses them)."""
    return model.to_dict()


def with_selector_settings(anchor_set, tuned: dict[str, Any]):
    """``anchor_set`` with the tuned thresholds in ``context.settings.selector`` (scores stay in the
    JSON), keeping only the anchors that hold across seeds under them (``tuned['held']``; none when
    no setting beats always-JOINT): ``anchors_dropped`` records how many passed the keep rule but
    not that check."""
    from megatron_railwave.selector.anchors import AnchorSet, CalibrationContext

    ctx = anchor_set.context
    held = set(tuned.get("held", [a.name for a in anchor_set.anchors]))
    anchors = tuple(a for a in anchor_set.anchors if a.name in held)
    selector = {
        k: tuned[k] for k in ("payload_ratio", "shape_distance", "method", "left_out", "tolerance")
    }
    if "hold_rule" in tuned:
        selector["hold_rule"] = bool(tuned["hold_rule"])
    selector["anchors_dropped"] = len(anchor_set.anchors) - len(anchors)
    if tuned.get("fallback_below"):
        selector["fallback_below"] = dict(tuned["fallback_below"])
    if tuned.get("model"):
        selector["model"] = dict(tuned["model"])
    settings = {**ctx.settings, "selector": selector}
    return AnchorSet(
        anchors=anchors,
        scales=anchor_set.scales,
        context=CalibrationContext(
            topology=ctx.topology,
            hidden_size=ctx.hidden_size,
            dtype=ctx.dtype,
            backend=ctx.backend,
            date=ctx.date,
            settings=settings,
        ),
    )


def check_measure_args(args: argparse.Namespace) -> None:
    if args.repeats < 1 or args.warmups < 0:
        raise ValueError(
            f"need --repeats >= 1 and --warmups >= 0, got {args.repeats} and {args.warmups}"
        )


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
                *[r["latency_s"][p]["median"] * 1e3 for p in tuple(map(str, ROUTES))],
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
    check_measure_args(args)
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
    model = load_model(args.model)
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
            "model": model_dict(model),
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
    anchor_set = with_selector_settings(result.anchor_set, tuned)
    save_anchors(anchor_set, args.out)
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
        f"{tuned['left_out']}s); wrote {args.out}"
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
