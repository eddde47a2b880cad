"""Bad input to RailWaveTokenDispatcher gives a clear error on every rank and never hangs.

One 4-rank gloo run (EP 4 = 2 nodes x 2 GPUs, 2 experts per rank) drives the dispatcher's six
hooks directly (Megatron's router cannot take an empty input, see REFERENCE.md section 3) and
records, per rank, what each case raised; the tests below check those records:

* malformed input on ONE rank (float routing map on rank 1, routing map [T, E + 1] on rank 2,
  probs [T, E - 1] on rank 3): every rank raises InputError naming that rank, right after the
  first collective (the count all-gather); afterwards a good call still works;
* a topology that does not match the EP size (gpus_per_node=3 with EP 4) and unsupported
  TransformerConfig options: ValueError at construction on every rank, before any collective;
* a rank with zero tokens (rank 1) and a rank that receives nothing (no token picks rank 3's
  experts): every path returns the right shapes and values (identity experts) and gradients;
* an old config that still names the retired offline selector (``anchors``, ``selector:
  anchors``, ``payload_ratio``, ``shape_distance``): ValueError at config load on every rank,
  before any collective, naming the key, what replaced it and the fix;
* placement from facts: a launcher that numbers ranks cyclically (EP rank e on host e % 2 as local
  GPU 1 - e // 2) gives the same outputs and gradients, bitwise, as node-by-node numbering; an
  uneven layout (3 + 1 ranks per host) and a rank with another ``failed_rails`` / ``path`` raise one
  clear error on every rank, naming the layout or the ranks and fields;
* statistics on demand: a fixed path without a sink computes no descriptors and no statistics; a
  sink gets the layer's global tokens-per-expert min / max / std and overload factor.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:  # spawned ranks inherit sys.path and import tests.helpers
    sys.path.insert(0, str(_REPO_ROOT))

from megatron_railwave.config import RailWaveConfig  # noqa: E402
from megatron_railwave.names import ROUTES  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)

WORLD = 4
EXPERTS = 8  # 2 per rank; rank r owns experts 2r, 2r + 1
TOPK = 2
HIDDEN = 8
PATHS = list(map(str, ROUTES))

# Options RailWave refuses, with a value that turns each on (each case also names the option).
UNSUPPORTED = {
    "moe_expert_capacity_factor": 1.0,
    "moe_pad_expert_input_to_capacity": True,
    "fp8": "e4m3",
    "moe_latent_size": 16,
    "moe_router_padding_for_quantization": True,
    "moe_router_padding_for_fp8": True,
}
# Megatron's overlap features RailWave supports (issue 36): accepted at construction.
OVERLAP_OPTIONS = {"moe_shared_expert_overlap": True, "overlap_moe_expert_parallel_comm": True}


# ---------------------------------------------------------------------- worker (spawned ranks)
def _inputs(rank: int, tokens: int, *, avoid_rank: int | None = None, seed: int = 0):
    """hidden [T, H], probs [T, E] (zero off the map), routing map [T, E] bool of one rank."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    if avoid_rank is not None:  # nobody routes to this rank's experts: it receives nothing
        per = EXPERTS // WORLD
        scores[:, avoid_rank * per : (avoid_rank + 1) * per] = -1.0
    routing = torch.zeros(tokens, EXPERTS, dtype=torch.bool)
    routing.scatter_(1, scores.topk(TOPK, dim=1).indices, True)
    probs = torch.rand(tokens, EXPERTS, generator=gen) * routing
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    return hidden, probs, routing


