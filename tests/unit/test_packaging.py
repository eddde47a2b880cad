"""The package as a user gets it: the sdist, a build that cannot lose its compiled ops quietly,
and a wheel without the compiled ops (``RAILWAVE_BUILD_EXT=0``) installed outside the repository.

The wheel with the compiled ops, built and run the same way, is the slow
tests/integration/test_install.py (it compiles csrc/ from the sdist: minutes on this machine).
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_railwave import __version__, presets
from tests.helpers.user_install import (
    REPO,
    build_sdist,
    build_wheel,
    clean_env,
    fresh_venv,
    install_wheel,
    run,
    sdist_names,
    wheel_names,
)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    return build_sdist(tmp_path_factory.mktemp("sdist"))


def _packaged_files() -> set[str]:
    """Every packaged YAML as a path inside the package."""
    root = REPO / "megatron_railwave" / "configs"
    files = set(root.rglob("*.yaml"))
    return {str(p.relative_to(REPO)) for p in files}


def test_sdist_carries_the_compiled_ops_sources_and_the_package_data(sdist):
    names = sdist_names(sdist)
    csrc = {str(p.relative_to(REPO)) for p in (REPO / "csrc").rglob("*") if p.is_file()}
    assert csrc and csrc <= names, sorted(csrc - names)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "megatron_railwave_autoinstall.pth"} <= (
        names
    )
    assert _packaged_files() <= names, sorted(_packaged_files() - names)
    assert "megatron_railwave/configs/clusters/cpu_2x1.yaml" in names
    # The checkout's in-place build (make ext) does not leak into the sdist.
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))]


def test_an_isolated_build_stops_with_the_cause_and_the_fix(sdist, tmp_path):
    """pip's default build isolation has no torch: the build must fail, with one line naming
    the cause and the fix, and leave no wheel (before, it printed a line and built a wheel
    without the compiled ops)."""
    out = tmp_path / "wheels"
    out.mkdir()
    done = build_wheel(sdist, out, isolation=True)
    text = done.stdout + done.stderr
    if "railwave:" not in text and "setuptools" in text and "No matching distribution" in text:
        pytest.skip("pip could not fetch setuptools for an isolated build environment here")
    assert done.returncode != 0, text[-3000:]
    assert not list(out.glob("*.whl"))
    (line,) = [ln for ln in text.splitlines() if "railwave: torch is not importable" in ln]
    assert "--no-build-isolation" in line and "RAILWAVE_BUILD_EXT=0" in line, line


def _refusal(tmp_path: Path, **env: str) -> str:
    """What ``setup.py build_ext`` says when it refuses (run in an empty folder: it stops before
    writing anything)."""
    done = run(
        [sys.executable, REPO / "setup.py", "build_ext"],
        cwd=tmp_path,
        env=clean_env(**env),
        check=False,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stdout + done.stderr


def test_a_cuda_torch_without_nvcc_stops_the_build(tmp_path):
    """A CUDA build of torch with no CUDA toolkit found: the build stops naming CUDA_HOME
    (before, it built the CPU ops only and said so in one line of pip's output)."""
    script = tmp_path / "cuda_torch_setup.py"
    script.write_text(
        "import runpy, sys, torch\n"
        "torch.version.cuda = '13.0'  # stand in for a CUDA build of torch\n"
        f"sys.argv = [{str(REPO / 'setup.py')!r}, 'build_ext']\n"
        f"runpy.run_path({str(REPO / 'setup.py')!r}, run_name='__main__')\n"
    )
    done = run(
        [sys.executable, script],
        cwd=tmp_path,
        env=clean_env(CUDA_HOME=str(tmp_path / "no-cuda")),
        check=False,
    )
    text = done.stdout + done.stderr
    assert done.returncode != 0, text[-2000:]
    (line,) = [ln for ln in text.splitlines() if "but nvcc was not found" in ln]
    assert "CUDA_HOME=" in line and "RAILWAVE_BUILD_EXT=0" in line, line


def test_railwave_build_ext_takes_0_or_1(tmp_path):
    assert "RAILWAVE_BUILD_EXT='no' must be 0 (no compiled ops) or 1" in _refusal(
        tmp_path, RAILWAVE_BUILD_EXT="no"
    )


def test_a_wheel_without_compiled_ops_stands_alone(sdist, tmp_path):
    """RAILWAVE_BUILD_EXT=0, the only way to skip the compiled ops: a pure wheel whose presets
    and example configs come with it; installed into a fresh venv outside the
    repository, the CLI and the lookups by name work from another directory, and `railwave
    doctor` says that the compiled ops are missing and how to build them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = build_wheel(sdist, wheels, RAILWAVE_BUILD_EXT="0")
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name == f"megatron_railwave-{__version__}-py3-none-any.whl"
    names = wheel_names(wheel)
    assert _packaged_files() <= names, sorted(_packaged_files() - names)
    assert "megatron_railwave_autoinstall.pth" in names  # at the root of site-packages
    assert not [n for n in names if n.endswith(".so")]
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"megatron_railwave-{__version__}.dist-info/METADATA").decode()
    requires = [
        ln.split(": ", 1)[1] for ln in metadata.splitlines() if ln.startswith("Requires-Dist: ")
    ]
    # By default only what a training job imports (torch is the environment's own).
    assert [r for r in requires if "extra ==" not in r] == ["numpy", "pyyaml", "packaging>=24.2"]
    assert 'tokenspeed-deepep<2.2,>=2.1; extra == "deepep"' in requires
    assert 'matplotlib; extra == "lab"' in requires

    python = fresh_venv(tmp_path / "venv")
    install_wheel(python, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    railwave = python.parent / "railwave"
    assert run([railwave, "--version"], cwd=elsewhere).stdout.strip() == f"railwave {__version__}"
    probe = run(
        [
            python,
            "-c",
            "import json, megatron_railwave as m\n"
            "from megatron_railwave import presets\n"
            "from megatron_railwave.config import load_config\n"
            "from megatron_railwave.topology import load_topology\n"
            "topo = load_config('glm45_air_h800').topology(32)\n"
            "print(json.dumps({'file': m.__file__, 'glm': [topo.name, topo.num_nodes],\n"
            "  'small': load_topology('cpu_2x1').world_size,\n"
            "  'clusters': str(presets.packaged_dir('clusters'))}))",
        ],
        cwd=elsewhere,
    )
    found = json.loads(probe.stdout)
    site = str(tmp_path / "venv")
    assert found["file"].startswith(site), found
    assert found["glm"] == ["h800_4x8", 4] and found["small"] == 2
    assert found["clusters"].startswith(site) and found["clusters"].endswith("clusters")
    report = elsewhere / "doctor.json"
    run([railwave, "doctor", "--no-self-test", "--json", report], cwd=elsewhere)
    ops = json.loads(report.read_text())["compiled_ops"]
    assert ops["cpu"] is False and "--no-build-isolation" in ops["load_error"], ops


def test_package_data_globs_cover_every_packaged_kind():
    """Each folder that presets looks names up in holds files, and the names it lists are the
    YAML files there (what the package-data globs ship)."""
    for kind in presets.KINDS:
        names = presets.packaged_names(kind)
        assert names, kind
        assert all((presets.packaged_dir(kind) / f"{n}.yaml").is_file() for n in names)
