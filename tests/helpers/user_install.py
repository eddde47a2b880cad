"""Build and install megatron-railwave the way a user does, outside the repository (test-only).

``build_sdist`` makes the source distribution from this checkout (what pip gets from an index);
``build_wheel`` runs ``pip wheel --no-deps`` on it (``--no-build-isolation`` unless asked
otherwise); ``fresh_venv`` makes an empty virtual environment outside the repository whose only
view of this machine's packages is the test venv's site-packages, appended to its path by a
``.pth`` line (torch, numpy, Megatron-Core: what a training environment already has; that
directory's own ``.pth`` files, the editable install of this checkout among them, are not run),
and ``install_wheel`` puts the wheel into it with pip, without dependencies. Every command runs
without PYTHONPATH and outside the repository, so nothing can come from the checkout.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "REPO",
    "build_sdist",
    "build_wheel",
    "clean_env",
    "fresh_venv",
    "install_wheel",
    "run",
    "sdist_names",
    "wheel_names",
]

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what could point Python at the checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("RAILWAVE_")
    }
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def run(
    argv: Sequence[str | os.PathLike],
    *,
    cwd: str | os.PathLike,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``cwd``; with ``check``, raise with its output when it fails."""
    done = subprocess.run(
        [os.fspath(a) for a in argv],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(os.fspath, argv))} exited {done.returncode}\n--- stdout\n"
            f"{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
        )
    return done


def build_sdist(dest: Path) -> Path:
    """The sdist of this checkout, built into ``dest`` (its egg-info too: the checkout is only
    read)."""
    dest.mkdir(parents=True, exist_ok=True)
    run(
        [
            sys.executable,
            REPO / "setup.py",
            "-q",
            "egg_info",
            "--egg-base",
            dest,
            "sdist",
            "--dist-dir",
            dest,
        ],
        cwd=REPO,
        env=clean_env(RAILWAVE_BUILD_EXT="0"),  # metadata only: nothing is compiled for an sdist
    )
    (sdist,) = dest.glob("megatron_railwave-*.tar.gz")
    return sdist


def build_wheel(
    source: Path, dest: Path, *, isolation: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """``pip wheel --no-deps`` of ``source`` into ``dest`` (not checked: callers read the
    result)."""
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", dest]
    if not isolation:
        argv.append("--no-build-isolation")
    return run([*argv, source], cwd=dest.parent, env=clean_env(**env), check=False)


def fresh_venv(path: Path) -> Path:
    """A new venv at ``path`` (no pip) that sees this test venv's packages; returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=path.parent,
    ).stdout.strip()
    (Path(purelib) / "_railwave_test_base.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def install_wheel(python: Path, wheel: Path) -> None:
    """``pip install --no-deps wheel`` into the venv of ``python`` (the test venv's pip)."""
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
        cwd=wheel.parent,
    )


def sdist_names(sdist: Path) -> set[str]:
    """Paths inside the sdist, without its top folder."""
    with tarfile.open(sdist) as tar:
        return {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())
