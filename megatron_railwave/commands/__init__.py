"""Subcommands of the ``railwave`` CLI, one module each.

Contract of a command module: it defines ``register(subparsers)``, which calls
``subparsers.add_parser(<name>, ...)``, adds kebab-case flags and sets ``handler=<function>``
with ``set_defaults``. The handler takes the parsed ``argparse.Namespace``, uses only the package's
public APIs (``__all__``), raises ``ValueError`` for user errors (``railwave`` prints them as one
line and exits 2) and returns an exit status (``None`` = 0). A command only parses its flags, calls
the lab or the runtime and prints: what it computes lives there. Machine-readable output goes to
the file named by ``--json FILE`` where the command has one; ``--out DIR`` is always a directory.
The flags several commands take and the argument groups are defined once in ``_args``; building
the package's objects from parsed flags is ``_common``'s, printing ``_render``'s.
"""
