"""Subcommands of the ``railwave`` CLI, one module each.

Contract of a command module: it defines ``register(subparsers)``, which calls
``subparsers.add_parser(<name>, ...)``, adds kebab-case flags and sets ``handler=<function>``
with ``set_defaults``. The handler takes the parsed ``argparse.Namespace``, uses only the package's
public APIs (``__all__``), raises ``ValueError`` for user errors (``railwave`` prints them as one
line and exits 2) and returns an exit status (``None`` = 0). Machine-readable output goes to the
file named by ``--json`` where the command has one. Shared argument groups and printing helpers are
in ``_common`` and ``_render``.
"""
