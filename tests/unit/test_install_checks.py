"""What ``install()`` refuses about the environment, and the Megatron fields RailWave reads.

* On a CUDA machine without the compiled CUDA ops, ``install()`` (and the layer-spec route)
  refuses with one line naming the cause and the fix, unless the reference ops are asked for
  (``RAILWAVE_OPS=reference``): no quiet reference ops on GPUs.
* ``deepep_num_sms: null`` reads Megatron's own SM-count field, as its flex dispatcher does.
* ``--moe-enable-deepep`` with RailWave selected is refused (Megatron would replace the flex
  backend 'railwave' with its own DeepEP, or reject type 'railwave').
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

import pytest
import torch

from megatron_railwave import ops
from megatron_railwave.config import RailWaveConfig
from megatron_railwave.plugin import check_compiled_ops
from tests.helpers.user_install import REPO, run


def _run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repository root (no RAILWAVE_* variables); it
    prints one JSON line last."""
    done = run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, timeout_s=240)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def cuda_without_compiled_cuda_ops(monkeypatch):
    """A machine that has CUDA, and a megatron_railwave._C built without CUDA kernels."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "compiled_for", lambda device: device.type != "cuda")
    monkeypatch.setattr(ops, "load_error", lambda: None)
    old = ops.set_forced_reference(False)
    yield
    ops.set_forced_reference(old)


def test_cuda_without_compiled_cuda_ops_is_refused_with_cause_and_fix(
    cuda_without_compiled_cuda_ops,
):
    with pytest.raises(ValueError) as exc:
        check_compiled_ops()
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(
        "megatron_railwave: CUDA is available but the compiled CUDA ops are not "
        "(megatron_railwave._C was built without CUDA kernels); rebuild in this environment"
    )
    for fix in ("TORCH_CUDA_ARCH_LIST=", "CUDA_HOME=", "--no-build-isolation", "RAILWAVE_OPS"):
        assert fix in message, fix


def test_the_reference_ops_on_purpose_pass(cuda_without_compiled_cuda_ops):
    ops.set_forced_reference(True)  # what RAILWAVE_OPS=reference sets at import
    check_compiled_ops()


def test_a_library_that_did_not_load_is_named(cuda_without_compiled_cuda_ops, monkeypatch):
    monkeypatch.setattr(ops, "compiled_for", lambda device: False)
    monkeypatch.setattr(ops, "load_error", lambda: "the compiled ops megatron_railwave._C did not")
    with pytest.raises(ValueError, match=r"are not \(the compiled ops megatron_railwave._C did"):
        check_compiled_ops()


def test_no_cuda_needs_no_cuda_ops(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ops, "compiled_for", lambda device: False)
    check_compiled_ops()


def test_install_refuses_before_changing_anything():
    """install() and the layer-spec route check the ops after the Megatron version and before
    any state changes; RAILWAVE_OPS=reference lets install() through."""
    out = _run_python("""
        import json
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.core.transformer.moe import moe_layer
        import torch
        import megatron_railwave
        from megatron_railwave import layer_spec, ops
        from megatron_railwave.plugin import installed_config

        original_init = moe_layer.MoELayer.__init__
        torch.cuda.is_available = lambda: True
        ops.compiled_for = lambda device: device.type != "cuda"
        res = {}
        for name, call in (
            ("install", lambda: megatron_railwave.install({"gpus_per_node": 1})),
            ("layer_spec", lambda: layer_spec.use_railwave_moe(None)),
        ):
            try:
                call()
                res[name] = "accepted"
            except ValueError as exc:
                res[name] = str(exc)
        res["untouched"] = (
            installed_config() is None and moe_layer.MoELayer.__init__ is original_init
        )
        ops.set_forced_reference(True)
        res["reference"] = megatron_railwave.install({"gpus_per_node": 1}).gpus_per_node
        print(json.dumps(res))
    """)
    refusal = "CUDA is available but the compiled CUDA ops are not"
    assert refusal in out["install"] and refusal in out["layer_spec"], out
    assert out["untouched"] is True and out["reference"] == 1


# ------------------------------------------------------------------ Megatron's SM-count field
@dataclasses.dataclass
class _Mcore019:
    """The two fields as Megatron-Core 0.19 declares them (None: unset)."""

    moe_flex_dispatcher_num_sms: int | None = None
    moe_deepep_num_sms: int | None = None


@dataclasses.dataclass
class _Mcore015:
    """Megatron-Core 0.15 / 0.16: only moe_deepep_num_sms, default 20."""

    moe_deepep_num_sms: int = 20


@pytest.mark.parametrize(
    ("railwave", "megatron", "expected"),
    [
        (None, _Mcore019(), 20),
        (None, _Mcore019(moe_flex_dispatcher_num_sms=24), 24),
        (None, _Mcore019(moe_deepep_num_sms=16), 16),
        (24, _Mcore019(), 24),
        (24, _Mcore019(moe_flex_dispatcher_num_sms=24), 24),
        (None, _Mcore015(), 20),
        (None, _Mcore015(moe_deepep_num_sms=30), 30),
        (24, _Mcore015(), 24),  # Megatron's default is no setting
        (None, object(), 20),  # a config without the fields
    ],
)
def test_deepep_num_sms_reads_megatrons_field(railwave, megatron, expected):
    assert RailWaveConfig(deepep_num_sms=railwave).deepep_num_sms_for(megatron) == expected


def test_two_different_sm_counts_are_refused():
    with pytest.raises(
        ValueError,
        match=r"deepep_num_sms=24 \(railwave config\) differs from Megatron's "
        r"moe_flex_dispatcher_num_sms=16 \(--moe-flex-dispatcher-num-sms\); set one of them",
    ):
        RailWaveConfig(deepep_num_sms=24).deepep_num_sms_for(
            _Mcore019(moe_flex_dispatcher_num_sms=16)
        )
    with pytest.raises(ValueError, match=r"Megatron's moe_deepep_num_sms=21 must be an even"):
        RailWaveConfig().deepep_num_sms_for(_Mcore015(moe_deepep_num_sms=21))


def test_megatron_fields_and_moe_enable_deepep():
    """With Megatron-Core's own TransformerConfig: the field names RailWave reads are its, and
    --moe-enable-deepep with RailWave selected (either spelling) is refused with the fix."""
    out = _run_python("""
        import json, warnings
        from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims
        apply_megatron_cpu_shims()
        from megatron.core.transformer.transformer_config import TransformerConfig
        import megatron_railwave
        from megatron_railwave.config import RailWaveConfig

        megatron_railwave.install({"gpus_per_node": 1})
        base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8,
                    num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
                    use_cpu_initialization=True, add_bias_linear=False)

        def build(**extra):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return TransformerConfig(**{**base, **extra})
            except ValueError as exc:
                return str(exc)

        res = {
            "sms": RailWaveConfig().deepep_num_sms_for(
                build(moe_token_dispatcher_type="railwave", moe_flex_dispatcher_num_sms=24)),
            "deprecated": RailWaveConfig().deepep_num_sms_for(
                build(moe_token_dispatcher_type="railwave", moe_deepep_num_sms=16)),
            "default": RailWaveConfig().deepep_num_sms_for(
                build(moe_token_dispatcher_type="railwave")),
            "type": build(moe_token_dispatcher_type="railwave", moe_enable_deepep=True),
            "flex": build(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="railwave",
                          moe_enable_deepep=True),
            "megatron_deepep": build(moe_token_dispatcher_type="flex",
                                     moe_enable_deepep=True).moe_flex_dispatcher_backend,
        }
        print(json.dumps(res))
    """)
    assert (out["sms"], out["deprecated"], out["default"]) == (24, 16, 20)
    for key in ("type", "flex"):
        assert out[key].startswith("moe_enable_deepep=True (--moe-enable-deepep) selects "), out
        assert "--railwave-backend deepep" in out[key]
    assert out["megatron_deepep"] == "deepep"  # Megatron's own flex + DeepEP is untouched
