"""``railwave testbed up|run|down``: the real exchange on an emulated rail cluster (network
namespaces).

Letters: N nodes, G GPUs per node (= rails), T tokens per rank, H hidden size.

``up`` brings up a testbed that outlives the command (its spec is saved under ``--state-dir``);
``run`` measures the four paths on replay workloads and the mid-run rail failure, either on a
testbed made by ``up`` (``--name``) or on a temporary one that it takes down at the end;
``down NAME`` removes a testbed by its full name. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from megatron_railwave.commands import _args, _common, _outputs, _render
from megatron_railwave.names import ROUTES

__all__ = ["register"]

_DEFAULT_STATE_DIR = "/tmp/railwave-testbeds"
_PRIMARY_FIT = "wave_latency"
"""The flow model's one fitted parameter for the goal (the other fit is reported alongside)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "testbed",
        help="emulated rail cluster (network namespaces): up, run the exchange study, down",
        description="Bring up an emulated rail cluster, run the exchange study and fault test on "
        "it, take it down.",
    )
    sub = parser.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="bring up a testbed that stays up (saved under --state-dir)")
    _add_spec_args(up)
    _add_state_dir(up, written=True)
    up.set_defaults(handler=_up)

    down = sub.add_parser("down", help="remove testbeds by full name (as printed by up)")
    down.add_argument("names", nargs="+", metavar="NAME", help="full testbed name, e.g. rwb3f2a")
    _add_state_dir(down)
    down.set_defaults(handler=_down)

    run = sub.add_parser(
        "run", help="measure NATIVE/RAIL/PERM/JOINT on replay workloads, plus the rail fault"
    )
    _add_study_args(
        run,
        patterns="ring,moderate,extreme",
        patterns_help="sending arrangements (default all three)",
        rails_help="replayed layer: balanced and/or skewed rails",
        paths_help="paths to measure (default all); NAME+streamed also measures NAME with its "
        "relay streamed into the rail phases (e.g. joint+streamed)",
    )
    _add_workload_args(run, hidden=4096)
    run.add_argument(
        "--balanced-layer",
        type=int,
        default=None,
        help="MoE layer for 'balanced' (default: lowest skew)",
    )
    run.add_argument(
        "--skewed-layer",
        type=int,
        default=None,
        help="MoE layer for 'skewed' (default: highest skew)",
    )
    run.add_argument(
        "--arrange-mode",
        default="even",
        choices=["even", "relabel"],
        help="how workloads.arrange_topk_ids moves records onto the windows (default even)",
    )
    group = _args.add_measure_args(
        run,
        warmups=2,
        repeats=None,
        warmups_help="untimed rounds per workload",
        renamed_warmup=True,
    )
    _args.add_flag(group, "--samples", 10, help="timed rounds per workload")
    run.add_argument(
        "--no-recv-first",
        action="store_true",
        help="post sends before receives as the exchange does (gloo then runs pairs half-duplex)",
    )
    run.add_argument(
        "--fault",
        choices=["on", "off", "only"],
        default="on",
        help="mid-run rail failure experiment after the study (default on)",
    )
    run.add_argument(
        "--fail-rail",
        type=_args.parse_failed_rail,
        default=(1, 1),
        metavar="NODE:RAIL",
        help="NIC taken down by the fault experiment (default 1:1)",
    )
    run.add_argument(
        "--exchange-timeout-s",
        type=float,
        default=5.0,
        help="TorchDistExchange timeout of the run that does not know the rail failed (default 5)",
    )
    run.add_argument(
        "--incast",
        action="store_true",
        help="also measure k-to-1 goodput into one port (k = 1..N-1)",
    )
    _args.add_output_args(run, json="all results")
    run.set_defaults(handler=_run)

    online = sub.add_parser(
        "online",
        help="the online path selector over training steps against each fixed path "
        "(issue 33, goal 2)",
    )
    _add_study_args(
        online,
        patterns="extreme",
        patterns_help="sending arrangements of the layers (default extreme)",
        rails_help="layers: balanced and/or skewed rails (default both)",
        paths_help="fixed paths run next to the online selector (default all four)",
    )
    _args.add_flag(online, "--steps", 40)
    _add_workload_args(online, hidden=1024)
    group = _args.add_measure_args(
        online,
        warmups=2,
        repeats=None,
        warmups_help="untimed rounds of every fixed path first",
        renamed_warmup=True,
    )
    _args.add_flag(group, "--timeout", 1800.0, help="limit of the worker run in seconds")
    _args.add_output_args(online, json="all results")
    online.set_defaults(handler=_online)


