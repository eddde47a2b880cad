"""Train a tiny GLM-4.5-Air-shaped Megatron GPTModel on CPU over gloo (EP = world size).

Shape: L layers (first dense, the rest MoE), hidden 128, GQA attention with partial RoPE,
16 routed experts top-4 with a sigmoid router and expert bias, one shared expert, SwiGLU.
Every rank is one data-parallel rank and one expert-parallel rank (TP = PP = 1), so the
expert-data-parallel group has size 1.

The loop is hand-written: plain Adam; dense grads are all-reduced over the DP group and expert
grads over the expert-DP group, both divided by the world size; then Megatron's router
expert-bias update and temporary-tensor reset run, as in Megatron's finalize_model_grads.

    python examples/train_glm_tiny.py --nprocs 8 --steps 5 \\
        --moe-token-dispatcher-type alltoall --json out/glm_tiny_alltoall.json

Batching (``--batching``), what makes the ranks' token counts differ (docs/workloads.md):
  * ``fixed``: pretraining; every rank's micro-batch is ``--micro-batch-size`` sequences of
    ``--seq-length`` tokens, so every rank routes the same number of tokens.
  * ``packed``: RL training with packed variable-length sequences (THD-style, no padding); every
    rank's micro-batch packs ``--micro-batch-size`` rollouts whose lengths follow the length law
    below, so a rank's token count is the sum of its rollouts' lengths.
  * ``budget``: dynamic batching by a token budget, as slime (``--use-dynamic-batch-size
    --max-tokens-per-gpu``) and verl (``use_dynamic_bsz``, ``rearrange_micro_batches``) do: every
    rank holds ``--samples-per-rank`` rollouts per step; the step runs
    ``M = max over ranks of ceil(rank tokens / --max-tokens-per-gpu)`` micro-batches on every rank
    (the frameworks all-reduce this maximum; here every rank computes it from the same seeded draw
    of all ranks' lengths), and each rank splits its rollouts into M micro-batches of near-equal
    tokens (largest first into the lightest, an approximation of verl's Karmarkar-Karp partition).
    A rank with fewer tokens than the busiest thus runs M smaller micro-batches.
  * ``--balance-ranks`` (``packed``, ``budget``): first deal the step's rollouts of all ranks back
    with equal counts and near-equal token sums (slime ``--balance-data``, verl ``balance_batch``).
Rollout lengths (``packed``, ``budget``): ``round(exp(N(log --len-median, --len-sigma^2)))``
clipped to [``--len-min``, ``--seq-length``], drawn from (seed, step, rank, rollout). A packed
micro-batch is one row with a block-diagonal causal mask, so no rollout attends to another; RoPE
positions run over the row (the CPU attention has no per-sequence ``cu_seqlens``), which changes
routing a little and the token counts not at all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_railwave.names import ROUTE_CHOICES
from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims, seed_megatron_cpu_rng

_LOOPBACK = "127.0.0.1"
_DISPATCHERS = ("alltoall", "railwave")
_BATCHING = ("fixed", "packed", "budget")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=8, help="gloo processes = EP size")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--moe-token-dispatcher-type", choices=_DISPATCHERS, default="alltoall")
    parser.add_argument("--json", type=Path, default=None, help="write per-step losses here")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=2,
        help="railwave: ranks per emulated node (EP = nodes x this)",
    )
    parser.add_argument(
        "--railwave-path",
        default="auto",
        choices=list(ROUTE_CHOICES),
        help="railwave: execution path (auto = selector)",
    )
    parser.add_argument(
        "--failed-rail",
        action="append",
        default=[],
        metavar="NODE:RAIL",
        help="railwave: mark a rail failed (repeatable)",
    )
    parser.add_argument(
        "--railwave-log-dir",
        type=Path,
        default=None,
        help="railwave: write the per-layer communication log (JSONL, one set of files per run) "
        "here",
    )
    parser.add_argument(
        "--railwave-capture-dir",
        type=Path,
        default=None,
        help="railwave: capture every micro-batch's routing here (step<i>/rank<r>.npz, one step "
        "directory per micro-batch; read with `railwave workloads token-skew DIR`)",
    )
    parser.add_argument(
        "--batching",
        choices=_BATCHING,
        default="fixed",
        help="fixed-length sequences, packed variable-length rollouts, or dynamic batching by a "
        "token budget (see the module docstring)",
    )
    parser.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=512,
        help="budget: tokens per micro-batch per rank (slime's --max-tokens-per-gpu)",
    )
    parser.add_argument(
        "--samples-per-rank", type=int, default=8, help="budget: rollouts per rank per step"
    )
    parser.add_argument(
        "--balance-ranks",
        action="store_true",
        help="packed/budget: deal the step's rollouts to ranks with equal counts and near-equal "
        "tokens first (slime --balance-data, verl balance_batch)",
    )
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="train nothing: print the token skew of the batcher's per-rank token counts over "
        "--steps steps of --nprocs ranks (any count) and exit",
    )
    parser.add_argument(
        "--len-median", type=float, default=64.0, help="packed/budget: median rollout length"
    )
    parser.add_argument(
        "--len-sigma",
        type=float,
        default=0.8,
        help="packed/budget: standard deviation of log rollout length",
    )
    parser.add_argument("--len-min", type=int, default=8, help="packed/budget: shortest rollout")
    parser.add_argument("--num-layers", type=int, default=3, help="layer 1 dense, rest MoE")
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="gloo collective timeout")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="keep Megatron's torch.compile'd helpers (~20 s of compilation per process on CPU)",
    )
    args = parser.parse_args(argv)
    for field in ("nprocs", "steps", "num_layers", "seq_length", "micro_batch_size"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    for field in ("max_tokens_per_gpu", "samples_per_rank", "len_min"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if not (args.len_median > 0 and args.len_sigma >= 0):
        parser.error(
            f"--len-median must be > 0 and --len-sigma >= 0, got {args.len_median}, "
            f"{args.len_sigma}"
        )
    if args.batching != "fixed" and args.len_min > args.seq_length:
        parser.error(
            f"--len-min {args.len_min} exceeds --seq-length {args.seq_length} (the longest rollout)"
        )
    if args.batching == "budget" and args.seq_length > args.max_tokens_per_gpu:
        parser.error(
            f"--seq-length {args.seq_length} (the longest rollout) exceeds --max-tokens-per-gpu "
            f"{args.max_tokens_per_gpu}: a rollout must fit one micro-batch; raise the budget"
        )
    if args.railwave_capture_dir is not None and args.moe_token_dispatcher_type != "railwave":
        parser.error(
            "--railwave-capture-dir needs --moe-token-dispatcher-type railwave (the capture is its)"
        )
    if 16 % args.nprocs != 0 and not args.plan_only:
        parser.error(f"--nprocs must divide the 16 experts, got {args.nprocs}")
    return args


def _require_railwave_install():
    """Return ``megatron_railwave.install`` or exit with a clear message if it is missing."""
    try:
        from megatron_railwave import install
    except ImportError as exc:
        raise SystemExit(
            "--moe-token-dispatcher-type railwave needs megatron_railwave.install(), which this "
            f"checkout does not provide yet ({exc}); use --moe-token-dispatcher-type alltoall"
        ) from exc
    return install


def _glm_tiny_config(args: argparse.Namespace, world_size: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=32,
        ffn_hidden_size=352,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE (GLM-4.5-Air: first layer dense, sigmoid router with expert bias, 1 shared expert)
        num_moe_experts=16,
        moe_router_topk=4,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=48,
        moe_layer_freq=[0] + [1] * (args.num_layers - 1),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        # Parallelism and CPU: EP = world, fp32, CPU init, no CUDA fusions.
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=world_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _reinit_experts(model: torch.nn.Module, seed: int, num_layers: int) -> None:
    # CPU initialisation draws the same numbers on every rank, so local expert i would be equal
    # on all EP ranks. Give each global expert its own weights, independent of the dispatcher.
    from megatron.core.transformer.moe.experts import SequentialMLP

    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, SequentialMLP):
                continue
            layer_number = int(name.split("layers.")[1].split(".")[0])
            offset = module.ep_group.rank() * module.num_local_experts
            for local_idx, expert in enumerate(module.local_experts):
                expert_seed = seed * 100_003 + layer_number * 1009 + offset + local_idx
                gen = torch.Generator().manual_seed(expert_seed)
                expert.linear_fc1.weight.normal_(0.0, 0.02, generator=gen)
                expert.linear_fc2.weight.normal_(0.0, 0.02 / (2 * num_layers) ** 0.5, generator=gen)


def _rollout_lengths(args: argparse.Namespace, step: int, rank: int, count: int) -> list[int]:
    """Lengths of ``count`` rollouts of ``rank`` at ``step``: a clipped lognormal (module
    docstring)."""
    gen = np.random.default_rng([args.seed, step, rank, 0x1E7])
    raw = np.rint(np.exp(np.log(args.len_median) + args.len_sigma * gen.standard_normal(count)))
    return np.clip(raw, args.len_min, args.seq_length).astype(int).tolist()


def _balanced_split(lengths: list[int], parts: int) -> list[list[int]]:
    """``lengths`` in ``parts`` groups of near-equal sums: longest first into the lightest group."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for length in sorted(lengths, reverse=True):
        lightest = min(range(parts), key=lambda i: (sums[i], i))
        groups[lightest].append(length)
        sums[lightest] += length
    return groups


