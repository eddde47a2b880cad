"""A real Megatron MoELayer over several steps with ``selector: online`` (spawned CPU ranks).

The same layer (same weights, no optimizer step) runs ``steps`` training steps of new inputs with
Megatron's alltoall dispatcher, with railwave on a fixed path, and with railwave under the online
selector, then one forward-only pass each. Each rank's clock is skewed by its own factor (its
``Stopwatch`` readings times ``clock_factor``), so the ranks measure different local times and
still must take the same decisions: the JSONL log (one file per rank) records them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.helpers.moe_layer import canonical_moe_layer, rank_inputs


def _run_steps(
    rank: int, world: int, dispatcher: str, kw: dict, steps: int
) -> list[dict[str, np.ndarray]]:
    from megatron_railwave.steps import set_step

    e, h, f = kw["num_experts"], kw["hidden"], kw["ffn_hidden"]
    with canonical_moe_layer(
        world, dispatcher, num_experts=e, topk=kw["topk"], hidden=h, ffn_hidden=f, seed=kw["seed"]
    ) as layer:
        out = []
        for step in range(steps):
            set_step(step)
            x, grad_weight = rank_inputs(
                rank,
                seq_len=kw["seq_len"],
                micro_batch=kw["micro_batch"],
                hidden=h,
                seed=kw["seed"] + step,
            )
            x.requires_grad_(True)
            layer.train()
            layer.zero_grad(set_to_none=True)
            y, _ = layer(x)
            (y * grad_weight).sum().backward()
            out.append(
                {
                    "output": y.detach().numpy().copy(),
                    "input_grad": x.grad.numpy().copy(),
                    "router_grad": layer.router.weight.grad.numpy().copy(),
                    "fc1_grad": np.stack(
                        [ex.linear_fc1.weight.grad.numpy() for ex in layer.experts.local_experts]
                    ),
                }
            )
        layer.eval()
        with torch.no_grad():
            x, _ = rank_inputs(
                rank, seq_len=kw["seq_len"], micro_batch=kw["micro_batch"], hidden=h, seed=99
            )
            out.append({"output": layer(x)[0].numpy().copy()})
        set_step(None)
        return out


def run_layer_online(
    rank: int,
    world: int,
    kw: dict,
    steps: int,
    log_dir: str,
    fixed: str,
    *,
    mode: dict | None = None,
    online: dict | None = None,
    bad_online: dict | None = None,
    bad_after: int = 6,
) -> dict[str, Any]:
    """``mode``: more RailWave fields for every railwave run (e.g. ``max_tokens_per_rank``: the
    fixed path and the online runs then share the fixed-capacity mode); ``online`` / ``bad_online``:
    the online knobs of the skewed-clock run and of the NaN run; ``bad_after``: rank 2's clock
    reads NaN after this many readings."""
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave
    from megatron_railwave.telemetry import stats

    original = stats.Stopwatch.elapsed_ms
    clock_factor = 1.0 + 0.7 * rank  # rank r's clock runs 1 + 0.7 r times fast

    def skewed(self):
        return original(self) * clock_factor

    stats.Stopwatch.elapsed_ms = skewed
    try:
        res = {"alltoall": _run_steps(rank, world, "alltoall", kw, steps)}
        base = {"gpus_per_node": 2, **(mode or {})}
        megatron_railwave.install({**base, "path": fixed, "metrics": False})
        res["fixed"] = _run_steps(rank, world, "railwave", kw, steps)
        megatron_railwave.install(
            {
                **base,
                "path": "auto",
                "selector": "online",
                "metrics": True,
                "log_dir": log_dir,
                "log_mode": "rank",
                "online": online or {"probes": 1, "reprobe_every": 2, "reprobe_budget": 1.0},
            }
        )
        res["online"] = _run_steps(rank, world, "railwave", kw, steps)
        megatron_railwave.install(
            {**base, "path": "joint", "metrics": False}
        )  # closes the log sink
        from megatron_railwave.telemetry.megatron_logging import default_metrics_sink

        res["tracker"] = {
            k: v
            for k, v in default_metrics_sink().means().items()
            if k.startswith(("selector", "measured"))
        }

        # Rank 2's clock goes bad (NaN) after ``bad_after`` readings (two per timed call): every
        # rank must fall back to JOINT at the same call.
        readings = [0]

        def bad_on_rank2(self):
            readings[0] += 1
            return float("nan") if rank == 2 and readings[0] > bad_after else original(self)

        stats.Stopwatch.elapsed_ms = bad_on_rank2
        megatron_railwave.install(
            {
                **base,
                "path": "auto",
                "selector": "online",
                "metrics": False,
                "log_dir": log_dir + "/bad",
                "log_mode": "rank",
                **({"online": bad_online} if bad_online else {}),
            }
        )
        res["bad"] = _run_steps(rank, world, "railwave", kw, steps)
        megatron_railwave.install({**base, "path": "joint", "metrics": False})
        return res
    finally:
        stats.Stopwatch.elapsed_ms = original
