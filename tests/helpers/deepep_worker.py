"""Workers for the DeepEP backend tests (spawned gloo ranks, the fake DeepEP Buffer)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave.exchange import InputError, TorchDistExchange, build_rail_groups
from megatron_railwave.exchange.deepep import DeepEPExchange
from megatron_railwave.planner import PlanOptions
from megatron_railwave.testing.deepep_fake import fake_deepep_api, use_fake_deepep
from megatron_railwave.topology import RailTopology
from tests.helpers.exchange_worker import expert_weights, make_inputs

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_backends(
    rank: int,
    world: int,
    topo_kwargs: dict,
    paths: list[str],
    kw: dict,
    dtype: str,
    torch_paths: tuple[str, ...] = ("native",),
) -> dict[str, Any]:
    """One layer per (backend, path): dispatch, linear experts ``y = p * x @ A_e``, combine, and the
    backward of ``sum(out * out)``; the DeepEP backend (fake Buffer) runs ``paths``, the torch
    backend ``torch_paths``. Returns {"torch/<path>" | "deepep/<path>": (out, dx, dprobs)} as
    float32 numpy (bf16 widens exactly, so equal arrays mean equal bits), and per path
    "shape/<path>": the DeepEP run's waves, rows relayed into this rank and rows it dispatched."""
    topo = RailTopology(**topo_kwargs)
    groups = build_rail_groups(None, topo)
    hidden_dtype = _DTYPES[dtype]
    backends = {
        "torch": TorchDistExchange(topo, groups, num_experts=kw["experts"], options=PlanOptions()),
        "deepep": DeepEPExchange(
            topo,
            groups,
            num_experts=kw["experts"],
            topk=kw["topk"],
            hidden_size=kw["hidden"],
            hidden_dtype=hidden_dtype,
            api=fake_deepep_api(topo.gpus_per_node),
            options=PlanOptions(),
        ),
    }
    per_rank = kw["experts"] // world
    local_w = expert_weights(kw["experts"], kw["hidden"], kw["seed"])[
        rank * per_rank : (rank + 1) * per_rank
    ]
    local_w = local_w.to(hidden_dtype)
    results = {}
    for name, ex in backends.items():
        for path in torch_paths if name == "torch" else paths:
            x, probs, routing = make_inputs(rank, **kw)
            x = x.to(hidden_dtype).requires_grad_(True)
            probs.requires_grad_(True)
            layer = ex.gather_demand(x, probs, routing)
            prepared = ex.prepare(layer, ex.plan(layer, path), x, probs)
            d = ex.dispatch(x, probs, routing, prepared)
            if name == "deepep":  # what the DeepEP path really did: waves, relayed rows
                pool = prepared.layer.layout.pool_counts
                results[f"shape/{path}"] = {
                    "waves": len(prepared.wave_rows),
                    "relayed_in": sum(pool[1:]),
                    "dispatched": sum(prepared.wave_rows),
                }
            outs = [
                rows @ local_w[e]
                for e, rows in enumerate(d.tokens.split(d.tokens_per_expert.tolist()))
            ]
            y = torch.cat(outs) * d.probs.unsqueeze(1).to(hidden_dtype) if outs else d.tokens[:0]
            out = ex.combine(y, d.handle)
            (out.float() * out.float()).sum().backward()
            results[f"{name}/{path}"] = (
                out.detach().float().numpy(),
                x.grad.float().numpy(),
                probs.grad.numpy(),
            )
    dist.barrier()
    return results


def run_moe_layer_backends(
    rank: int, world: int, railwave: dict, paths: list[str], kw: dict
) -> dict[str, Any]:
    """A real Megatron MoELayer (forward + backward): 'alltoall', railwave on the torch backend
    (native), then railwave on the DeepEP backend with the fake Buffer, once per path."""
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import megatron_railwave
    from tests.helpers.moe_layer import build_and_run_moe_layer

    out = {"alltoall": build_and_run_moe_layer(rank, world, "alltoall", **kw)}
    megatron_railwave.install({**railwave, "path": "native", "backend": "torch"})
    out["torch/native"] = build_and_run_moe_layer(rank, world, "railwave", **kw)
    with use_fake_deepep():  # backend 'deepep' on the fake Buffer: a testing hook, not config
        for path in paths:
            megatron_railwave.install({**railwave, "path": path, "backend": "deepep"})
            out[f"deepep/{path}"] = build_and_run_moe_layer(rank, world, "railwave", **kw)
    return out


def run_unsupported_layouts(rank: int, world: int) -> dict[str, str]:
    """Every rank builds a DeepEP exchange the layout or the install cannot run; returns the error
    text each construction raised (nothing may hang: the checks come before any communication)."""
    from megatron_railwave.exchange import build_exchange

    topo = RailTopology(num_nodes=2, gpus_per_node=world // 2)
    groups = build_rail_groups(None, topo)
    common = dict(backend="deepep", num_experts=2 * world, topk=2, options=PlanOptions())
    fake = fake_deepep_api(topo.gpus_per_node)
    errors = {}
    for name, kwargs in (
        ("hidden", dict(hidden_size=100, hidden_dtype=torch.float32, deepep_api=fake)),
        ("real", dict(hidden_size=256, hidden_dtype=torch.bfloat16)),
    ):
        try:
            build_exchange(topo, groups, **kwargs, **common)
            errors[name] = "no error"
        except (ValueError, ImportError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # A routing map with more experts per token than the exchange was built for (top-3 routed,
    # topk=1 declared): DeepEP's per-expert counts disagree with the count exchange.
    ex = build_exchange(
        topo,
        groups,
        hidden_size=256,
        hidden_dtype=torch.float32,
        deepep_api=fake,
        **{**common, "topk": 1},
    )
    x, probs, routing = make_inputs(
        rank,
        tokens=[16] * world,
        experts=2 * world,
        topk=3,
        hidden=256,
        seed=3,
        gpus_per_node=world // 2,
    )
    layer = ex.gather_demand(x, probs, routing)
    try:
        ex.dispatch(x, probs, routing, ex.prepare(layer, ex.plan(layer, "native"), x, probs))
        errors["topk"] = "no error"
    except InputError as exc:
        errors["topk"] = f"InputError: {exc}"
    dist.barrier()
    return errors
