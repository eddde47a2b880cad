"""``railwave doctor``: an environment report to paste into a bug report (and the first step of
``make gpu-check``); what it gathers is ``lab.bench.environment``'s. Exit status: 0, or 1 when
the self-test fails or the config does not load.
"""

from __future__ import annotations

import argparse

from megatron_railwave.commands import _args, _render

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="environment report: versions, compiled ops, GPUs and NICs, config, a "
        "virtual-cluster self-test",
        description="Print what this environment gives RailWave (paste it into bug reports).",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="RailWave config to report (default: $RAILWAVE_CONFIG, else the defaults)",
    )
    parser.add_argument(
        "--no-self-test", action="store_true", help="skip the virtual-cluster self-test"
    )
    _args.add_output_args(parser, json="the report")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from megatron_railwave.commands._common import write_json
    from megatron_railwave.lab.bench.environment import collect_environment

    report = collect_environment(config=args.config, run_self_test=not args.no_self_test)
    v, c = report["versions"], report["compiled_ops"]
    _render.print_table(
        "railwave doctor: versions",
        ["component", "version"],
        [[k, "-" if val is None else val] for k, val in v.items()],
    )
    _render.print_text(
        f"compiled ops: cpu {c['cpu']}, cuda {c['cuda']}; torch CUDA archs "
        f"{' '.join(c['torch_cuda_arch_list']) or '-'}"
        + (f"; load error: {c['load_error']}" if c["load_error"] else "")
    )
    gpus = report["gpus"]
    _render.print_text(
        "GPUs: "
        + (
            "; ".join(f"{g['index']}: {g['name']} {g['memory_gib']} GiB sm_{g['sm']}" for g in gpus)
            if gpus
            else "none visible to torch"
        )
    )
    nics = report["nics"]
    _render.print_text(
        "RDMA NICs (/sys/class/infiniband): "
        + (
            "; ".join(
                f"{n['device']} "
                + ",".join(f"port {p['port']} {p['state']} {p['rate']}" for p in n["ports"])
                for n in nics
            )
            if nics
            else "none"
        )
    )
    if report["nvidia_smi_topo"]:
        _render.print_text("nvidia-smi topo -m:\n" + report["nvidia_smi_topo"])
    cfg = report["railwave_config"]
    _render.print_text(
        f"RailWave config ({cfg['source']}): "
        + (f"ERROR {cfg['error']}" if "error" in cfg else str(cfg["config"]))
    )
    status = 1 if "error" in cfg else 0
    if "self_test" in report:
        st = report["self_test"]
        _render.print_text(
            f"self-test (virtual cluster 2x2, CPU): {'ok' if st['ok'] else 'FAILED'} "
            f"in {st['seconds']} s"
            + (
                f" ({st['error']})"
                if "error" in st
                else f" (bitwise equal {st['all_bitwise_equal']}, "
                f"max rel. error {st['max_rel_error']:.2e})"
            )
        )
        status = status or (0 if st["ok"] else 1)
    if args.json:
        write_json(args.json, report)
    return status
