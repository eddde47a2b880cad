"""``railwave``: command-line front of megatron-railwave.

Each subcommand lives in its own module under ``megatron_railwave.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` (a function of the parsed
arguments returning an exit status). This module only lists those modules: a new command is a new
module plus one line in ``USER_COMMANDS`` or ``LAB_COMMANDS``. Command modules import their heavy
dependencies inside their handlers, so ``railwave --help`` stays fast and one broken command
cannot break the others.

The two lists, which ``railwave --help`` shows under their own headings:
  * user commands: what a training user runs on their own cluster and logs: ``doctor`` (the
    environment), ``report`` (the training logs), ``plan`` / ``plan-bench`` / ``demo`` (what the
    planner does with a layer, and what it costs) and ``probe-incast`` (the fabric's incast
    loss);
  * lab commands: the evaluation lab's benchmarks, simulations and model tools, which study the
    runtime rather than serve a training job (``lab/``).

User errors (``ValueError`` raised by the package, e.g. an unknown path name, a
missing cluster file or a failed rail out of range) are printed as one line and exit with status 2.
Output paths a command declares (``commands._outputs``) are checked before its handler runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from megatron_railwave import __version__
from megatron_railwave.commands._outputs import check_outputs

__all__ = ["USER_COMMANDS", "LAB_COMMANDS", "COMMAND_MODULES", "build_parser", "main"]

_PACKAGE = "megatron_railwave.commands"

USER_COMMANDS: tuple[str, ...] = (
    f"{_PACKAGE}.doctor",
    f"{_PACKAGE}.report",
    f"{_PACKAGE}.plan",
    f"{_PACKAGE}.plan_bench",
    f"{_PACKAGE}.demo",
    f"{_PACKAGE}.probe_incast",
)
"""Modules of the commands a training user runs, in the order ``--help`` lists them."""

LAB_COMMANDS: tuple[str, ...] = (
    f"{_PACKAGE}.bench",
    f"{_PACKAGE}.bench_exchange",
    f"{_PACKAGE}.call_costs",
    f"{_PACKAGE}.simulate_exchange",
    f"{_PACKAGE}.ops_bench",
    f"{_PACKAGE}.sensitivity",
    f"{_PACKAGE}.online_sim",
    f"{_PACKAGE}.testbed",
    f"{_PACKAGE}.netmodel",
    f"{_PACKAGE}.workloads",
)
"""Modules of the evaluation lab's commands, in the order ``--help`` lists them."""

COMMAND_MODULES: tuple[str, ...] = USER_COMMANDS + LAB_COMMANDS
"""Every module that registers one subcommand."""

_SECTIONS = (("user commands", USER_COMMANDS), ("lab commands", LAB_COMMANDS))


class _Listing:
    """What a command's ``register`` gets as ``subparsers``: adds its parser to the real one and
    records the command's name and one-line help for the help section it belongs to."""

    def __init__(self, subparsers: argparse._SubParsersAction) -> None:
        self._subparsers = subparsers
        self.commands: list[tuple[str, str]] = []

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        self.commands.append((name, kwargs.get("help", "")))
        return self._subparsers.add_parser(name, **kwargs)


def _sections_text(sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
    """The command list, one section per heading, laid out as argparse lays out arguments."""
    formatter = argparse.HelpFormatter(prog="railwave")
    for title, commands in sections:
        formatter.start_section(title)
        formatter.add_arguments(
            [argparse.Action([], dest=name, metavar=name, help=text) for name, text in commands]
        )
        formatter.end_section()
    return formatter.format_help().rstrip()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand; its help lists the user commands
    first, then the lab commands under their own heading."""
    parser = argparse.ArgumentParser(
        prog="railwave",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print the version of megatron-railwave and exit",
    )
    # The command list is the description (argparse cannot group one subparsers action's
    # choices under two headings), so the action itself is left out of the help.
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, prog="railwave", help=argparse.SUPPRESS
    )
    sections = []
    for title, modules in _SECTIONS:
        listing = _Listing(subparsers)
        for name in modules:
            importlib.import_module(name).register(listing)
        sections.append((title, listing.commands))
    parser.description = (
        "Rail-balanced, incast-bounded expert-parallel communication for Megatron-Core MoE.\n\n"
        + _sections_text(sections)
        + "\n\n'railwave COMMAND --help' shows a command's flags. In every command --json FILE\n"
        "writes a JSON file and --out DIR a directory."
    )
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
