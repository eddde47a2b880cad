"""The layer-spec route: a ``MoELayer`` subclass that builds the RailWave dispatcher, for custom
layer specs (Megatron-Bridge's ``transformer_layer_spec``, your own ``GPTModel`` spec), without
patching Megatron-Core.

Import this module after Megatron-Core (on a CPU-only torch: after the CPU shims); it imports
Megatron-Core itself.

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron_railwave.layer_spec import use_railwave_moe

    spec = use_railwave_moe(get_gpt_decoder_block_spec(config, use_transformer_engine=False),
                            railwave={"gpus_per_node": 8, "path": "joint"})
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)

Megatron-LM 0.19 (``--spec megatron_railwave.layer_spec gpt_layer_spec``) and Megatron-Bridge
(``transformer_layer_spec=gpt_layer_spec``) call ``gpt_layer_spec(config)``: Megatron's default GPT
layer spec with ``RailWaveMoELayer``, configured by ``install()``'s config (defaults otherwise).

``use_railwave_moe`` walks a block, layer or MoE spec and swaps every ``MoELayer`` (a
``ModuleSpec`` module in Megatron-Core 0.15, a ``functools.partial`` builder in 0.19) for
``RailWaveMoELayer`` with the given RailWave configuration. The config's
``moe_token_dispatcher_type`` may stay what a framework validates ('alltoall') or be 'railwave':
a ``RailWaveMoELayer`` always builds ``RailWaveTokenDispatcher``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_railwave.config import RailWaveConfig, load_config
from megatron_railwave.plugin import (
    _default_sink,
    build_railwave_moe_layer,
    check_compiled_ops,
    check_megatron_version,
    installed_config,
)

__all__ = ["RailWaveMoELayer", "use_railwave_moe", "gpt_layer_spec"]


class RailWaveMoELayer(MoELayer):
    """``MoELayer`` whose token dispatcher is ``RailWaveTokenDispatcher``.

    Args (besides MoELayer's):
        railwave: the RailWave configuration (config, dict or YAML path); default the one
            ``install()`` set, else the defaults.
        stats_sink: the statistics sink; default as ``install()`` builds it from the config.
    """

    def __init__(
        self,
        config: Any,
        *args: Any,
        railwave: RailWaveConfig | dict | str | os.PathLike | None = None,
        stats_sink: Any = None,
        **kwargs: Any,
    ) -> None:
        check_megatron_version()
        check_compiled_ops()  # as install(): no quiet reference ops on GPUs
        rw = (
            load_config(railwave)
            if railwave is not None
            else (installed_config() or RailWaveConfig())
        )
        sink = stats_sink if stats_sink is not None else _default_sink(rw)
        build_railwave_moe_layer(
            MoELayer.__init__, self, config, args, kwargs, railwave=rw, stats_sink=sink
        )

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.token_dispatcher.layer_number = layer_number


def _swap(spec: Any, params: dict[str, Any], swapped: list[int]) -> Any:
    if (
        isinstance(spec, functools.partial)
        and isinstance(spec.func, type)
        and issubclass(spec.func, MoELayer)
    ):
        swapped.append(1)
        return functools.partial(RailWaveMoELayer, *spec.args, **{**spec.keywords, **params})
    if isinstance(spec, ModuleSpec):
        module = spec.module
        if isinstance(module, type) and issubclass(module, MoELayer):
            swapped.append(1)
            return dataclasses.replace(
                spec, module=RailWaveMoELayer, params={**(spec.params or {}), **params}
            )
        return dataclasses.replace(spec, submodules=_swap(spec.submodules, params, swapped))
    if isinstance(spec, (list, tuple)):
        return type(spec)(_swap(s, params, swapped) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: _swap(getattr(spec, f.name), params, swapped)
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    return spec


def use_railwave_moe(
    spec: Any,
    *,
    railwave: RailWaveConfig | dict | str | os.PathLike | None = None,
    stats_sink: Any = None,
) -> Any:
    """A copy of ``spec`` (block, layer or MoE spec) with every ``MoELayer`` ->
    ``RailWaveMoELayer``.

    Args:
        spec: what Megatron's spec functions return (``get_gpt_decoder_block_spec``,
            ``get_gpt_layer_local_spec``, ``get_moe_module_spec``, ...).
        railwave: the RailWave configuration for those layers (default: see ``RailWaveMoELayer``).
        stats_sink: their statistics sink (default: see ``RailWaveMoELayer``).

    Raises:
        ValueError: a bad RailWave config, an unsupported Megatron-Core, a CUDA machine without
        the compiled CUDA ops (``plugin.check_compiled_ops``), or no MoE layer in ``spec``.
    """
    check_megatron_version()
    check_compiled_ops()
    params = {
        "railwave": load_config(railwave) if railwave is not None else None,
        "stats_sink": stats_sink,
    }
    swapped: list[int] = []
    out = _swap(spec, params, swapped)
    if not swapped:
        raise ValueError(
            "use_railwave_moe: the spec has no MoELayer to replace; pass a spec built with "
            "num_moe_experts set (e.g. get_gpt_decoder_block_spec(config, ...))"
        )
    return out


def gpt_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's default GPT layer spec for ``config`` with ``RailWaveMoELayer`` (a ``--spec``
    / ``transformer_layer_spec`` callable).

    Args:
        config: Megatron-LM's ``GPTModelConfig`` (0.19) or a ``TransformerConfig``.
        vp_stage: virtual pipeline stage.
    """
    transformer = getattr(config, "transformer", config)
    try:  # Megatron-LM 0.19's own choice of spec (TE / local / MoE block)
        from megatron.training.models.gpt import default_layer_spec

        spec = default_layer_spec(config, vp_stage) if hasattr(config, "transformer") else None
    except ImportError:
        spec = None
    if spec is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(
            transformer,
            use_transformer_engine=getattr(transformer, "transformer_impl", "local")
            == "transformer_engine",
            vp_stage=vp_stage,
        )
    return use_railwave_moe(spec)
