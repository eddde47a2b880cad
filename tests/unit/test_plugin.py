"""Registration with Megatron: add_railwave_args, config_from_args, install / uninstall, and the
GLM-4.5-Air launcher's flags through Megatron-LM's real argument parser.

Tests that import Megatron-Core run in a subprocess: Megatron needs the CPU shims
(megatron_railwave.testing.megatron_cpu)
before its first import and keeps process-wide globals (parsed args, patched MoELayer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.plugin import add_railwave_args, config_from_args

REPO = Path(__file__).resolve().parents[2]
GLM_CONFIG = REPO / "megatron_railwave" / "configs" / "railwave" / "glm45_air_h800.yaml"
LAUNCHER = REPO / "examples" / "launch_glm45_air.sh"


def _megatron_like_parser() -> argparse.ArgumentParser:
    """A parser with Megatron's dispatcher flag as ArgumentGroupFactory builds it (choices)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument(
        "--moe-token-dispatcher-type",
        default="allgather",
        choices=["allgather", "alltoall", "flex"],
    )
    return parser


def _run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter at the repo root; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_add_railwave_args_extends_megatron_dispatcher_choices():
    parser = add_railwave_args(_megatron_like_parser())
    args = parser.parse_args(
        [
            "--moe-token-dispatcher-type",
            "railwave",
            "--railwave-config",
            str(GLM_CONFIG),
            "--railwave-path",
            "perm",
        ]
    )
    assert args.moe_token_dispatcher_type == "railwave"
    assert args.railwave_config == str(GLM_CONFIG) and args.railwave_path == "perm"
    # The other dispatchers still parse; calling it twice does not duplicate 'railwave'.
    assert (
        parser.parse_args(["--moe-token-dispatcher-type", "alltoall"]).moe_token_dispatcher_type
        == "alltoall"
    )
    action = next(a for a in parser._actions if "--moe-token-dispatcher-type" in a.option_strings)
    assert list(action.choices).count("railwave") == 1