def _balanced_deal(per_rank: list[list[int]]) -> list[list[int]]:
    """All ranks' rollouts dealt back with the same count per rank and near-equal token sums:
    longest first to the lightest rank with room (slime --balance-data, verl balance_batch)."""
    count, world = len(per_rank[0]), len(per_rank)
    ranks: list[list[int]] = [[] for _ in range(world)]
    sums = [0] * world
    for length in sorted((n for lengths in per_rank for n in lengths), reverse=True):
        lightest = min(
            (r for r in range(world) if len(ranks[r]) < count), key=lambda r: (sums[r], r)
        )
        ranks[lightest].append(length)
        sums[lightest] += length
    return ranks


def micro_batch_plan(args: argparse.Namespace, step: int) -> list[list[list[int]]]:
    """Sequence lengths of every micro-batch of every rank at ``step``: ``[rank][micro-batch]``.

    The same on every rank (a seeded draw of all ranks' rollouts), so all ranks run the same number
    of micro-batches, as the EP all-to-alls require. ``fixed``: ``--micro-batch-size`` rows of
    ``--seq-length``; ``packed``/``budget``: the rollouts packed into one row per micro-batch.
    """
    world = args.nprocs
    if args.batching == "fixed":
        return [[[args.seq_length] * args.micro_batch_size] for _ in range(world)]
    count = args.micro_batch_size if args.batching == "packed" else args.samples_per_rank
    per_rank = [_rollout_lengths(args, step, r, count) for r in range(world)]
    if args.balance_ranks:
        per_rank = _balanced_deal(per_rank)
    if args.batching == "packed":
        return [[lengths] for lengths in per_rank]
    parts = max(-(-sum(lengths) // args.max_tokens_per_gpu) for lengths in per_rank)
    return [_balanced_split(lengths, parts) for lengths in per_rank]


def _sequences(gen: torch.Generator, count: int, length: int, vocab: int) -> torch.Tensor:
    """[count, length + 1] arithmetic token sequences (start and stride random): learnable
    quickly."""
    start = torch.randint(0, vocab, (count, 1), generator=gen)
    stride = torch.randint(1, 8, (count, 1), generator=gen)
    return (start + stride * torch.arange(length + 1)) % vocab


def _batch(
    args: argparse.Namespace, rank: int, step: int, micro_batch: int, lengths: list[int]
) -> dict[str, torch.Tensor]:
    """One micro-batch: ``fixed`` rows of equal length, else the rollouts packed into one row."""
    gen = torch.Generator().manual_seed(
        args.seed * 7919 + rank * 104_729 + step + micro_batch * 1_000_003
    )
    v = args.vocab_size
    if args.batching == "fixed":
        b, s = len(lengths), lengths[0]
        tokens = _sequences(gen, b, s, v)
        causal_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)  # True = masked
        return {
            "input_ids": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s),
            "attention_mask": causal_mask.view(1, 1, s, s).expand(b, 1, s, s),
        }
    rollouts = [_sequences(gen, 1, n, v)[0] for n in lengths]
    inputs = torch.cat([r[:-1] for r in rollouts]).unsqueeze(0)
    labels = torch.cat([r[1:] for r in rollouts]).unsqueeze(0)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    s = int(segment.numel())
    # Block-diagonal causal mask (True = masked): a rollout attends only to its own earlier tokens.
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1) | (
        segment[:, None] != segment[None, :]
    )
    return {
        "input_ids": inputs,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
        "attention_mask": mask.view(1, 1, s, s),
    }


