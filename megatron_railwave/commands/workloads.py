"""``railwave workloads``: the synthetic GLM-4.5-Air workload against the paper's statistics.

* ``fit``: print the workload statistics of the generator's knobs (``workloads.workload_report``:
  expected counts over ``--steps`` steps x 45 layers, and drawn tokens over ``--sampled-steps``)
  next to the published ones; with ``--refit``, first rerun the fit (``workloads.fit_workload``)
  and report the fitted knobs instead of the defaults. JSON (``--json``): ``report`` and, with
  ``--refit``, ``fit``.
* ``token-skew``: per-rank token counts of captured routing (one or more capture directories,
  ``--railwave-capture-dir``) and the generator's ``token_skew`` measured on them
  (``workloads.token_skew_report``). JSON (``--json``): one report per directory.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megatron_railwave.commands import _args, _common, _render

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "workloads",
        help="synthetic GLM-4.5-Air workload: fit and statistics",
        description="Tools of the synthetic GLM-4.5-Air workload (docs/workloads.md).",
    )
    sub = parser.add_subparsers(dest="workloads_command", metavar="ACTION", required=True)
    fit = sub.add_parser(
        "fit",
        help="workload statistics next to the paper's published ones (optionally refit)",
        description="Statistics of the synthetic GLM-4.5-Air routing (NIC shares under NATIVE, "
        "expert-load and destination-rail skew, R^2) next to the paper's published "
        "values; --refit reruns the fit of the knobs to them.",
    )
    group = fit.add_argument_group("cluster")
    _args.add_flag(
        group,
        "--cluster",
        "h20_4x8",
        help="cluster whose NIC adapters define the shares",
        default_text="h20_4x8, the paper's",
    )
    _args.add_flag(fit, "--seed", 0)
    fit.add_argument(
        "--steps",
        type=int,
        default=20,
        help="steps of expected counts, each with all 45 layers (default 20: 900 pairs, as the "
        "paper)",
    )
    fit.add_argument(
        "--nic-steps",
        type=int,
        default=100,
        help="steps of the NIC shares' expected counts, 3 layers each (default 100)",
    )
    fit.add_argument(
        "--sampled-steps",
        type=int,
        default=2,
        help="steps of drawn tokens, to check the expected counts (default 2; 0 = skip)",
    )
    _args.add_flag(fit, "--tokens", 1024, help="mean tokens per GPU of the drawn steps")
    fit.add_argument("--refit", action="store_true", help="rerun the fit first (minutes)")
    fit.add_argument(
        "--fit-steps",
        type=int,
        default=20,
        help="steps the fit samples, each with all 45 layers (default 20)",
    )
    fit.add_argument(
        "--sweeps", type=int, default=1, help="coordinate-descent sweeps of the fit (default 1)"
    )
    _args.add_output_args(fit, json="the report (and fit)")
    fit.set_defaults(handler=_fit)
    skew = sub.add_parser(
        "token-skew",
        help="token skew (the generator's token_skew) of captured routing",
        description="Per-rank token counts of every captured step of each capture directory "
        "and their token skew: the standard deviation of log tokens over the ranks "
        "of a step (the generator's token_skew), pooled over the steps.",
    )
    skew.add_argument(
        "capture_dirs",
        nargs="+",
        metavar="CAPTURE_DIR",
        help="recorder directories (step*/rank*.npz), e.g. from --railwave-capture-dir",
    )
    _args.add_output_args(skew, json="the reports")
    skew.set_defaults(handler=_token_skew)


def _fit(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.workloads import GlmAirWorkload, fit_workload, workload_report

    if (
        min(args.steps, args.nic_steps, args.tokens, args.fit_steps, args.sweeps) < 1
        or min(args.sampled_steps, args.seed) < 0
    ):
        raise ValueError(
            f"need --steps, --nic-steps, --tokens, --fit-steps, --sweeps >= 1 and "
            f"--sampled-steps, --seed "
            f">= 0, got {args.steps}, {args.nic_steps}, {args.tokens}, {args.fit_steps}, "
            f"{args.sweeps}, "
            f"{args.sampled_steps}, {args.seed}"
        )
    topo = _common.cluster_from_args(args)
    work = GlmAirWorkload(seed=args.seed)
    out = {}
    if args.refit:
        fit = fit_workload(
            topo,
            start=work,
            steps=range(args.fit_steps),
            nic_steps=range(args.nic_steps),
            sweeps=args.sweeps,
            log=_render.print_text,
        )
        work = replace(work, **fit.knobs)  # the fit's layer subset stays with the fit
        out["fit"] = fit.to_dict()
        _render.print_text(
            f"fit: {fit.evaluations} evaluations, {fit.seconds:.0f} s, loss {fit.loss:.4g}"
        )
    report = workload_report(
        topo,
        work,
        steps=range(args.steps),
        nic_steps=range(args.nic_steps),
        sampled_steps=range(args.steps, args.steps + args.sampled_steps),
        sampled_tokens=args.tokens,
    )
    out["report"] = report
    _render.print_table("knobs", ["knob", "value"], [[k, v] for k, v in report["knobs"].items()])
    for kind in ("expected", "sampled"):
        if kind not in report:
            continue
        part = report[kind]
        what = (
            f"expected counts, {args.steps} steps x 45 layers, NIC shares {args.nic_steps} steps "
            f"x 3 layers"
            if kind == "expected"
            else f"drawn tokens ({args.tokens}/GPU), {args.sampled_steps} steps x 45 layers"
        )
        rows = [
            [
                r["statistic"],
                f"{r['published']:.4g}",
                f"{r['ours']:.4g}",
                f"{100 * r['rel_err']:+.1f}%",
                ("yes" if r["within"] else "NO") if r["fitted"] else "(not fitted)",
            ]
            for r in part["rows"]
        ]
        rows += [
            [k, "", f"{part['statistics'][k]:.4g}", "", ""] for k in ("rho_g_p50", "rho_g_p90")
        ]
        _render.print_table(
            f"workload statistics vs the paper ({what}; {topo.name})",
            ["statistic", "paper", "ours", "rel. err", "within 10%"],
            rows,
        )
    if args.json:
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    return 0


def _token_skew(args: argparse.Namespace) -> int:
    import numpy as np

    from megatron_railwave.lab.workloads import capture_token_skew

    reports, rows = {}, []
    for capture_dir in args.capture_dirs:
        report = capture_token_skew(capture_dir)
        reports[capture_dir] = report
        per_step = report["token_skew_per_step"]
        rows.append(
            [
                capture_dir,
                report["steps"],
                report["world"],
                f"{np.mean(report['mean_tokens']):.0f}",
                f"{report['token_skew']:.3f}",
                f"{min(per_step):.3f}-{max(per_step):.3f}",
                f"{np.median(report['max_over_mean']):.2f}",
                f"{max(report['max_over_mean']):.2f}",
            ]
        )
    _render.print_table(
        "token skew of captured routing (std of log tokens per rank, per step; pooled)",
        [
            "capture",
            "steps",
            "ranks",
            "mean tokens",
            "token_skew",
            "per step",
            "max/mean p50",
            "max/mean max",
        ],
        rows,
    )
    if args.json:
        _common.write_json(args.json, reports)
        _render.print_text(f"wrote {args.json}")
    return 0
