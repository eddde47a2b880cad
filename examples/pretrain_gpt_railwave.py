"""Megatron-LM GPT pretraining with the RailWave token dispatcher: a thin entry point.

NOT YET RUN ON GPUs. On CPU only argument parsing and installation are tested
(tests/unit/test_plugin.py); Megatron-LM's ``initialize_megatron`` requires CUDA.

It does three things and leaves everything else to Megatron-LM:
  1. parse Megatron-LM's arguments with ``megatron_railwave.plugin.add_railwave_args`` as the
     ``extra_args_provider`` (adds 'railwave' to ``--moe-token-dispatcher-type`` and the
     ``--railwave-*`` flags);
  2. ``megatron_railwave.install(config_from_args(args))`` before any model is built, so every
     MoE layer with ``moe_token_dispatcher_type='railwave'`` gets ``RailWaveTokenDispatcher``;
  3. run Megatron-LM's ``pretrain`` for GPT.

Data and loss. With ``MEGATRON_LM_DIR`` pointing at a Megatron-LM checkout, its ``pretrain_gpt``
module supplies ``forward_step`` and ``train_valid_test_datasets_provider`` (real data, SFT, FIM,
every parallelism). Otherwise the minimal glue below is used: ``GPTDataset`` (``MockGPTDataset``
with ``--mock-data``) through ``BlendedMegatronDatasetBuilder`` and a next-token loss; it needs
TP = CP = PP = 1 (EP and DP free), which is what examples/launch_glm45_air.sh uses.

Two ``pretrain`` signatures are handled: the config-container one of the installed Megatron-LM
training package (``pretrain(cfg_container, datasets_provider, model_type, forward_step)``, with
arguments parsed beforehand) and the older one (``pretrain(datasets_provider, model_provider,
model_type, forward_step, extra_args_provider=...)``), which needs ``MEGATRON_LM_DIR`` for the
model provider.

Usage (see examples/launch_glm45_air.sh)::

    torchrun --nproc-per-node 8 --nnodes 4 ... examples/pretrain_gpt_railwave.py \\
        <Megatron-LM GPT flags> --moe-token-dispatcher-type railwave \\
        --railwave-config glm45_air_h800
"""

from __future__ import annotations

import inspect
import os
import sys
import typing
from functools import partial
from typing import Any

if not hasattr(typing, "override"):  # megatron.training uses typing.override (Python >= 3.12)
    from typing_extensions import override as _override

    typing.override = _override  # type: ignore[attr-defined]

import torch

from megatron_railwave import install
from megatron_railwave.plugin import add_railwave_args, config_from_args

__all__ = ["parse_args_and_install", "forward_step", "train_valid_test_datasets_provider", "main"]


def _megatron_lm_pretrain_gpt() -> Any | None:
    """Megatron-LM's ``pretrain_gpt`` module from ``$MEGATRON_LM_DIR``, or None."""
    root = os.environ.get("MEGATRON_LM_DIR")
    if not root:
        return None
    if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
        raise ValueError(
            f"MEGATRON_LM_DIR={root!r} has no pretrain_gpt.py; point it at a Megatron-LM checkout"
        )
    sys.path.insert(0, root)
    import pretrain_gpt  # type: ignore[import-not-found]

    return pretrain_gpt


def parse_args_and_install(args_defaults: dict[str, Any] | None = None):
    """Parse ``sys.argv`` with Megatron-LM's parser plus the RailWave flags, set Megatron's global
    arguments, then install RailWave. Returns the parsed arguments."""
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(
        extra_args_provider=add_railwave_args, args_defaults=args_defaults or {}
    )
    install(config_from_args(args))
    return args


# ---------------------------------------------------------------------- minimal glue
def _check_minimal_glue_parallelism(args: Any) -> None:
    unsupported = {
        name: getattr(args, name, 1)
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
        )
        if getattr(args, name, 1) != 1
    }
    if unsupported:
        raise ValueError(
            f"the built-in data glue of {__file__} needs TP = CP = PP = 1, got {unsupported}; set "
            "MEGATRON_LM_DIR to a Megatron-LM checkout to use its pretrain_gpt glue instead"
        )


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: int | None = None
):
    """GPT datasets from ``--data-path`` / ``--*-data-path``, or mock data with ``--mock-data``."""
    del vp_stage
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    _check_minimal_glue_parallelism(args)
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    # TP = PP = 1: every rank builds (and reads) its own data-parallel shard.
    return BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, lambda: True, config
    ).build()


def _loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of token losses, number of tokens, report) as Megatron-LM's schedules expect."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: next-token cross entropy of the GPT model. ``return_schedule_plan``
    (--overlap-moe-expert-parallel-comm's combined 1F1B schedule): the model's schedule plan
    instead of its output, as Megatron-LM's pretrain_gpt.py returns it."""
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    tokens, labels, loss_mask, position_ids = (
        batch[k].to(device, non_blocking=True)
        for k in ("tokens", "labels", "loss_mask", "position_ids")
    )
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    if return_schedule_plan:
        plan = model.build_schedule_plan(
            tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
        )
        return plan, partial(_loss, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss, loss_mask)


# ---------------------------------------------------------------------- entry
def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    upstream = _megatron_lm_pretrain_gpt()
    step = upstream.forward_step if upstream is not None else forward_step
    datasets = (
        upstream.train_valid_test_datasets_provider
        if upstream is not None
        else train_valid_test_datasets_provider
    )
    datasets.is_distributed = True  # Megatron-LM: the provider runs on every rank
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}

    if next(iter(inspect.signature(pretrain).parameters)) == "cfg_container":
        from megatron.training.argument_utils import (
            gpt_config_from_args,
            pretrain_cfg_container_from_args,
        )

        args = parse_args_and_install(defaults)
        if upstream is None:
            _check_minimal_glue_parallelism(args)
        cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(cfg, datasets, ModelType.encoder_or_decoder, step)
        return

    # Older Megatron-LM: pretrain parses the arguments itself; install inside the model provider,
    # which runs after parsing and before any MoE layer is built.
    if upstream is None:
        raise ValueError(
            "this Megatron-LM's pretrain() takes a model provider: set MEGATRON_LM_DIR to "
            "its checkout so that model_provider and gpt_builders can be imported"
        )
    from gpt_builders import gpt_builder  # type: ignore[import-not-found]
    from megatron.training import get_args
    from model_provider import model_provider  # type: ignore[import-not-found]

    def railwave_model_provider(*a: Any, **kw: Any):
        install(config_from_args(get_args()))
        return model_provider(gpt_builder, *a, **kw)

    pretrain(
        datasets,
        railwave_model_provider,
        ModelType.encoder_or_decoder,
        step,
        args_defaults=defaults,
        extra_args_provider=add_railwave_args,
    )


if __name__ == "__main__":
    main()
