"""The files shipped inside the package (``megatron_railwave/configs/``) and their lookup by name.

Kinds (folders under ``configs/``): ``clusters`` (cluster presets: ``cluster: h800_4x8``),
``railwave`` (example RailWave configs: ``--railwave-config glm45_air_h800``) and ``netmodel``
(the lab's flow-model parameters).
They are package data, read through ``importlib.resources``, so a wheel installed anywhere finds
them from any working directory, as a source checkout or an editable install does.

A value names a packaged file only when it is a bare name (no folder, no ``.yaml`` suffix) and
no file of that name exists; anything else is a path.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["KINDS", "is_bare_name", "packaged_dir", "packaged_file", "packaged_names", "resolve"]

KINDS = ("clusters", "railwave", "netmodel")
"""The folders of ``megatron_railwave/configs/``."""


def packaged_dir(kind: str) -> Path:
    """The folder of packaged files of ``kind`` (one of ``KINDS``)."""
    assert kind in KINDS, kind
    root = resources.files("megatron_railwave").joinpath("configs", kind)
    # Wheels, editable installs and the source tree all put the package on the file system (the
    # compiled ops cannot be imported from a zip), so the Traversable is a real path.
    return Path(os.fspath(root))


def is_bare_name(value: str | os.PathLike) -> bool:
    """Whether ``value`` may name a packaged file: no folder part and no YAML suffix."""
    text = os.fspath(value)
    return (
        bool(text)
        and os.sep not in text
        and "/" not in text
        and not text.endswith((".yaml", ".yml"))
    )


def packaged_names(kind: str) -> list[str]:
    """The names of the packaged YAML files of ``kind``, sorted (``h800_4x8``, ...)."""
    folder = packaged_dir(kind)
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def packaged_file(kind: str, name: str | os.PathLike) -> Path | None:
    """The packaged file ``<kind>/<name>.yaml``, or None (not a bare name, or no such file)."""
    if not is_bare_name(name):
        return None
    path = packaged_dir(kind) / f"{os.fspath(name)}.yaml"
    return path if path.is_file() else None


def resolve(value: str | os.PathLike, kind: str, what: str) -> Path:
    """The YAML file ``value`` means: an existing file, else the packaged one of that name.

    Args:
        value: a file path, or the bare name of a packaged file of ``kind``.
        kind: one of ``KINDS``.
        what: what the file is, for the message (e.g. "cluster").

    Raises:
        ValueError: a directory, or neither a file nor a packaged name (the message lists the
            packaged names).
    """
    path = Path(value).expanduser()
    if path.is_dir():
        raise ValueError(
            f"{what} {os.fspath(value)!r} is a directory; give a {what} YAML file or a preset name"
        )
    if path.is_file():
        return path
    packaged = packaged_file(kind, value)
    if packaged is not None:
        return packaged
    raise ValueError(
        f"{what} file {os.fspath(value)!r} does not exist and is not a preset name "
        f"(presets: {', '.join(packaged_names(kind)) or 'none found'}); give a {what} YAML file "
        f"or one of those names (package data: {packaged_dir(kind)})"
    )