def _add_study_args(
    parser: argparse.ArgumentParser,
    *,
    patterns: str,
    patterns_help: str,
    rails_help: str,
    paths_help: str,
) -> None:
    """The testbed to run on and what ``run`` / ``online`` replay on it."""
    parser.add_argument(
        "--name", default=None, help="run on this testbed (from `up`); default: a temporary one"
    )
    _add_state_dir(parser)
    _add_spec_args(parser)
    parser.add_argument("--patterns", default=patterns, help=patterns_help)
    parser.add_argument("--rails", default="balanced,skewed", help=rails_help)
    parser.add_argument("--paths", default=",".join(map(str, ROUTES)), help=paths_help)


def _add_state_dir(parser: argparse.ArgumentParser, *, written: bool = False) -> None:
    """``--state-dir``: where ``up`` saves the specs (``written``: this command writes it)."""
    parser.add_argument(
        "--state-dir",
        default=_DEFAULT_STATE_DIR,
        metavar="DIR",
        help=f"where testbed specs are saved (default {_DEFAULT_STATE_DIR})",
    )
    if written:
        _outputs.declare_outputs(parser, dirs=("state_dir",))


def _add_workload_args(parser: argparse.ArgumentParser, *, hidden: int) -> None:
    """The replayed GLM-4.5-Air layers' size, the same flags for ``run`` and ``online``."""
    _args.add_workload_args(
        parser,
        tokens=64,
        hidden=hidden,
        dtype="bf16",
        per="rank",
        dtypes=("bf16", "fp16", "fp32"),
        seed_help="GLM-4.5-Air routing seed",
    )


def _add_spec_args(parser: argparse.ArgumentParser) -> None:
    """The emulated cluster: its shape, NICs, switch ports and TCP settings."""
    _args.add_shape_args(parser, nodes=4, gpus_per_node=4, gpus_help="G = rails per node")
    parser.add_argument(
        "--rail-mbit",
        type=float,
        default=10.0,
        help="rate of every NIC, Mbit/s (default 10: the workers stay under half of two cores)",
    )
    parser.add_argument(
        "--mtu", type=int, default=4096, help="rail MTU in bytes (default 4096, as RoCE)"
    )
    parser.add_argument(
        "--port-buffer-bytes",
        type=int,
        default=32768,
        help="receiver-facing switch port queue (default 32768 = 8 packets of 4 KiB)",
    )
    parser.add_argument(
        "--rto-min-ms", type=int, default=50, help="TCP minimum RTO on the rails (default 50)"
    )
    parser.add_argument(
        "--sender-queue-bytes",
        type=int,
        default=32768,
        help="bytes a TCP socket may queue on its NIC (tcp_limit_output_bytes; default 32768; "
        "0 = kernel default 4 MiB)",
    )
    parser.add_argument(
        "--prefix", default="rwb", help="name prefix, 1-4 lowercase chars (default rwb)"
    )


def _spec_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from megatron_railwave.lab.testbed import TestbedSpec

    return TestbedSpec(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        rail_mbit=args.rail_mbit,
        mtu=args.mtu,
        port_buffer_bytes=args.port_buffer_bytes,
        rto_min_ms=args.rto_min_ms,
        sender_queue_bytes=args.sender_queue_bytes or None,
        prefix=args.prefix,
    )