def _run_hooks(dispatcher: Any, hidden, probs, routing):
    """The six hooks with identity experts (y = x * prob). Returns (out [S, 1, H],
    tokens_per_expert)."""
    x, p = dispatcher.dispatch_preprocess(hidden.unsqueeze(1), routing, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, tokens_per_expert, p = dispatcher.dispatch_postprocess(x, p)
    y = dispatcher.combine_preprocess(x * p.unsqueeze(1))
    return dispatcher.combine_postprocess(dispatcher.token_combine(y)), tokens_per_expert


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test checks type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dispatcher_errors_worker(rank: int, world: int) -> dict[str, Any]:
    from megatron_railwave.testing.megatron_cpu import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_railwave.dispatcher import RailWaveTokenDispatcher

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    per = EXPERTS // world
    local = list(range(rank * per, (rank + 1) * per))

    def config(**changes: Any) -> TransformerConfig:
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=2,
            ffn_hidden_size=HIDDEN,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_token_dispatcher_type="alltoall",
            expert_model_parallel_size=world,
            use_cpu_initialization=True,
            add_bias_linear=False,
            moe_grouped_gemm=False,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
        )
        cfg.moe_token_dispatcher_type = "railwave"
        for key, value in changes.items():  # set after __post_init__: Megatron's own checks aside
            setattr(cfg, key, value)
        return cfg

    def make(path: str = "native", **changes: Any) -> RailWaveTokenDispatcher:
        return RailWaveTokenDispatcher(
            per, local, config(**changes), pgs, railwave=RailWaveConfig(gpus_per_node=2, path=path)
        )

    out: dict[str, Any] = {}
    # Construction errors: raised locally, before any collective, so no rank can hang.
    out["topology"] = _error_text(
        lambda: RailWaveTokenDispatcher(
            per, local, config(), pgs, railwave=RailWaveConfig(gpus_per_node=3, path="native")
        )
    )
    out["unsupported"] = {
        key: _error_text(lambda k=key, v=value: make(**{k: v}))
        for key, value in UNSUPPORTED.items()
    }
    out["tensor_parallel"] = _error_text(lambda: make(expert_tensor_parallel_size=2))
    out["overlap_accepted"] = {
        key: _error_text(lambda k=key, v=value: make(**{k: v}))
        for key, value in OVERLAP_OPTIONS.items()
    }
    out["attention_tp_accepted"] = _error_text(
        lambda: make(tensor_model_parallel_size=2, sequence_parallel=True, moe_permute_fusion=True)
    )

    # Placement from facts: hosts and local ranks as a cyclic launcher would give them.
    import os

    def with_env(env: dict[str, str], fn):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # Cyclic over hosts, and GPUs numbered against the rank order within a host, so that torch's
    # group ranks (by global rank) differ from the railwave order in the node groups too.
    cyclic = {"RAILWAVE_HOST": f"host{rank % 2}", "LOCAL_RANK": str(1 - rank // 2)}
    out["placement"] = {}
    for name, env in (("node_by_node", {}), ("cyclic", cyclic)):
        d = with_env(env, lambda: make("joint"))
        out["placement"][name] = {
            "railwave_rank_of_ep": list(d.placement.railwave_rank_of_ep),
            "hosts": list(d.placement.node_hosts),
        }
        hidden, probs, routing = _inputs(rank, 5, seed=3)
        hidden.requires_grad_(True)
        probs.requires_grad_(True)
        result, tokens_per_expert = _run_hooks(d, hidden, probs, routing)
        (result * torch.linspace(-1, 1, result.numel()).view_as(result)).sum().backward()
        out["placement"][name].update(
            out=result.detach().numpy(),
            dx=hidden.grad.numpy(),
            dp=probs.grad.numpy(),
            tokens_per_expert=tokens_per_expert.tolist(),
        )
    uneven = {"RAILWAVE_HOST": "hostA" if rank < 3 else "hostB"}
    out["uneven"] = with_env(uneven, lambda: _error_text(lambda: make("joint")))
    out["mismatch_failed_rail"] = _error_text(
        lambda: RailWaveTokenDispatcher(
            per,
            local,
            config(),
            pgs,
            railwave=RailWaveConfig(
                gpus_per_node=2, path="native", failed_rails=[[1, 0]] if rank == 3 else []
            ),
        )
    )
    out["mismatch_path"] = _error_text(lambda: make("rail" if rank in (0, 2) else "perm"))

    # Statistics on demand: count the descriptor and statistics calls of one layer call each.
    # The counted mode computes a decision's descriptors, the dispatcher's tail the statistics.
    import megatron_railwave.dispatch_modes.counted as counted_module
    import megatron_railwave.dispatcher as dispatcher_module
    from megatron_railwave.exchange.torch_dist import TorchDistExchange

    calls = {"demand_stats": 0, "layer_comm_stats": 0}
    order: list[str] = []  # the descriptor / statistics calls and the dispatch, as they happen

    def counting(name):
        original = getattr(dispatcher_module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            order.append(name)
            return original(*args, **kwargs)

        return original, wrapper

    originals = {}
    for name in calls:
        originals[name], wrapper = counting(name)
        for module in (dispatcher_module, counted_module):
            if hasattr(module, name):
                setattr(module, name, wrapper)
    original_dispatch = TorchDistExchange.dispatch

    def dispatch(self, *args, **kwargs):
        order.append("dispatch")
        return original_dispatch(self, *args, **kwargs)

    TorchDistExchange.dispatch = dispatch
    out["stats_calls"] = {}
    out["stats_order"] = {}
    seen: list[Any] = []
    try:

        class Selector:  # a caller's PathSelector reads the descriptors
            def select(self, stats):
                assert stats is not None
                return "rail"

        for case, kwargs in (
            ("fixed_no_sink", dict(path="native")),
            ("selector_no_sink", dict(path="auto", selector=Selector())),
            ("selector_with_sink", dict(path="auto", selector=Selector(), stats_sink=[].append)),
            ("fixed_with_sink", dict(path="native", stats_sink=seen.append)),
        ):
            calls.update(demand_stats=0, layer_comm_stats=0)
            order.clear()
            d = RailWaveTokenDispatcher(
                per,
                local,
                config(),
                pgs,
                railwave=RailWaveConfig(gpus_per_node=2, path=kwargs["path"]),
                selector=kwargs.get("selector"),
                stats_sink=kwargs.get("stats_sink"),
            )
            _run_hooks(d, *_inputs(rank, 6, seed=4))
            out["stats_calls"][case] = dict(calls)
            out["stats_order"][case] = list(order)
    finally:
        for name, original in originals.items():
            for module in (dispatcher_module, counted_module):
                if hasattr(module, name):
                    setattr(module, name, original)
        TorchDistExchange.dispatch = original_dispatch
    _, _, routing = _inputs(rank, 6, seed=4)
    load = routing.sum(0).to(torch.int64)
    dist.all_reduce(load)
    out["expert_load"] = {
        "expected": load.tolist(),
        "logged": {
            k: getattr(seen[0], k)
            for k in (
                "tokens_per_expert_min",
                "tokens_per_expert_max",
                "tokens_per_expert_std",
                "overload_factor",
            )
        },
        "pass_kind": seen[0].pass_kind,
        "rail_bytes": seen[0].rail_bytes,
    }

    # An old config naming the retired offline selector: every rank fails at config load, before
    # any collective (each rank reads the same file), with the key, what replaced it and the fix.
    from megatron_railwave.config import load_config

    out["retired_keys"] = {}
    for key, value in (
        ("anchors", "h800_4x8"),
        ("selector", "anchors"),
        ("payload_ratio", 1.25),
        ("shape_distance", 0.02),
    ):
        try:
            load_config({"gpus_per_node": 2, "path": "auto", key: value})
            out["retired_keys"][key] = "no error"
        except ValueError as exc:
            out["retired_keys"][key] = str(exc)

    # Malformed input on one rank: every rank raises after the count all-gather.
    dispatcher = make("joint")
    cases = {
        "float_routing_map": (1, lambda h, p, r: (h, p, r.float())),
        "routing_map_shape": (2, lambda h, p, r: (h, p, torch.cat([r, r[:, :1]], dim=1))),
        "probs_shape": (3, lambda h, p, r: (h, p[:, :-1], r)),
    }
    for name, (bad_rank, spoil) in cases.items():
        hidden, probs, routing = _inputs(rank, 6)
        if rank == bad_rank:
            hidden, probs, routing = spoil(hidden, probs, routing)
        out[name] = _error_text(
            lambda h=hidden, p=probs, r=routing: _run_hooks(dispatcher, h, p, r)
        )
    hidden, probs, routing = _inputs(rank, 6)
    after, _ = _run_hooks(dispatcher, hidden, probs, routing)
    out["good_after_errors"] = bool(
        torch.allclose(after.squeeze(1), hidden * probs.sum(1, keepdim=True), atol=1e-6)
    )

    # Rank 1 has no tokens; nobody routes to rank 3's experts.
    tokens = [5, 0, 7, 3]
    out["zero_tokens"] = {}
    for path in PATHS:
        dispatcher = make(path)
        hidden, probs, routing = _inputs(rank, tokens[rank], avoid_rank=3, seed=1)
        hidden.requires_grad_(True)
        probs.requires_grad_(True)
        result, tokens_per_expert = _run_hooks(dispatcher, hidden, probs, routing)
        grad = torch.ones_like(result)
        (result * grad).sum().backward()
        expected = hidden.detach() * probs.detach().sum(1, keepdim=True)
        out["zero_tokens"][path] = {
            "shape": list(result.shape),
            "tokens_per_expert": tokens_per_expert.tolist(),
            "out_err": float((result.detach().squeeze(1) - expected).abs().max())
            if result.numel()
            else 0.0,
            # d/dx sum(x * s) = s; d/dp[t, e] = sum_h x[t, h] on the routed entries.
            "dx_err": float(
                (hidden.grad - probs.detach().sum(1, keepdim=True).expand_as(hidden)).abs().max()
            )
            if hidden.numel()
            else 0.0,
            "dp_err": float(
                (probs.grad - hidden.detach().sum(1, keepdim=True) * routing).abs().max()
            )
            if probs.numel()
            else 0.0,
        }
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return out


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(dispatcher_errors_worker, WORLD, timeout_s=300)


@pytest.mark.parametrize(
    "case,bad_rank,detail",
    [
        ("float_routing_map", 1, "routing_map has dtype torch.float32, expected torch.bool"),
        ("routing_map_shape", 2, r"routing_map has shape \(6, 9\), expected \[T, 8\]"),
        ("probs_shape", 3, r"probs has shape \(6, 7\), expected routing_map's \(6, 8\)"),
    ],
)
def test_dispatcher_bad_input_on_one_rank_raises_on_every_rank(ranks, case, bad_rank, detail):
    import re

    for rank, res in enumerate(ranks):
        text = res[case]
        assert text.startswith(
            f"InputError: malformed dispatcher input on EP rank(s) [{bad_rank}]"
        ), f"rank {rank}: {text}"
        assert ("this rank: " in text) == (rank == bad_rank), f"rank {rank}: {text}"
        if rank == bad_rank:
            assert re.search(detail, text), text


def test_dispatcher_recovers_after_bad_input(ranks):
    assert all(res["good_after_errors"] for res in ranks)


def test_dispatcher_topology_mismatch_raises_at_construction(ranks):
    for res in ranks:
        assert res["topology"].startswith(
            "ValueError: EP size 4 is not a multiple of gpus_per_node=3"
        ), res["topology"]


def test_retired_selector_keys_fail_at_config_load_on_every_rank(ranks):
    first = ranks[0]["retired_keys"]
    assert first["anchors"].startswith("railwave config: anchors='h800_4x8' was removed: ")
    assert "path: auto runs the online selector" in first["anchors"]
    assert "Delete the key" in first["anchors"]
    assert first["selector"].startswith("railwave config: selector='anchors' was removed: ")
    assert "Delete selector" in first["selector"] and "path: joint" in first["selector"]
    for key in ("payload_ratio", "shape_distance"):
        assert f"{key}=" in first[key] and "was removed" in first[key]
        assert f"online: {{{key}: ...}}" in first[key] and "move it under online:" in first[key]
    assert all(res["retired_keys"] == first for res in ranks)


@pytest.mark.parametrize("option", sorted(UNSUPPORTED) + ["tensor_parallel"])
def test_dispatcher_unsupported_option_raises_naming_it(ranks, option):
    name = "expert_tensor_parallel_size" if option == "tensor_parallel" else option
    for res in ranks:
        text = res[option] if option == "tensor_parallel" else res["unsupported"][option]
        assert text.startswith(
            "ValueError: moe_token_dispatcher_type='railwave' does not support"
        ), text
        assert name in text and "'alltoall' dispatcher" in text, text


def test_dispatcher_accepts_megatron_overlap_options(ranks):
    for res in ranks:
        assert res["overlap_accepted"] == {key: "no error" for key in OVERLAP_OPTIONS}, res[
            "overlap_accepted"
        ]


@pytest.mark.parametrize("path", PATHS)
def test_dispatcher_rank_with_zero_tokens_and_rank_receiving_nothing(ranks, path):
    tokens = [5, 0, 7, 3]
    for rank, res in enumerate(ranks):
        got = res["zero_tokens"][path]
        assert got["shape"] == [tokens[rank], 1, HIDDEN]
        assert max(got["out_err"], got["dx_err"], got["dp_err"]) < 1e-5, (rank, got)
    assert ranks[3]["zero_tokens"][path]["tokens_per_expert"] == [0, 0]  # receives nothing
    assert sum(sum(r["zero_tokens"][path]["tokens_per_expert"]) for r in ranks) == TOPK * sum(
        tokens
    )


def test_unknown_path_name_is_rejected_with_the_allowed_names():
    with pytest.raises(
        ValueError, match=r"unknown path 'fastest'; choose one of native, rail, perm, joint"
    ):
        RailWaveConfig(path="fastest")


def test_topology_mismatch_names_sizes_and_fix():
    with pytest.raises(
        ValueError,
        match=r"EP size 4 is not a multiple of gpus_per_node=3; an EP group must "
        r"span whole nodes",
    ):
        RailWaveConfig(gpus_per_node=3).topology(4)
    with pytest.raises(ValueError):
        RailWaveConfig(
            cluster=str(_REPO_ROOT / "megatron_railwave" / "configs" / "clusters" / "h800_4x8.yaml")
        ).topology(4)


def test_dispatcher_accepts_attention_tensor_parallel_and_permute_fusion(ranks):
    # Attention TP is folded out of the expert grid: with expert-TP 1 nothing changes for the
    # exchange. --moe-permute-fusion selects Megatron's fused permute kernels, which railwave does
    # not call.
    assert all(res["attention_tp_accepted"] == "no error" for res in ranks), [
        r["attention_tp_accepted"] for r in ranks
    ]


def test_placement_follows_hosts_and_local_ranks_not_rank_numbers(ranks):
    # EP rank e on host e % 2 as local GPU 1 - e // 2, so railwave rank = (e % 2) * 2 + 1 - e // 2.
    for res in ranks:
        assert res["placement"]["node_by_node"]["railwave_rank_of_ep"] == [0, 1, 2, 3]
        assert res["placement"]["cyclic"]["railwave_rank_of_ep"] == [1, 3, 0, 2]
        assert res["placement"]["cyclic"]["hosts"] == ["host0", "host1"]
    for rank, res in enumerate(ranks):
        a, b = res["placement"]["node_by_node"], res["placement"]["cyclic"]
        for key in ("out", "dx", "dp"):
            assert np.array_equal(a[key], b[key]), (
                f"rank {rank}: {key} differs under the cyclic placement"
            )
        assert a["tokens_per_expert"] == b["tokens_per_expert"]
        # And the identity experts' closed form (hidden * sum of probs) holds.
        assert np.abs(a["out"]).sum() > 0


def test_uneven_layout_raises_one_clear_error_on_every_rank(ranks):
    for res in ranks:
        text = res["uneven"]
        assert text.startswith(
            "PlacementError: RailWave cannot serve this EP layout: 4 EP ranks over 2 node(s) "
            "(hostA: EP ranks [0, 1, 2]; hostB: EP ranks [3])"
        ), text
        assert "every node must hold the same number of EP ranks" in text and "Fix:" in text


@pytest.mark.parametrize(
    "case,field,groups",
    [
        ("mismatch_failed_rail", "failed_rails", "EP ranks [0, 1, 2] vs EP ranks [3]"),
        ("mismatch_path", "path", "EP ranks [0, 2] vs EP ranks [1, 3]"),
    ],
)
def test_config_mismatch_is_one_error_on_every_rank(ranks, case, field, groups):
    texts = {res[case].split(" (this rank:")[0] for res in ranks}
    assert len(texts) == 1, texts  # the same message everywhere (only the own values differ)
    text = ranks[0][case]
    assert text.startswith(
        "ConfigMismatchError: RailWave configuration differs between ranks of one EP group: "
        f"'{field}' differs ({groups})"
    ), text


def test_statistics_only_when_a_selector_or_sink_needs_them(ranks):
    for res in ranks:
        assert res["stats_calls"]["fixed_no_sink"] == {"demand_stats": 0, "layer_comm_stats": 0}
        assert res["stats_calls"]["selector_no_sink"] == {"demand_stats": 1, "layer_comm_stats": 0}
        assert res["stats_calls"]["fixed_with_sink"] == {"demand_stats": 1, "layer_comm_stats": 1}
        # The descriptors a decision reads come before the dispatch; the statistics only after it
        # is posted (host work no transfer waits for).
        assert res["stats_order"]["selector_no_sink"] == ["demand_stats", "dispatch"]
        assert res["stats_order"]["fixed_with_sink"] == [
            "dispatch",
            "demand_stats",
            "layer_comm_stats",
        ]
        # A decision's descriptors serve the statistics too: computed once, before the dispatch.
        assert res["stats_order"]["selector_with_sink"] == [
            "demand_stats",
            "dispatch",
            "layer_comm_stats",
        ]


def test_stats_carry_the_global_expert_load(ranks):
    load = np.array(ranks[0]["expert_load"]["expected"], dtype=np.float64)
    for res in ranks:
        logged = res["expert_load"]["logged"]
        assert res["expert_load"]["expected"] == list(load.astype(int))
        assert (
            logged["tokens_per_expert_min"] == load.min()
            and logged["tokens_per_expert_max"] == load.max()
        )
        assert logged["tokens_per_expert_std"] == pytest.approx(load.std())
        assert logged["overload_factor"] == pytest.approx(load.max() / load.mean())
        assert res["expert_load"]["pass_kind"] == "train"
        assert (
            len(res["expert_load"]["rail_bytes"]) == 2
            and sum(map(sum, res["expert_load"]["rail_bytes"])) > 0
        )
