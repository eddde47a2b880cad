"""Output files and directories: checked before any work, so a bad path fails at once.

Used by ``RailWaveConfig`` (``log_dir``, ``capture_dir``: checked at construction, before the first
collective) and by every CLI command that writes files. Nothing is created by a check
(``install()`` creates the directories with ``create_output_dir``). The errors name the setting
(``name``: a flag such as ``--json`` or a config key), the path and the fix. Note that a process
running as root passes every permission check.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_output_file", "check_output_dir", "create_output_dir"]


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _creatable(path: Path, name: str, what: str) -> None:
    """Raise unless the missing ``path`` can be created (its first existing ancestor is a
    writable directory)."""
    base = _first_existing(path.parent)
    if not base.is_dir():
        raise ValueError(
            f"{name} {str(path)!r}: cannot create this {what}: {str(base)!r} is a file, "
            "not a directory; choose another path"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(
            f"{name} {str(path)!r}: cannot create this {what}: directory {str(base)!r} is "
            "not writable; choose a path you can write"
        )


def check_output_file(path: str | os.PathLike | None, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``path`` can be written as a file."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"{name} {str(p)!r} is a directory; give a file name inside it "
            f"(e.g. {str(p / 'out.json')!r})"
        )
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{name} {str(p)!r} exists and is not writable; choose another file")
        return
    _creatable(p, name, "file")


def check_output_dir(path: str | os.PathLike | None, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``path`` is (or can be created as) a writable
    directory."""
    if path is None:
        return
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{name} {str(p)!r} is a file; give a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{name} {str(p)!r} is not writable; choose a directory you can write")
        return
    _creatable(p, name, "directory")


def create_output_dir(path: str | os.PathLike | None, name: str) -> None:
    """Create the directory ``path`` (and its parents) now, or raise ``ValueError`` naming
    ``name``, the path and the cause. ``check_output_dir`` only asks ``os.access``, which a root
    process passes even where nothing can be created (e.g. under /proc): creating the directory is
    the only check that holds, and ``install()`` makes it before the first layer call."""
    if path is None:
        return
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"{name} {str(p)!r}: cannot create this directory ({exc.strerror or exc}); choose a "
            "directory you can create and write"
        ) from exc
    if not p.is_dir():
        raise ValueError(f"{name} {str(p)!r} is a file; give a directory")