def test_add_railwave_args_rejects_unknown_path(capsys):
    parser = add_railwave_args(_megatron_like_parser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--railwave-path", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_add_railwave_args_adds_dispatcher_flag_when_missing():
    parser = add_railwave_args(argparse.ArgumentParser())
    assert (
        parser.parse_args(["--moe-token-dispatcher-type", "railwave"]).moe_token_dispatcher_type
        == "railwave"
    )


def test_config_from_args_reads_yaml_then_applies_flags():
    parser = add_railwave_args(_megatron_like_parser())
    args = parser.parse_args(
        [
            "--railwave-config",
            str(GLM_CONFIG),
            "--railwave-path",
            "native",
            "--railwave-log-dir",
            "/tmp/rw-logs",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.path == "native"  # the flag overrides the file's 'joint'
    assert cfg.log_dir == "/tmp/rw-logs"
    assert cfg.cluster == "h800_4x8" and cfg.timeout_s == 300
    # Without a config file and flags: the defaults.
    assert config_from_args(parser.parse_args([])) == RailWaveConfig()


def test_glm45_air_config_describes_ep32_on_h800(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the cluster is a preset name: found from any directory
    topo = config_from_args(argparse.Namespace(railwave_config=str(GLM_CONFIG))).topology(32)
    assert (topo.num_nodes, topo.gpus_per_node, topo.num_rails) == (4, 8, 8)
    with pytest.raises(ValueError, match="world size|EP|does not match|expects"):
        config_from_args(argparse.Namespace(railwave_config=str(GLM_CONFIG))).topology(16)


def test_railwave_args_parse_with_megatron_lm_parser():
    out = _run_python("""
        import json, sys
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.training import arguments
        from megatron_railwave.plugin import add_railwave_args, config_from_args
        sys.argv = ["pretrain_gpt_railwave.py", "--moe-token-dispatcher-type", "railwave",
                    "--railwave-config", "glm45_air_h800",
                    "--railwave-path", "rail"]
        args = arguments.parse_args(extra_args_provider=add_railwave_args)
        cfg = config_from_args(args)
        print(json.dumps({"type": args.moe_token_dispatcher_type, "path": cfg.path,
                          "cluster": cfg.cluster}))
    """)
    assert out == {"type": "railwave", "path": "rail", "cluster": "h800_4x8"}


def test_glm45_air_launcher_flags_validate_with_megatron_lm():
    """Every flag of examples/launch_glm45_air.sh parses and validates (Megatron-LM's
    validate_args, world size 32) and gives a TransformerConfig RailWave supports."""
    env = {**os.environ, "RAILWAVE_PRINT_ARGS": "1"}
    flags = subprocess.run(
        ["bash", str(LAUNCHER)], env=env, capture_output=True, text=True, check=True, timeout=30
    ).stdout.splitlines()
    assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "railwave"
    out = _run_python(
        f"""
        import json, sys, torch
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        # CPU stand-ins for checks validate_args and TransformerConfig make against the GPU: an
        # H800 is sm_90, and RoPE fusion needs Transformer Engine.
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        from megatron.training import arguments
        from megatron.training.argument_utils import core_transformer_config_from_args
        from megatron_railwave.dispatcher import check_supported
        from megatron_railwave.plugin import add_railwave_args, config_from_args
        sys.argv = ["pretrain_gpt_railwave.py"] + {flags!r} + ["--no-rope-fusion"]
        args = arguments.parse_args(extra_args_provider=add_railwave_args)
        arguments.validate_args(args, {{}})
        tc = core_transformer_config_from_args(args)
        check_supported(tc)
        topo = config_from_args(args).topology(args.expert_model_parallel_size)
        print(json.dumps({{"ep": args.expert_model_parallel_size, "layers": tc.num_layers,
                          "moe_layers": sum(tc.moe_layer_freq), "experts": tc.num_moe_experts,
                          "topk": tc.moe_router_topk, "hidden": tc.hidden_size,
                          "moe_ffn": tc.moe_ffn_hidden_size, "score": tc.moe_router_score_function,
                          "bias": tc.moe_router_enable_expert_bias,
                          "shared": tc.moe_shared_expert_intermediate_size,
                          "dispatcher": tc.moe_token_dispatcher_type,
                          "topo": [topo.num_nodes, topo.gpus_per_node]}}))
    """,
        env={"WORLD_SIZE": "32", "RANK": "0", "LOCAL_WORLD_SIZE": "8"},
    )
    assert out == {
        "ep": 32,
        "layers": 46,
        "moe_layers": 45,
        "experts": 128,
        "topk": 8,
        "hidden": 4096,
        "moe_ffn": 1408,
        "score": "sigmoid",
        "bias": True,
        "shared": 1408,
        "dispatcher": "railwave",
        "topo": [4, 8],
    }


def test_install_is_idempotent_replaces_config_and_uninstall_restores():
    out = _run_python("""
        import datetime, json, os
        import torch, torch.distributed as dist
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe import moe_layer
        from megatron.core.transformer.transformer_config import TransformerConfig
        import megatron_railwave
        from megatron_railwave.plugin import installed_config, uninstall

        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, expert_model_parallel_size=1)
        pgs = ProcessGroupCollection.use_mpu_process_groups()

        def build():
            cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                    ffn_hidden_size=8, num_moe_experts=2, moe_router_topk=2,
                                    moe_token_dispatcher_type="railwave",
                                    use_cpu_initialization=True, add_bias_linear=False,
                                    moe_grouped_gemm=False, bias_activation_fusion=False,
                                    gradient_accumulation_fusion=False)
            spec = get_moe_module_spec(use_te=False, num_experts=2, moe_grouped_gemm=False)
            return spec(config=cfg, layer_number=1, pg_collection=pgs), cfg

        original = moe_layer.MoELayer.__init__
        res = {"before": installed_config() is None}
        first = megatron_railwave.install({"path": "native", "gpus_per_node": 1})
        wrapped = moe_layer.MoELayer.__init__
        layer, cfg = build()
        res["first"] = [type(layer.token_dispatcher).__name__, layer.token_dispatcher.railwave.path,
                        cfg.moe_token_dispatcher_type]
        second = megatron_railwave.install({"path": "joint", "gpus_per_node": 1})
        res["same_wrapper"] = moe_layer.MoELayer.__init__ is wrapped and wrapped is not original
        res["active"] = installed_config() == second and second != first
        layer, _ = build()
        res["second"] = layer.token_dispatcher.railwave.path
        uninstall()
        res["restored"] = moe_layer.MoELayer.__init__ is original and installed_config() is None
        try:
            build()
            res["after"] = "built"
        except ValueError as exc:
            res["after"] = str(exc)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        print(json.dumps(res))
    """)
    assert out["before"]
    assert out["first"] == ["RailWaveTokenDispatcher", "native", "railwave"]
    assert out["same_wrapper"] and out["active"]
    assert out["second"] == "joint"  # layers built after the second install see its config
    assert out["restored"]
    assert "railwave" in out["after"]  # Megatron itself rejects the unknown type again


def test_railwave_type_without_install_says_to_call_install():
    # Megatron-LM parses its arguments (with add_railwave_args) but the script never calls
    # install().
    out = _run_python("""
        import argparse, json
        import torch.distributed as dist
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron_railwave.plugin import add_railwave_args

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, expert_model_parallel_size=1)
        args = add_railwave_args(argparse.ArgumentParser()).parse_args(
            ["--moe-token-dispatcher-type", "railwave"])
        cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                ffn_hidden_size=8, num_moe_experts=2, moe_router_topk=2,
                                moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                                use_cpu_initialization=True, add_bias_linear=False,
                                moe_grouped_gemm=False, bias_activation_fusion=False,
                                gradient_accumulation_fusion=False)
        spec = get_moe_module_spec(use_te=False, num_experts=2, moe_grouped_gemm=False)
        try:
            spec(config=cfg, layer_number=1,
                 pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            error = "built"
        except ValueError as exc:
            error = str(exc)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        print(json.dumps({"error": error}))
    """)
    assert out["error"].startswith(
        "moe_token_dispatcher_type='railwave' needs megatron_railwave.install() "
        "before the model is built"
    ), out["error"]
    assert "docs/usage.md" in out["error"]


def test_pretrain_example_installs_and_builds_megatron_inputs_on_cpu():
    """examples/pretrain_gpt_railwave.py up to Megatron-LM's pretrain (which needs CUDA): parse,
    install, config container, mock GPT data through the built-in glue, one forward_step."""
    out = _run_python(
        """
        import importlib.util, inspect, json, sys, torch
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        import megatron.training as mt
        spec = importlib.util.spec_from_file_location("example",
                                                      "examples/pretrain_gpt_railwave.py")
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        seen = {}
        def fake_pretrain(cfg_container, datasets, model_type, step, **kw):
            seen.update(cfg=cfg_container, datasets=datasets, step=step)
        fake_pretrain.__signature__ = inspect.signature(mt.pretrain)
        mt.pretrain = fake_pretrain
        sys.argv = ["pretrain_gpt_railwave.py", "--num-layers", "2", "--hidden-size", "64",
                    "--num-attention-heads", "4", "--seq-length", "16",
                    "--max-position-embeddings", "16",
                    "--micro-batch-size", "1", "--global-batch-size", "1", "--num-experts", "4",
                    "--moe-router-topk", "2", "--moe-token-dispatcher-type", "railwave",
                    "--railwave-path", "perm", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--no-rope-fusion"]
        example.main()
        from megatron_railwave.plugin import installed_config
        train, _, _ = seen["datasets"]([2, 0, 0])
        batch = {k: torch.as_tensor(v).unsqueeze(0) for k, v in train[0].items()}
        def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None):
            return torch.ones_like(tokens, dtype=torch.float32)  # per-token loss 1
        output, loss_fn = seen["step"](iter([batch]), model)
        loss, num_tokens, report = loss_fn(output)
        print(json.dumps({"path": installed_config().path, "container": type(seen["cfg"]).__name__,
                          "dispatcher": seen["cfg"].model.transformer.moe_token_dispatcher_type,
                          "tokens": list(batch["tokens"].shape), "loss": float(loss),
                          "num_tokens": int(num_tokens)}))
    """,
        env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1"},
    )
    assert out["path"] == "perm" and out["container"] == "PretrainConfigContainer"
    assert out["dispatcher"] == "railwave"
    assert out["tokens"] == [1, 16] and out["loss"] == out["num_tokens"] > 0


def test_install_lets_megatron_config_check_accept_overlap_flags_for_railwave():
    """Megatron's TransformerConfig check allows moe_shared_expert_overlap and
    overlap_moe_expert_parallel_comm only for alltoall / flex: after install() (and after
    add_railwave_args once Megatron is imported, the flag's route) 'railwave' passes it and stays
    'railwave'; uninstall() restores Megatron's refusal; other checks still run."""
    out = _run_python("""
        import argparse, json
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.core.transformer.transformer_config import TransformerConfig
        import megatron_railwave
        from megatron_railwave.plugin import add_railwave_args, uninstall

        def build(**extra):
            kw = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                      num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="railwave",
                      moe_shared_expert_intermediate_size=8, moe_shared_expert_overlap=True,
                      expert_model_parallel_size=2, use_cpu_initialization=True,
                      add_bias_linear=False)
            try:
                cfg = TransformerConfig(**{**kw, **extra})
                return cfg.moe_token_dispatcher_type
            except (ValueError, AssertionError) as exc:
                return f"{type(exc).__name__}: {exc}"

        res = {"before": build()}
        add_railwave_args(argparse.ArgumentParser())
        res["flag"] = build()
        uninstall()
        res["uninstalled"] = build()
        megatron_railwave.install({"gpus_per_node": 1})
        res["installed"] = build()
        res["ep_overlap"] = build(overlap_moe_expert_parallel_comm=True, bf16=True,
                                  moe_shared_expert_overlap=False)
        res["still_checked"] = build(moe_shared_expert_intermediate_size=-1)
        print(json.dumps(res))
    """)
    refusal = (
        "ValueError: moe_shared_expert_overlap only works with alltoall or flex token dispatcher."
    )
    assert out["before"] == refusal and out["uninstalled"] == refusal
    assert out["flag"] == out["installed"] == out["ep_overlap"] == "railwave"
    assert "moe_shared_expert_intermediate_size must be" in out["still_checked"]


def test_add_railwave_args_adds_railwave_flex_backend_and_wants_railwave():
    from megatron_railwave.plugin import wants_railwave

    parser = _megatron_like_parser()
    parser.add_argument(
        "--moe-flex-dispatcher-backend", default="deepep", choices=["deepep", "hybridep", "ncclep"]
    )
    args = add_railwave_args(parser).parse_args(
        ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "railwave"]
    )
    assert wants_railwave(args)
    assert not wants_railwave(
        argparse.Namespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    )
    assert wants_railwave(argparse.Namespace(moe_token_dispatcher_type="railwave"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_install_refuses_a_log_dir_that_cannot_be_created(tmp_path):
    """As root ``os.access`` accepts /proc, where no directory can be made: the config check
    passes, and before the fix the first layer call failed with FileNotFoundError. ``install()``
    creates ``log_dir`` now, or refuses naming the field, the path and the fix."""
    bad = "/proc/railwave-cannot-exist/logs"
    RailWaveConfig(log_dir=bad)  # the config check alone cannot tell
    out = _run_python(f"""
        import json
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        import megatron_railwave
        from megatron_railwave.plugin import installed_config
        try:
            megatron_railwave.install({{"log_dir": {bad!r}}})
            error = None
        except ValueError as exc:
            error = str(exc)
        good = {str(tmp_path / "a" / "b")!r}
        megatron_railwave.install({{"log_dir": good}})
        import os
        print(json.dumps({{"error": error, "created": os.path.isdir(good),
                           "installed": installed_config().log_dir}}))
    """)
    assert out["error"] is not None and "log_dir" in out["error"] and bad in out["error"]
    assert "choose a directory" in out["error"]
    assert out["created"] and out["installed"] == str(tmp_path / "a" / "b")
