"""Output paths of the CLI commands, checked right after parsing, before any work is done.

A command declares the flags that name files or directories it writes
(``declare_outputs(parser, files=("json",), dirs=("out",))``); ``railwave`` checks every one of
them before calling the handler, so a bad ``--json`` costs nothing instead of a traceback after a
long run. The checks are ``outputs``'.
"""

from __future__ import annotations

import argparse

from megatron_railwave.outputs import check_output_dir, check_output_file

__all__ = ["declare_outputs", "check_outputs"]


def declare_outputs(
    container: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    files: tuple[str, ...] = (),
    dirs: tuple[str, ...] = (),
) -> None:
    """Add argument dests of ``container`` (a parser, or one of its groups: they share the
    parser's defaults) to those that name output files and output directories."""
    container.set_defaults(
        output_files=tuple(container.get_default("output_files") or ()) + files,
        output_dirs=tuple(container.get_default("output_dirs") or ()) + dirs,
    )


def check_outputs(args: argparse.Namespace) -> None:
    """Check every declared output of the parsed ``args`` (None = not given, skipped)."""
    for dest in getattr(args, "output_files", ()):
        check_output_file(getattr(args, dest), _flag(dest))
    for dest in getattr(args, "output_dirs", ()):
        check_output_dir(getattr(args, dest), _flag(dest))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
