"""Install megatron-railwave the way a user does and run it: the sdist, ``pip wheel
--no-build-isolation --no-deps`` (compiling csrc/ for this torch), a fresh venv outside the
repository, then from another directory ``railwave --version``, ``railwave doctor --json`` and a
2-rank CPU MoE layer on the ``cpu_2x1`` preset, looked up by name as ``cluster: h800_4x8`` is.

Slow (the compile: about 2-4 min on this 2-core machine, more under load): ``make test-all``
runs it; ``make test`` runs the fast half (tests/unit/test_packaging.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest

from megatron_railwave import __version__
from tests.helpers.user_install import (
    REPO,
    build_sdist,
    build_wheel,
    fresh_venv,
    install_wheel,
    run,
    wheel_names,
)

pytestmark = pytest.mark.slow


def test_wheel_with_compiled_ops_installs_and_runs_a_layer_from_another_directory(tmp_path):
    start = time.monotonic()
    sdist = build_sdist(tmp_path / "sdist")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built = build_wheel(sdist, wheels)
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = wheels.glob("*.whl")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.startswith(f"megatron_railwave-{__version__}-{tag}-{tag}-linux"), wheel.name
    assert [n for n in wheel_names(wheel) if n.startswith("megatron_railwave/_C.")], "no _C"
    built_s = time.monotonic() - start

    python = fresh_venv(tmp_path / "venv")
    install_wheel(python, wheel)
    site = str(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    railwave = python.parent / "railwave"
    assert run([railwave, "--version"], cwd=elsewhere).stdout.strip() == f"railwave {__version__}"

    report = elsewhere / "doctor.json"
    run([railwave, "doctor", "--json", report], cwd=elsewhere)
    doctor = json.loads(report.read_text())
    assert doctor["compiled_ops"]["cpu"] is True, doctor["compiled_ops"]
    assert doctor["compiled_ops"]["load_error"] is None
    assert doctor["self_test"]["ok"] is True, doctor["self_test"]

    worker = elsewhere / "installed_layer.py"  # with the layer harness, nothing of the checkout
    shutil.copy(REPO / "tests" / "helpers" / "installed_layer.py", worker)
    shutil.copy(REPO / "tests" / "helpers" / "moe_layer.py", elsewhere / "moe_layer.py")
    out = elsewhere / "layer.json"
    run([python, worker, "cpu_2x1", out], cwd=elsewhere, timeout_s=400)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["package_file"].startswith(site), rank
        assert rank["topology"] == [["cpu_2x1", 2, 1]]  # the one dispatcher built
        assert rank["compiled_cpu_ops"] is True
        assert rank["output_abs_max"] > 0
        assert rank["max_output_diff"] <= 1e-5 and rank["max_input_grad_diff"] <= 1e-5, rank
    print(
        f"install test: sdist + compiled wheel {built_s:.0f} s, whole test "
        f"{time.monotonic() - start:.0f} s"
    )