def _all_reduce_grads(params: list[torch.nn.Parameter], group, world_size: int) -> None:
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world_size)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _quiet_known_warnings() -> None:
    # Each rank would print the same optional-dependency notices (no TE, Apex, absl) and torch's
    # all_gather_into_tensor deprecation; they say nothing about this run.
    for message in (
        ".*Transformer Engine.*",
        ".*Apex is not installed.*",
        ".*absl.logging.*",
        ".*all_gather_into_tensor.*",
        ".*full scope is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=message)


def _ops_in_use() -> str:
    """Which data-movement ops railwave ran on CPU here: the compiled ones or the pure-torch
    reference (with the reason, ``ops.load_error``)."""
    from megatron_railwave import ops

    if ops.compiled_for(torch.device("cpu")):
        return "compiled (megatron_railwave._C)"
    return f"pure-torch reference ({ops.load_error()})"


def _train(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    _quiet_known_warnings()
    if not args.torch_compile:
        # megatron.core.jit wraps a few helpers (e.g. the router's expert-bias update) in
        # torch.compile; on CPU that compiles C++ for ~20 s per process and changes no number.
        torch._dynamo.config.disable = True
    store = dist.TCPStore(
        _LOOPBACK,
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    apply_megatron_cpu_shims()
    layer_paths: dict[int, str] = {}
    log_sink = None
    if args.moe_token_dispatcher_type == "railwave":
        from megatron_railwave.telemetry.commlog import FanoutSink, JsonlStatsSink

        railwave_config = {
            "gpus_per_node": args.gpus_per_node,
            "path": args.railwave_path,
            "failed_rails": [[int(v) for v in f.split(":")] for f in args.failed_rail],
        }
        if args.railwave_capture_dir is not None:
            # Every training forward is its own capture step here (the loop sets no step clock, so
            # the dispatcher counts forwards): each micro-batch's routing is kept.
            railwave_config.update(capture_dir=str(args.railwave_capture_dir), capture_interval=1)
        # The sink sees every layer's statistics: the demo prints which path each layer took, and
        # with --railwave-log-dir every rank writes its records (the report takes the slowest rank).
        log_sink = JsonlStatsSink(args.railwave_log_dir) if args.railwave_log_dir else None
        _require_railwave_install()(
            railwave_config,
            stats_sink=FanoutSink(lambda st: layer_paths.__setitem__(st.layer, st.path), log_sink),
        )

    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    t_imported = time.perf_counter()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world_size
    )
    t_groups = time.perf_counter()
    seed_megatron_cpu_rng(args.seed)
    config = _glm_tiny_config(args, world_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
        rotary_percent=0.5,
        share_embeddings_and_output_weights=False,
    )
    _reinit_experts(model, args.seed, args.num_layers)
    dense_params = [p for p in model.parameters() if getattr(p, "allreduce", True)]
    expert_params = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
    with torch.no_grad():  # dense weights are replicas: start them bit-identical
        for p in dense_params:
            dist.broadcast(p, src=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dp_group = parallel_state.get_data_parallel_group()
    expt_dp_group = parallel_state.get_expert_data_parallel_group()
    tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)

    if rank == 0:
        print(
            f"setup: init+imports {t_imported - t_start:.1f} s, parallel groups "
            f"{t_groups - t_imported:.1f} s, model {time.perf_counter() - t_groups:.1f} s",
            flush=True,
        )
    losses: list[float] = []
    tokens_per_rank: list[list[list[int]]] = []  # [step][micro-batch][rank], as planned
    step_seconds: list[float] = []
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        plan = micro_batch_plan(args, step)
        loss = torch.zeros(())
        for micro_batch, lengths in enumerate(plan[rank]):
            batch = _batch(args, rank, step, micro_batch, lengths)
            # GPTModel returns per-token loss [B, S]; micro-batches weigh equally (gradient
            # accumulation).
            mb_loss = model(**batch).mean() / len(plan[rank])
            mb_loss.backward()
            loss = loss + mb_loss.detach()
        tokens_per_rank.append(
            [[sum(plan[r][m]) for r in range(world_size)] for m in range(len(plan[rank]))]
        )
        _all_reduce_grads(dense_params, dp_group, world_size)
        _all_reduce_grads(expert_params, expt_dp_group, world_size)
        optimizer.step()
        _update_router_expert_bias([model], config, tp_dp_cp_group=tp_dp_cp_group)
        reset_model_temporary_tensors(config, [model])
        moe_log = get_moe_metrics_tracker().report(
            loss_scale=1.0,
            iteration=step + 1,
            num_layers=args.num_layers,
            moe_layer_freq=config.moe_layer_freq,
        )
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
        step_seconds.append(time.perf_counter() - t0)
        if rank == 0:
            paths = " ".join(f"L{k}={v}" for k, v in sorted(layer_paths.items()))
            print(
                f"step {step + 1}/{args.steps} | loss {losses[-1]:.6f} |{moe_log} "
                f"{step_seconds[-1]:.2f} s" + (f" | paths {paths}" if paths else ""),
                flush=True,
            )

    if log_sink is not None:
        log_sink.close()
    if args.railwave_capture_dir is not None:
        from megatron_railwave.dispatcher import flush_captures

        flush_captures()
    if rank == 0 and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "railwave_run": log_sink.run_id if log_sink is not None else None,
                    "railwave_ops": _ops_in_use()
                    if args.moe_token_dispatcher_type == "railwave"
                    else None,
                    "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
                    "nprocs": world_size,
                    "steps": args.steps,
                    "batching": args.batching,
                    "batching_args": {
                        k: getattr(args, k)
                        for k in (
                            "seq_length",
                            "micro_batch_size",
                            "max_tokens_per_gpu",
                            "samples_per_rank",
                            "balance_ranks",
                            "len_median",
                            "len_sigma",
                            "len_min",
                            "seed",
                        )
                    },
                    "tokens_per_rank": tokens_per_rank,
                    "losses": losses,
                    "layer_paths": layer_paths,
                    "step_seconds": step_seconds,
                },
                indent=2,
            )
            + "\n"
        )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _print_plan_skew(args: argparse.Namespace) -> int:
    """The token skew the batcher alone implies (every micro-batch of every step; no model runs)."""
    from megatron_railwave.lab.workloads import token_skew_report

    tokens = [
        [sum(plan[r][m]) for r in range(args.nprocs)]
        for step in range(args.steps)
        for plan in [micro_batch_plan(args, step)]
        for m in range(len(plan[0]))
    ]
    report = token_skew_report(tokens)
    print(
        f"{args.batching}{' balanced' if args.balance_ranks else ''}: {args.nprocs} ranks, "
        f"{args.steps} steps, "
        f"{report['steps']} micro-batches, mean tokens {np.mean(report['mean_tokens']):.0f}, "
        f"token_skew "
        f"{report['token_skew']:.3f}, busiest rank / mean: median "
        f"{np.median(report['max_over_mean']):.2f}, "
        f"max {max(report['max_over_mean']):.2f}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.plan_only:
        return _print_plan_skew(args)
    if args.moe_token_dispatcher_type == "railwave":
        _require_railwave_install()  # fail before spawning eight processes
    # The parent owns the rendezvous store on an OS-chosen port (no free-port race).
    store = dist.TCPStore(_LOOPBACK, 0, None, is_master=True, wait_for_workers=False)
    t0 = time.perf_counter()
    mp.spawn(_train, args=(args.nprocs, store.port, args), nprocs=args.nprocs, join=True)
    print(
        f"{args.nprocs} processes, {args.steps} steps, "
        f"{args.moe_token_dispatcher_type}: {time.perf_counter() - t0:.1f} s total"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
