"""RAILWAVE_AUTO_INSTALL=1: ``--moe-token-dispatcher-type railwave`` (last on the command line)
through Megatron-LM's own argument parsing and model builder, with no RailWave code in the
script; and the ``--spec megatron_railwave.layer_spec gpt_layer_spec`` route.

Each case runs in a fresh interpreter, so the .pth startup hook that the package installs into
site-packages is what acts (Megatron-Core 0.19's ``megatron.training``; skipped where it is
missing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="needs Megatron-LM's megatron.training (megatron-core 0.19 wheel)",
)

SCRIPT = """
import json, sys, torch
from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
apply_megatron_cpu_shims()
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # validate_args asks the GPU
import torch.distributed as dist
# Megatron-LM's own argument path, as pretrain_gpt.py reaches it: nothing of RailWave imported
# here.
from megatron.training.arguments import parse_args, validate_args
from megatron.training.argument_utils import gpt_config_from_args
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--num-experts", "4",
            "--moe-router-topk", "2", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--no-rope-fusion",
            "--transformer-impl", "local", "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion",
            "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm"] + EXTRA
FLAG_ONLY = sys.argv[:-2] + ["--moe-token-dispatcher-type", "railwave"]
exits = []
if NO_HOOK_CHECK:  # without the hook, Megatron-LM's own parser rejects the flag (argparse exit 2)
    sys.argv, saved = FLAG_ONLY, sys.argv
    try:
        parse_args()
        exits.append(0)
    except SystemExit as exc:
        exits.append(exc.code)
    sys.argv = saved
args = parse_args()
validate_args(args, {})
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
parallel_state.initialize_model_parallel(1, expert_model_parallel_size=1)
from megatron.training.models.gpt import GPTModelBuilder
model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
    ProcessGroupCollection.use_mpu_process_groups())
types = sorted({type(m.token_dispatcher).__name__ for m in model.modules()
                if hasattr(m, "token_dispatcher")})
layers = sorted({type(m).__name__ for m in model.modules() if "MoELayer" in type(m).__name__})
from megatron_railwave.plugin import installed_config
cfg = installed_config()
print(json.dumps({"types": types, "layers": layers, "type": args.moe_token_dispatcher_type,
                  "path": cfg.path if cfg else None, "metrics": cfg.metrics if cfg else None,
                  "exits": exits}))
"""


def _run(extra: list[str], *, auto: bool, no_hook_check: bool = False) -> dict:
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.pop("RAILWAVE_AUTO_INSTALL", None)
    if auto:
        env["RAILWAVE_AUTO_INSTALL"] = "1"
    code = f"EXTRA = {extra!r}\nNO_HOOK_CHECK = {no_hook_check!r}\n" + textwrap.dedent(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pth_hook_is_installed_with_the_package():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    assert any((Path(d) / "megatron_railwave_autoinstall.pth").is_file() for d in dirs), dirs


def test_dispatcher_flag_last_works_in_megatron_lm_argument_path_with_the_hook():
    out = _run(
        [
            "--railwave-path",
            "rail",
            "--railwave-no-metrics",
            "--moe-token-dispatcher-type",
            "railwave",
        ],
        auto=True,
    )
    assert out == {
        "types": ["RailWaveTokenDispatcher"],
        "layers": ["MoELayer"],
        "type": "railwave",
        "path": "rail",
        "metrics": False,
        "exits": [],
    }


def test_layer_spec_route_through_megatron_lm_spec_flag_and_no_flag_without_the_hook():
    # No hook, no install(): Megatron-LM rejects '--moe-token-dispatcher-type railwave' (exit 2),
    # and the spec swaps MoELayer for RailWaveMoELayer while the type stays 'alltoall'.
    out = _run(
        [
            "--spec",
            "megatron_railwave.layer_spec",
            "gpt_layer_spec",
            "--moe-token-dispatcher-type",
            "alltoall",
        ],
        auto=False,
        no_hook_check=True,
    )
    assert out["exits"] == [2]
    assert out["types"] == ["RailWaveTokenDispatcher"] and out["layers"] == ["RailWaveMoELayer"]
    assert out["type"] == "alltoall" and out["path"] is None  # nothing installed


def test_shared_expert_overlap_flag_passes_megatron_check_with_the_hook():
    """--moe-shared-expert-overlap with --moe-token-dispatcher-type railwave: Megatron's config
    check (alltoall / flex only) passes through the hook's install(), and MoELayer hands the
    shared expert to RailWave's dispatcher."""
    extra = [
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-shared-expert-overlap",
        "--disable-bias-linear",
        "--moe-token-dispatcher-type",
        "railwave",
    ]
    env = {
        **os.environ,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "RAILWAVE_AUTO_INSTALL": "1",
    }
    script = textwrap.dedent(SCRIPT).replace(
        '"exits": exits}))',
        '"exits": exits, "shared": sorted({type(m.token_dispatcher.shared_experts).__name__ for m '
        "in model.modules() "
        'if hasattr(m, "token_dispatcher")})}))',
    )
    code = f"EXTRA = {extra!r}\nNO_HOOK_CHECK = False\n" + script
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["types"] == ["RailWaveTokenDispatcher"] and out["type"] == "railwave"
    assert out["shared"] == ["SharedExpertMLP"]