def _up(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.testbed import check_prerequisites, save_spec, up

    reason = check_prerequisites()
    if reason is not None:
        raise ValueError(reason)
    spec = up(_spec_from_args(args), keep=True)
    save_spec(spec, args.state_dir)
    _render.print_text(
        f"testbed {spec.name} is up ({spec.nodes} nodes x {spec.gpus_per_node} rails, "
        f"{spec.rail_mbit:g} Mbit/s); run: railwave testbed run --name {spec.name}; "
        f"remove: railwave testbed down {spec.name}"
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.testbed import down, forget_spec

    for name in args.names:
        removed = down(name + "-")  # the trailing dash keeps other testbeds sharing the prefix
        forget_spec(name, args.state_dir)
        _render.print_text(
            f"{name}: removed {len(removed)} namespace(s)"
            if removed
            else f"{name}: nothing to remove"
        )
    return 0


def _load_spec(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from megatron_railwave.lab.testbed import load_spec

    return load_spec(args.name, args.state_dir)


def _split(text: str) -> tuple[str, ...]:
    return tuple(v.strip().lower() for v in text.split(",") if v.strip())


def _run(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.testbed import check_prerequisites, down, up
    from megatron_railwave.lab.testbed.experiment import (
        FaultConfig,
        StudyConfig,
        goals,
        incast_sweep,
        run_fault,
        run_study,
    )

    temporary = args.name is None
    spec = _spec_from_args(args) if temporary else _load_spec(args)
    if spec.nodes < 2:
        raise ValueError(
            f"the testbed study needs at least 2 nodes (got {spec.nodes}): it measures traffic "
            "between nodes over the rails, and one node has none; use --nodes 2 or more"
        )
    reason = check_prerequisites()
    if reason is not None:
        raise ValueError(reason)
    study_cfg = StudyConfig(
        patterns=_split(args.patterns),
        rails=_split(args.rails),
        paths=_split(args.paths),
        tokens=args.tokens,
        hidden=args.hidden,
        dtype=args.dtype,
        warmup=args.warmups,
        samples=args.samples,
        seed=args.seed,
        balanced_layer=args.balanced_layer,
        skewed_layer=args.skewed_layer,
        arrange_mode=args.arrange_mode,
        recv_first=not args.no_recv_first,
    )
    fault_cfg = FaultConfig(
        fail=tuple(args.fail_rail),
        exchange_timeout_s=args.exchange_timeout_s,
        pattern="ring",
        rails="skewed",
        tokens=args.tokens,
        hidden=args.hidden,
        dtype=args.dtype,
        seed=args.seed,
        recv_first=not args.no_recv_first,
    )
    out: dict[str, Any] = {
        "command": "testbed run",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "loadavg_start": os.getloadavg(),
    }
    if temporary:
        up(spec)
    try:
        if args.incast:
            # 80 ms of line rate per sender, at least 1 MiB.
            nbytes = max(1 << 20, int(spec.rail_mbit * 1e6 / 8 * 0.08))
            out["incast"] = incast_sweep(
                spec, tuple(range(1, spec.nodes)), nbytes=nbytes, repeats=5
            )
            _print_incast(out["incast"], spec)
        if args.fault != "only":
            out["study"] = run_study(spec, study_cfg)
            _print_study(out["study"])
            out["model_comparison"] = _model_comparison(out["study"], out.get("incast"))
            out["study"]["goals"] = goals(
                out["study"]["workloads"], out["model_comparison"].get(_PRIMARY_FIT)
            )
            _print_goals(out["study"]["goals"])
        if args.fault != "off":
            out["fault"] = run_fault(spec, fault_cfg)
            _print_fault(out["fault"])
    finally:
        if temporary:
            down(spec)
    out["loadavg_end"] = os.getloadavg()
    _render.print_text(
        "load average (1, 5, 15 min) at start {:.1f} {:.1f} {:.1f}, at end {:.1f} {:.1f} "
        "{:.1f}".format(*out["loadavg_start"], *out["loadavg_end"])
    )
    if args.json:
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    return 0


def _online(args: argparse.Namespace) -> int:
    from megatron_railwave.lab.testbed import check_prerequisites, down, up
    from megatron_railwave.lab.testbed.experiment import StudyConfig, run_online

    temporary = args.name is None
    spec = _spec_from_args(args) if temporary else _load_spec(args)
    if spec.nodes < 2:
        raise ValueError(
            f"the online run needs at least 2 nodes (got {spec.nodes}); use --nodes 2 or more"
        )
    cfg = StudyConfig(
        patterns=_split(args.patterns),
        rails=_split(args.rails),
        paths=_split(args.paths),
        tokens=args.tokens,
        hidden=args.hidden,
        dtype=args.dtype,
        seed=args.seed,
        warmup=args.warmups,
        timeout_s=args.timeout,
    )
    if "native" not in cfg.paths or args.steps < 1:
        raise ValueError(
            f"--paths must include native (the balanced layers' reference; got {args.paths!r}) and "
            f"--steps must be >= 1 (got {args.steps})"
        )
    reason = check_prerequisites()
    if reason is not None:
        raise ValueError(reason)
    if temporary:
        up(spec)
    try:
        out = run_online(spec, cfg, steps=args.steps)
    finally:
        if temporary:
            down(spec)
    s = out["summary"]
    for name, lay in out["layers"].items():
        t = lay["totals_s"]
        _render.print_text(
            f"{name} (layer {lay['layer']}, rho_g {lay['native_demand_stats']['rho_g']:.2f}): "
            f"online {t['online']:.3f} s "
            f"= {lay['online_over_oracle']:.4f}x its oracle ({lay['oracle_path']}, "
            f"{lay['oracle_s']:.3f} s); "
            + ", ".join(f"{p} {t[p]:.3f} s" for p in args.paths.split(","))
            + f"; {lay['probe_calls']} probe calls of {out['steps']}; last path "
            f"{lay['path_per_step'][-1]}"
        )
    g = s["goals"]
    _render.print_text(
        f"total over {len(out['layers'])} layers x {out['steps']} steps: online "
        f"{s['online_s']:.3f} s = "
        f"{s['online_over_oracle']:.4f}x the per-layer oracle ({s['per_layer_oracle_s']:.3f} s); "
        + ", ".join(
            f"always-{p.upper()} {s[f'always_{p}_over_oracle']:.4f}x" for p in args.paths.split(",")
        )
        + f"; goals: <= 1.05x oracle {'MET' if g['within_1.05x_oracle'] else 'MISSED'}, balanced "
        f"layers <= 1.03x "
        f"NATIVE "
        f"{dict({True: 'MET', False: 'MISSED', None: 'n/a'})[g['balanced_within_1.03x_native']]} "
        f"({', '.join(f'{k} {v:.4f}x' for k, v in s['balanced_online_over_native'].items())}); "
        f"ranks decide the "
        f"same: {s['ranks_decide_the_same']}; every policy bitwise equal: "
        f"{s['all_policies_bitwise_equal']}; "
        f"wall {out['run_wall_s']:.0f} s"
    )
    if args.json:
        _common.write_json(args.json, out)
        _render.print_text(f"wrote {args.json}")
    return 0


def _model_comparison(study: dict[str, Any], incast: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The flow model on the same plans (``testbed.model_compare``), if this checkout has it: the
    primary fit (``_PRIMARY_FIT``, used for the goal) and the other one."""
    try:
        from megatron_railwave.lab.testbed.model_compare import compare_with_netmodel

        res = {
            fit: compare_with_netmodel(study, incast=incast, fit_param=fit)
            for fit in (_PRIMARY_FIT, "rail_rate")
        }
    except ImportError as exc:
        return {"unavailable": f"flow model not importable ({exc}); compare later from this JSON"}
    for fit, r in res.items():
        _render.print_text(
            f"flow model, {fit} fitted on {r['model']['fitted_on']} = "
            f"{r['model']['fitted_value']}: "
            f"{r['within_25pct_comm']}/{r['cases']} within 25% of the measured P50 "
            f"(max error {r['max_abs_rel_error_comm']:.2f})"
        )
    primary = res[_PRIMARY_FIT]
    _render.print_table(
        f"flow model ({_PRIMARY_FIT} fitted) against the slowest rank's dispatch + combine P50",
        ["workload", "path", "measured ms", "model ms", "error", "unfitted ms", "error unfitted"],
        [
            [
                r["workload"],
                r["path"],
                r["measured_comm_p50_s"] * 1e3,
                r["model_s"] * 1e3,
                r["rel_error_comm"],
                r["model_unfitted_s"] * 1e3,
                r["rel_error_comm_unfitted"],
            ]
            for r in primary["rows"]
        ],
    )
    return res


def _print_goals(result: dict[str, Any]) -> None:
    rows = []
    for name, g in result.items():
        detail = {k: v for k, v in g.items() if k not in ("met", "cases")}
        if "cases" in g and isinstance(g["cases"], list):
            detail["worst_dev"] = max((c["dev"] for c in g["cases"]), default=None)
        rows.append(
            [
                name,
                {True: "met", False: "MISSED", None: "n/a"}[g["met"]],
                json.dumps(detail, default=float)[:160],
            ]
        )
    _render.print_table("goals", ["goal", "status", "numbers"], rows)


def _print_incast(rows: list[dict[str, Any]], spec: Any) -> None:
    _render.print_table(
        f"k-to-1 goodput into one {spec.rail_mbit:g} Mbit/s port (buffer {spec.port_buffer_bytes} "
        f"B, MTU {spec.mtu}, "
        f"rto_min {spec.rto_min_ms} ms)",
        ["k", "median s", "goodput / rate", "times s"],
        [
            [
                r["fan_in"],
                r["median_s"],
                r["goodput_over_rate"],
                " ".join(f"{t:.3f}" for t in r["times_s"]),
            ]
            for r in rows
        ],
    )


def _print_study(study: dict[str, Any]) -> None:
    for name, wl in study["workloads"].items():
        rows = []
        for path, d in wl["paths"].items():
            s = d["slowest_s"]
            rows.append(
                [
                    path,
                    s["p50"] * 1e3,
                    s["p95"] * 1e3,
                    d["comm_slowest_s"]["p50"] * 1e3,
                    d["planning_slowest_s"]["p50"] * 1e3,
                    d["port_bound_s"] * 1e3,
                    d["speedup_vs_native"]["p50"],
                    d["bound_speedup_vs_native"],
                    d["speedup_over_bound_speedup"],
                    d["worker_cpu_over_wall"]["p50"],
                    " ".join(f"{v:.2f}" for node in d["nic_shares"]["share_NR"] for v in node),
                    d["nic_shares"]["max_dev_from_node_mean"],
                ]
            )
        _render.print_table(
            f"{name} (layer {wl['layer']}, rho_g {wl['native_demand_stats']['rho_g']:.2f}, peak "
            f"fan-in "
            f"{wl['peak_fanin']}, bitwise equal: {wl['all_paths_bitwise_equal']})",
            [
                "path",
                "P50 ms",
                "P95 ms",
                "comm P50 ms",
                "plan P50 ms",
                "port bound ms",
                "x NATIVE P50",
                "bound x NATIVE",
                "x / bound x",
                "CPU/wall",
                "NIC shares (per node)",
                "max dev",
            ],
            rows,
        )
    _render.print_text(
        f"machine CPU busy {study['machine_cpu_busy_fraction']:.2f} over "
        f"{study['run_wall_s']:.0f} s"
    )


def _print_fault(fault: dict[str, Any]) -> None:
    aware = fault["aware"]
    _render.print_text(
        f"fault (rail {fault['config']['fail']}): healthy paths bitwise equal "
        f"{fault['healthy_paths_bitwise_equal']}; "
        f"after the failure, with it in the topology: all equal to healthy NATIVE "
        f"{aware['all_equal_to_healthy_native']}, "
        f"failed NIC bytes {aware['failed_nic_bytes']}; without it: raised "
        f"{fault['unaware']['raised']}, names the "
        f"rail {fault['unaware']['names_failed_rail']}"
    )
    for err in fault["unaware"]["errors"][:3]:
        _render.print_text(
            f"  rank {err['rank']} {err['type']} after {err['after_s']:.1f} s: "
            f"{err['message'][:200]}"
        )
