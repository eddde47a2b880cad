"""scripts/cluster_smoke_2x8.{sh,py} on CPU: the shell parses, the dry run lists one layer per
path and backend for 2 x 8 with a small timeout_s, and bad arguments are refused by name. The
run itself needs 16 GPUs (not yet run on hardware)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_railwave.names import ROUTES

ROOT = Path(__file__).resolve().parents[2]
SH = ROOT / "scripts" / "cluster_smoke_2x8.sh"
PY = ROOT / "scripts" / "cluster_smoke_2x8.py"


def test_cluster_smoke_shell_parses():
    subprocess.run(["bash", "-n", str(SH)], check=True)


def test_cluster_smoke_dry_run_lists_every_path_once_per_backend():
    env = {**os.environ, "DRY_RUN": "1", "NNODES": "2", "GPUS_PER_NODE": "8", "PY": sys.executable}
    done = subprocess.run(
        ["bash", str(SH)], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["dry_run"] and plan["layout"]["nodes"] == 2 and plan["layout"]["gpus_per_node"] == 8
    assert plan["layout"]["timeout_s"] == 60.0
    paths = [str(r) for r in ROUTES]
    assert paths[:4] == ["native", "rail", "perm", "joint"]
    assert plan["variants"] == (
        [f"torch/{p}" for p in paths]
        + ["torch/joint+streamed", "torch/flow-waves+streamed", "torch-fixed/joint"]
        + [f"deepep/{p}" for p in paths]
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--world-size", "12"], "--world-size 12 is not a multiple of --gpus-per-node 8"),
        (["--experts", "100"], "--experts 100 is not divisible by the EP size 16"),
        (["--timeout-s", "0"], "--timeout-s 0.0 must be in"),
    ],
)
def test_cluster_smoke_refuses_bad_arguments(args, message):
    done = subprocess.run(
        [sys.executable, str(PY), "--dry-run", "--world-size", "16", "--gpus-per-node", "8", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_cluster_smoke_without_deepep_skips_its_variants():
    done = subprocess.run(
        [sys.executable, str(PY), "--dry-run", "--world-size", "16", "--deepep-buffer", "none"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert not any(v.startswith("deepep/") for v in json.loads(done.stdout)["variants"])
