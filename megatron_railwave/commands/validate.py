"""``railwave validate``: the calibrated selector on held-out requests.

Requests come from the generator recorded in the anchors file (``context.settings.requests``),
held out from calibration (``calibration.held_out_settings``, checked by
``calibration.check_held_out``): glm takes another workload seed (``--seed``) and layers that
calibration did not use (``--layers``, default all the others; ``--requests`` keeps the first
that many); synthetic takes routing families numbered from ``--seed`` that calibration never saw.
T per GPU, arrangements and payload scales are calibration's. For each request: the selected path
(and anchor), its median latency, JOINT's and the best fixed path's.

Goals, printed as met or missed: the selected path is within 3% of the best fixed path on every
request, and the total over all requests beats always-JOINT. Also: path changes between
consecutive layers (per sequence of layers with one seed, T, arrangement and scale), totals of
every always-X policy. ``--require-goals`` exits 1 when a goal is missed.

The selector's host decision cost per layer (``calibration.bench_selector``: as the dispatcher
pays it, from the counts in the count exchange's form) is measured on every run; with a backend
it is set against the gain: the selection's and the best path per request's saving per layer against
always-JOINT, and the totals with the decisions paid (``ValidationResult.with_decision_cost``;
a host timing of this machine, reported, not a goal), for a forward-only call and for training,
where one decision's path also runs the backward (and the recompute). ``--bench`` alone needs no
backend.

JSON written by ``--json``: ``held_out`` (the validation settings), ``summary`` (``goals``,
``num_path_changes``, ``path_changes_per_sequence``, totals, worst ratio, ...), ``requests`` (per
request: sequence, position, selected, anchor, selected_s, joint_s, best_path, best_s,
ratio_to_best, within_goal, gain_vs_joint, median_s per path), ``bench`` (us_per_decision,
us_per_descriptors, descriptors_in_decision, num_anchors, repeats) and, with a backend,
``decision_cost`` (``ValidationResult.with_decision_cost`` over every request, one exchange per
decision) and ``decision_cost_by_pass`` (the same on the requests sent all node pairs at once, the
dispatcher's input, for each kind of layer call: forward only, training, training with recompute,
``calibration.PASS_EXCHANGES``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check the calibrated selector on unseen requests (or --bench its cost)",
        description="Select a path with the anchors for requests not used for calibration, time "
        "all "
        "four paths and report the selected path against JOINT and the best fixed path.",
    )
    _args.add_flag(parser, "--anchors", required=True)
    _args.add_flag(
        parser,
        "--cluster",
        help="cluster file or preset",
        default_text="the anchors file's topology",
    )
    _args.add_replay_measure_args(
        parser,
        model_help="netmodel parameters (a YAML file or a packaged name, e.g. h800_4x8)",
        model_default_text="the model recorded in the anchors file",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="K",
        help="glm: keep the first K held-out layers; synthetic: K held-out families "
        "(default: all held-out layers / as many families as calibration)",
    )
    _args.add_flag(
        parser,
        "--layers",
        help="glm: held-out layer numbers",
        default_text="every layer calibration did not use",
    )
    _args.add_flag(
        parser,
        "--seed",
        1000,
        help="glm workload seed / first synthetic family of the held-out requests; must "
        "differ from calibration's",
    )
    parser.add_argument(
        "--require-goals", action="store_true", help="exit 1 when a validation goal is missed"
    )
    parser.add_argument(
        "--payload-ratio",
        type=float,
        default=None,
        help="selector payload ratio (default: the anchors file's context.settings.selector, else "
        "1.25)",
    )
    parser.add_argument(
        "--shape-distance",
        type=float,
        default=None,
        help="selector shape distance (default: the anchors file's context.settings.selector, "
        "else 0.02)",
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="print the selector decision cost per layer (no backend needed)",
    )
    parser.add_argument(
        "--rule",
        choices=("anchors", "model"),
        default=None,
        help="decide with the nearest-anchor rule or the file's path model (default: what the "
        "runtime uses: the model when the file records one, else the anchors)",
    )
    _args.add_output_args(parser, json="the per-request table and summary")
    parser.set_defaults(handler=run)


def _describe_gates(model: Any) -> str:
    """The path model's payload gates in words (``RailJointModel.gate``), "" without any."""
    from megatron_railwave.traffic import MiB

    gates = {
        kind: model.gate(input_windows=windows)
        for kind, windows in (("all pairs", 1), ("windowed", 2))
    }
    if all(g is None for g in gates.values()):
        return ""
    mib = {kind: "none" if g is None else f"{g / MiB:.2f} MiB" for kind, g in gates.items()}
    if len(set(mib.values())) == 1:
        return f", payload gate {mib['all pairs']}"
    return ", payload gates " + ", ".join(f"{kind} {text}" for kind, text in mib.items())


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_railwave.lab import calibration
    from megatron_railwave.selector import AnchorSelector, ModelSelector
    from megatron_railwave.selector.anchors import load_anchors
    from megatron_railwave.topology import RailTopology

    _common.check_replay_measure_args(args)
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.backend is None and not args.bench:
        raise ValueError("--backend is required (unless only --bench is asked for)")
    if os.path.isdir(args.anchors):
        raise ValueError(
            f"--anchors {args.anchors!r} is a directory; give the anchors YAML file written by "
            "`railwave calibrate --write-anchors`"
        )
    if not os.path.isfile(args.anchors):
        raise ValueError(
            f"--anchors: file {args.anchors!r} does not exist (write it with `railwave calibrate`)"
        )
    if args.cluster is not None:
        topo = _common.cluster_from_args(args)
        anchor_set = load_anchors(args.anchors, topo)  # rejects another topology
    else:
        anchor_set = load_anchors(args.anchors, None)
        topo = RailTopology.from_dict(
            {k: v for k, v in anchor_set.context.topology.items()},
            source=f"anchors file {args.anchors!r}: context.topology",
        )
    payload_ratio, shape_distance = anchor_set.thresholds(args.payload_ratio, args.shape_distance)
    rule = args.rule or ("model" if anchor_set.path_model is not None else "anchors")
    if rule == "model" and anchor_set.path_model is None:
        raise ValueError(
            f"--rule model: anchors file {args.anchors!r} records no path model (field "
            "'context.settings.selector.model'); re-run `railwave calibrate` or use --rule anchors"
        )
    anchors_rule = AnchorSelector(
        anchor_set,
        payload_ratio=payload_ratio,
        shape_distance=shape_distance,
        fallback_below=anchor_set.fallback_below,
    )
    selector: Any = ModelSelector(anchor_set.path_model, topo) if rule == "model" else anchors_rule
    settings = anchor_set.context.settings.get("requests")
    if not isinstance(settings, dict) or "payload_scales" not in settings:
        raise ValueError(
            f"anchors file {args.anchors!r}: field 'context.settings.requests' is missing; it "
            "names the calibration requests (write the file with `railwave calibrate`)"
        )
    from megatron_railwave.traffic import dtype_bytes

    record_bytes = anchor_set.context.hidden_size * dtype_bytes(anchor_set.context.dtype)
    held_out = calibration.held_out_settings(
        settings, seed=args.seed, count=args.requests, layers=args.layers
    )
    requests = calibration.validation_requests(
        topo,
        settings,
        seed=args.seed,
        count=args.requests,
        layers=args.layers,
        record_bytes=record_bytes,
    )
    below = anchor_set.fallback_below
    out: dict[str, Any] = {
        "held_out": held_out,
        "selector": {
            "rule": rule,
            "payload_ratio": payload_ratio,
            "shape_distance": shape_distance,
            "fallback_below": {"payload_bytes": below[0], "path": str(below[1])} if below else None,
        },
    }
    status = 0
    bench = None
    if args.bench or args.backend is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            bench = calibration.bench_selector(
                selector, requests, topo, num_anchors=len(anchor_set.anchors)
            )
        finally:
            torch.set_num_threads(threads)
        out["bench"] = bench
        rule_text = (
            f"{bench['num_anchors']} anchors"
            if rule == "anchors"
            else "the path model" + _describe_gates(anchor_set.path_model)
        )
        _render.print_text(
            f"selector decision cost ({rule}): {bench['us_per_decision']:.2f} us per layer as the "
            f"dispatcher pays it "
            f"({'with' if bench['descriptors_in_decision'] else 'without'} the descriptors; "
            f"{rule_text}, "
            f"median of 5 x {bench['repeats']} calls, 1 thread, this host); "
            f"descriptors from counts: {bench['us_per_descriptors']:.0f} us"
        )
    if args.backend is not None:
        from megatron_railwave.planner import PlanOptions

        # The JOINT the anchors were calibrated against (context.settings.chunks).
        backend = calibration.make_backend(
            args.backend,
            topo,
            options=PlanOptions(chunks=anchor_set.chunks),
            model=_validation_model(args, anchor_set),
        )
        result = calibration.validate(
            backend,
            selector,
            requests,
            topo,
            scales=anchor_set.scales,
            warmups=args.warmups,
            repeats=args.repeats,
            progress=not args.no_progress,
        )
        data = result.to_dict()
        out.update(data)
        compare = None
        if (
            rule == "model" and anchor_set.anchors
        ):  # the anchor rule on the same medians, side by side
            compare = calibration.rescore(
                result, anchors_rule, requests, topo, scales=anchor_set.scales
            ).summary()
            out["compare"] = {"anchors": compare}
        _render.print_table(
            f"validation on {len(requests)} held-out requests ({backend.name}, median of "
            f"{args.repeats})",
            [
                "request",
                "selected",
                "anchor",
                "selected ms",
                "joint ms",
                "best",
                "best ms",
                "sel/best",
                "gain vs joint",
            ],
            [
                [
                    r["request"],
                    r["selected"],
                    r["anchor"] or "-",
                    r["selected_s"] * 1e3,
                    r["joint_s"] * 1e3,
                    r["best_path"],
                    r["best_s"] * 1e3,
                    r["ratio_to_best"],
                    f"{r['gain_vs_joint']:+.1%}",
                ]
                for r in data["requests"]
            ],
        )
        s = data["summary"]
        goals = s["goals"]
        tol = 1 + s["tolerance"]
        _render.print_text(
            (
                "selector: the path model; "
                if rule == "model"
                else f"selector: anchors, payload ratio {payload_ratio}, shape distance "
                f"{shape_distance}; "
            )
            + f"held out: {_describe_held_out(held_out)}; {s['num_requests']} requests in "
            f"{s['num_sequences']} "
            f"sequences of consecutive layers; selected {s['selected_paths']}; best per request "
            f"{s['best_paths']}; "
            f"{s['num_path_changes']} path changes between consecutive layers"
        )
        _render.print_text(
            f"totals: selected {s['total_selected_s'] * 1e3:.3f} ms, always-JOINT "
            f"{s['total_fixed_s']['joint'] * 1e3:.3f} ms (selected/JOINT "
            f"{s['selected_vs_joint_policy']:.3f}), "
            f"best fixed policy always-{s['best_fixed_policy']} "
            f"{s['total_fixed_s'][s['best_fixed_policy']] * 1e3:.3f} ms, "
            f"best path per request {s['total_best_per_request_s'] * 1e3:.3f} ms"
        )
        _render.print_text(
            f"goal 1, selected within {tol:.2f}x of the best fixed path on every request: "
            f"{'MET' if goals['within_tolerance_of_best_on_every_request'] else 'MISSED'} (worst "
            f"{s['worst_ratio_to_best']:.3f} on {s['worst_request']}; {s['num_over_tolerance']} "
            f"over)"
        )
        _render.print_text(
            f"goal 2, total beats always-JOINT: "
            f"{'MET' if goals['total_beats_always_joint'] else 'MISSED'} "
            f"({s['selected_vs_joint_policy']:.3f})"
        )
        paid = result.with_decision_cost(bench["us_per_decision"] * 1e-6)
        by_pass = result.decision_cost_by_pass(bench["us_per_decision"] * 1e-6)
        out["decision_cost"] = paid
        out["decision_cost_by_pass"] = by_pass
        _render.print_text(
            f"with the decision cost ({paid['decision_s_per_layer'] * 1e6:.0f} us per layer call, "
            f"measured above): "
            f"selected + decisions / JOINT {paid['selected_with_decisions_vs_joint_policy']:.4f} "
            f"({'beats' if paid['total_with_decisions_beats_always_joint'] else 'does not beat'} "
            f"always-JOINT); "
            f"per layer the selection saves {paid['selected_gain_s_per_layer'] * 1e6:.1f} us "
            f"against JOINT, the best "
            f"path per request {paid['best_gain_s_per_layer'] * 1e6:.1f} us (the most any "
            f"decision can earn: "
            f"{'more' if paid['a_decision_could_pay'] else 'less'} than this decision costs)"
        )
        num_all_pairs = by_pass["forward only"]["num_requests"]
        if num_all_pairs:
            _render.print_text(
                f"on the {num_all_pairs} requests sent all node pairs at once (what the dispatcher "
                "sends; the others are replay arrangements), per kind of layer call:"
            )
        for name, uses in calibration.PASS_EXCHANGES.items() if num_all_pairs else ():
            p = by_pass[name]
            _render.print_text(
                f"  {name} ({uses} exchange{'s' if uses > 1 else ''} on one decision's path): "
                f"selected + decisions "
                f"/ JOINT {p['selected_with_decisions_vs_joint_policy']:.4f} "
                f"({'beats' if p['total_with_decisions_beats_always_joint'] else 'does not beat'} "
                f"always-JOINT), "
                f"saving {p['selected_gain_s_per_layer'] * 1e6:.1f} us per decision"
            )
        if compare is not None:
            _render.print_text(
                f"the anchor rule on the same requests and medians: "
                f"{compare['num_over_tolerance']} over {tol:.2f}x "
                f"(worst {compare['worst_ratio_to_best']:.3f}), selected/JOINT "
                f"{compare['selected_vs_joint_policy']:.4f}"
            )
        status = 1 if args.require_goals and not goals["all_met"] else 0
    if args.json:
        _common.write_json(args.json, out)
    return status


def _validation_model(args: argparse.Namespace, anchor_set: Any) -> Any:
    """``calibration.validation_model`` of ``--model``, with a note when it differs from the
    model the anchors file was calibrated on."""
    from megatron_railwave.lab import calibration

    given = _common.load_model(args.model) if args.model else None
    model, changed = calibration.validation_model(anchor_set, given, anchors_path=args.anchors)
    if changed is not None:
        _render.print_text(
            f"note: --model differs from the model the anchors file was calibrated on ({changed}); "
            "the goals below test the file on another network model"
        )
    return model


def _describe_held_out(held: dict[str, Any]) -> str:
    if held.get("workload") == "glm":
        return f"glm seed {held['seed']}, layers {held['layers']}"
    return f"synthetic families {held['families']}"
