"""The layer-spec route (``layer_spec.use_railwave_moe``): a GPTModel built from Megatron's own
block spec with ``RailWaveMoELayer`` swapped in, no ``install()``, trains like the same model with
``alltoall`` (1e-5), on the installed Megatron-Core (0.19 in ``make test``, 0.15 in
``make test-mcore-oldest``). Runs in a fresh interpreter (Megatron needs the CPU shims first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, torch
from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims, seed_megatron_cpu_rng
apply_megatron_cpu_shims()
torch._dynamo.config.disable = True
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_railwave.layer_spec import use_railwave_moe
from megatron_railwave.plugin import installed_config

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, expert_model_parallel_size=1)

def model(railwave):
    seed_megatron_cpu_rng(7)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            ffn_hidden_size=64, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=16, moe_token_dispatcher_type="alltoall",
                            moe_layer_freq=[0, 1], moe_router_load_balancing_type="none",
                            use_cpu_initialization=True, add_bias_linear=False,
                            moe_grouped_gemm=False, bias_activation_fusion=False,
                            gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    if railwave:
        spec = use_railwave_moe(spec, railwave={"gpus_per_node": 1, "path": "joint",
                                                "metrics": False})
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8)

out = {}
tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
pos = torch.arange(8).unsqueeze(0).expand(2, 8)
mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1).view(1, 1, 8, 8)
for name in ("alltoall", "railwave"):
    m = model(name == "railwave")
    loss = m(tokens, pos, mask, labels=tokens).mean()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])
    types = sorted({type(x.token_dispatcher).__name__ for x in m.modules()
                    if hasattr(x, "token_dispatcher")})
    out[name] = {"loss": float(loss), "grads": grads.tolist(), "types": types}
try:
    dense = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                              use_cpu_initialization=True)
    use_railwave_moe(get_gpt_decoder_block_spec(dense, use_transformer_engine=False))
    out["dense"] = "no error"
except ValueError as exc:
    out["dense"] = str(exc)
out["installed"] = installed_config() is not None
from megatron.core import package_info
import megatron_railwave
out["version"] = package_info.__version__
# an unsupported Megatron-Core: install() refuses before changing anything
package_info.__version__ = "0.14.2"
try:
    megatron_railwave.install({"path": "joint"})
    out["old"] = "installed"
except ValueError as exc:
    out["old"] = str(exc)
out["installed_after_old"] = installed_config() is not None
print(json.dumps(out))
"""


def test_railwave_moe_layer_spec_trains_like_alltoall():
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"},
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["alltoall"]["types"] == ["MoEAlltoAllTokenDispatcher"]
    assert out["railwave"]["types"] == ["RailWaveTokenDispatcher"]
    assert abs(out["railwave"]["loss"] - out["alltoall"]["loss"]) <= 1e-5 * abs(
        out["alltoall"]["loss"]
    )
    a, b = out["alltoall"]["grads"], out["railwave"]["grads"]
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5 * max(map(abs, a))
    assert out["dense"].startswith("use_railwave_moe: the spec has no MoELayer to replace")
    assert not out["installed"]  # nothing patched: the spec alone did it
    assert out["old"] == (
        "megatron-core 0.14.2 is not supported by megatron-railwave (supported: 0.15 to 0.19, the "
        "dispatcher constructor takes pg_collection since 0.15); install a supported "
        "megatron-core, "
        "e.g. pip install 'megatron-core>=0.15,<0.20'"
    )
    assert not out["installed_after_old"]
    expected = os.environ.get("RAILWAVE_EXPECT_MEGATRON_CORE")  # set by make test-mcore-oldest
    if expected:
        assert out["version"] == expected


def test_supported_megatron_core_versions():
    import pytest

    from megatron_railwave.plugin import check_megatron_version

    for ok in ("0.15.0", "0.15.3", "0.16.0rc0", "0.19.2", "0.19.3.dev0"):
        assert check_megatron_version(ok) == ok
    for bad in ("0.14.0", "0.20.0rc0", "1.0.0"):
        with pytest.raises(
            ValueError, match=f"megatron-core {bad} is not supported .*\\(supported: 0.15 to 0.19"
        ):
            check_megatron_version(bad)
    with pytest.raises(ValueError, match="not a version RailWave can read"):
        check_megatron_version("main")
