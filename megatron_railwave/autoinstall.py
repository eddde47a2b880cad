"""``RAILWAVE_AUTO_INSTALL=1``: ``--moe-token-dispatcher-type railwave`` in launchers we do not own.

The package installs ``megatron_railwave_autoinstall.pth`` into site-packages. Python runs it at
every start; it does nothing unless ``RAILWAVE_AUTO_INSTALL=1``. Then ``activate()`` adds an
import hook (nothing of Megatron or torch is imported at start) that acts when Megatron's modules
are first imported:

* ``megatron.training.arguments`` (Megatron-LM's ``pretrain_gpt.py``, slime, any script that
  parses Megatron-LM's arguments): its ``parse_args`` is wrapped so that the parser also gets
  ``plugin.add_railwave_args`` (the 'railwave' choice and the ``--railwave-*`` flags, wherever on
  the command line) after the script's own ``extra_args_provider``; right after parsing, when the
  type is 'railwave', ``install(config_from_args(args))`` runs, before any model is built.
* ``megatron.core.transformer.moe.moe_layer`` (frameworks that build ``TransformerConfig``
  themselves, e.g. with ``moe_token_dispatcher_type='railwave'`` in an override config):
  ``install(RAILWAVE_CONFIG)`` (a YAML path; the defaults when unset), unless ``install`` already
  ran. A later ``install`` (e.g. from parsed flags) replaces that config.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

__all__ = ["ENV", "CONFIG_ENV", "activate", "deactivate", "patch_arguments"]

ENV = "RAILWAVE_AUTO_INSTALL"
CONFIG_ENV = "RAILWAVE_CONFIG"
_ARGUMENTS = "megatron.training.arguments"
_MOE_LAYER = "megatron.core.transformer.moe.moe_layer"


def patch_arguments(arguments: Any) -> None:
    """Wrap ``arguments.parse_args`` (Megatron-LM's) once: RailWave flags in, install after."""
    original = arguments.parse_args
    if getattr(original, "_railwave_original", None) is not None:
        return

    @functools.wraps(original)
    def parse_args(extra_args_provider: Any = None, *args: Any, **kwargs: Any) -> Any:
        from megatron_railwave.plugin import (
            add_railwave_args,
            config_from_args,
            install,
            wants_railwave,
        )

        def provider(parser: Any) -> Any:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_railwave_args(parser)

        parsed = original(provider, *args, **kwargs)
        if wants_railwave(parsed):
            install(config_from_args(parsed))
        return parsed

    parse_args._railwave_original = original  # type: ignore[attr-defined]
    arguments.parse_args = parse_args


def _on_moe_layer(module: Any) -> None:
    del module
    from megatron_railwave.plugin import install, installed_config

    if installed_config() is None:
        install(os.environ.get(CONFIG_ENV) or None)


_HOOKS = {_ARGUMENTS: patch_arguments, _MOE_LAYER: _on_moe_layer}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the hooked modules to run a hook after
    them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        original = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            hook(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _PostImportFinder()


def activate() -> None:
    """Add the import hook (idempotent); modules already imported get their hook now."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])


def deactivate() -> None:
    """Remove the import hook (tests)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
