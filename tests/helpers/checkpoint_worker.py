"""A real Megatron MoELayer under torch's activation checkpointing with ``selector: online``.

Each rank runs ``steps`` training steps of the layer wrapped in ``torch.utils.checkpoint`` (the
reentrant mode, or torch's default non-reentrant one, which stops the recompute as soon as the
tensors its backward needs are back: before the combine), with ``max_bad: 1``, so one bad
timing would switch the layer to JOINT. Every path the dispatcher runs is recorded with its
call (pass kind, step, micro-batch), so the test can check that each recompute replays its
forward's path.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.moe_layer import canonical_moe_layer, rank_inputs

__all__ = ["run_checkpointed_online"]


def run_checkpointed_online(
    rank: int, world: int, kw: dict, steps: int, use_reentrant: bool, mode: dict
) -> dict[str, Any]:
    """``mode``: more RailWave fields (e.g. ``max_tokens_per_rank``, ``online``).

    Returns ``calls``: [(pass kind, step, micro-batch, path run)] in call order; ``bad``: the
    selector's bad timings; ``fallback``: its JOINT-fallback reason (None: none); ``filed``:
    the selector's measured times per (pass kind, path) count."""
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave
    from megatron_railwave.steps import set_step

    e, h, f = kw["num_experts"], kw["hidden"], kw["ffn_hidden"]
    megatron_railwave.install(
        {
            "gpus_per_node": 1,
            "path": "auto",
            "selector": "online",
            "metrics": False,
            **mode,
            "online": {
                "probes": 1,
                "reprobe_every": 2,
                "reprobe_budget": 1.0,
                "max_bad": 1,
                **mode.get("online", {}),
            },
        }
    )
    try:
        with canonical_moe_layer(
            world,
            "railwave",
            num_experts=e,
            topk=kw["topk"],
            hidden=h,
            ffn_hidden=f,
            seed=kw["seed"],
        ) as layer:
            dispatcher = layer.token_dispatcher
            calls: list[tuple[str, int, int, str]] = []
            move = dispatcher._move

            def recording_move(inputs, *, path, **rest):
                call = inputs.state.call
                calls.append((str(call.kind), call.step, call.microbatch, str(path)))
                return move(inputs, path=path, **rest)

            dispatcher._move = recording_move
            layer.train()
            for step in range(steps):
                set_step(step)
                x, grad_weight = rank_inputs(
                    rank, seq_len=kw["seq_len"], micro_batch=2, hidden=h, seed=kw["seed"] + step
                )
                x.requires_grad_(True)
                y, _ = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant)
                (y * grad_weight).sum().backward()
                layer.zero_grad(set_to_none=True)
            set_step(None)
            selector = dispatcher.selector
            filed = {
                f"{kind}/{path}": times.count
                for kind, table in selector._tables.items()
                for nb in table
                for path, times in nb.times.items()
                if times.count
            }
            return {
                "calls": calls,
                "bad": selector.bad_total,
                "problem": selector.last_problem,
                "fallback": selector.fallback_reason,
                "filed": filed,
            }
    finally:
        from megatron_railwave.plugin import uninstall

        uninstall()
