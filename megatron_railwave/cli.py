"""``railwave``: command-line front of megatron-railwave.

Each subcommand lives in its own module under ``megatron_railwave.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` (a function of the parsed
arguments returning an exit status). This module only lists those modules: a new command is a new
module plus one line in ``COMMAND_MODULES``. Command modules import their heavy dependencies inside
their handlers, so ``railwave --help`` stays fast and one broken command cannot break the others.

User errors (``ValueError`` raised by the package, e.g. an unknown path name, a
missing cluster file or a failed rail out of range) are printed as one line and exit with status 2.
Output paths a command declares (``commands._outputs``) are checked before its handler runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from megatron_railwave import __version__
from megatron_railwave.commands._outputs import check_outputs

__all__ = ["COMMAND_MODULES", "build_parser", "main"]

COMMAND_MODULES: tuple[str, ...] = (
    "megatron_railwave.commands.plan",
    "megatron_railwave.commands.plan_bench",
    "megatron_railwave.commands.demo",
    "megatron_railwave.commands.bench_exchange",
    "megatron_railwave.commands.call_costs",
    "megatron_railwave.commands.probe_incast",
    "megatron_railwave.commands.simulate_exchange",
    "megatron_railwave.commands.bench",
    "megatron_railwave.commands.sensitivity",
    "megatron_railwave.commands.calibrate",
    "megatron_railwave.commands.validate",
    "megatron_railwave.commands.online_sim",
    "megatron_railwave.commands.report",
    "megatron_railwave.commands.testbed",
    "megatron_railwave.commands.netmodel",
    "megatron_railwave.commands.workloads",
    "megatron_railwave.commands.ops_bench",
    "megatron_railwave.commands.doctor",
)
"""Modules that each register one subcommand, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="railwave",
        description="Rail-balanced, incast-bounded expert-parallel communication for "
        "Megatron-Core MoE.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_outputs(args)
        status = args.handler(args)
    except ValueError as exc:
        parser.exit(2, f"railwave {args.command}: error: {exc}\n")
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
