"""The DeepEP backend without processes: DeepEP's limits, the import error, the Buffer size, the
backend selection fields and flag, and the fake's Config (the real wheel:
test_deepep_conformance)."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_railwave.config import RailWaveConfig
from megatron_railwave.exchange import TorchDistExchange, build_exchange, virtual_rank_groups
from megatron_railwave.exchange.deepep_api import (
    REAL_LIMITS,
    deepep_buffer_bytes,
    deepep_layout_problems,
    dispatch_row_bytes,
    load_deep_ep,
)
from megatron_railwave.plugin import add_railwave_args, config_from_args
from megatron_railwave.testing.deepep_fake import fake_deep_ep, fake_deepep_api, use_fake_deepep
from megatron_railwave.topology import RailTopology

GLM = dict(hidden_size=4096, hidden_dtype=torch.bfloat16, topk=8, num_experts=128)


def _problems(nodes: int, gpus: int, **overrides) -> list[str]:
    return deepep_layout_problems(
        RailTopology(num_nodes=nodes, gpus_per_node=gpus), REAL_LIMITS, **{**GLM, **overrides}
    )


def test_deepep_limits_glm45_air_on_4x8_has_no_problem():
    assert _problems(4, 8) == []


@pytest.mark.parametrize(
    "nodes,gpus,overrides,expected",
    [
        (4, 4, {}, "4 GPUs per node (DeepEP's internode kernels need exactly 8)"),
        (1, 8, {}, "an EP group of 8 ranks inside one node"),
        (
            5,
            8,
            {"num_experts": 160},
            "5 nodes (DeepEP's internode kernels are built for [2, 3, 4, 6, 8, 12, 16, 18, 20]",
        ),
        (24, 8, {"num_experts": 192}, "24 nodes"),
        (
            4,
            8,
            {"hidden_dtype": torch.float32, "hidden_size": 2048},
            "hidden dtype torch.float32 (DeepEP's combine reduces [torch.bfloat16]",
        ),
        (4, 8, {"hidden_size": 4000}, "hidden size 4000 (8000 bytes per row"),
        # 64 experts per node, top-40: 40 top-k slots per record row.
        (
            4,
            8,
            {"num_experts": 256, "topk": 40},
            "top-k 40 with 64 experts per node (40 slots per record; DeepEP: <= 32)",
        ),
        # 8192 x 2 B payload + 16 B meta + 8 B source meta + 8 x (4 + 4) B top-k = 16472 -> 16480
        # (16-aligned) > 16376 B of one warp's TMA buffer (16384 - 8).
        (4, 8, {"hidden_size": 8192}, "16480 bytes per dispatched row"),
    ],
    ids=[
        "4-gpus",
        "one-node",
        "5-nodes",
        "24-nodes",
        "fp32",
        "hidden-4000",
        "topk-40",
        "hidden-8192",
    ],
)
def test_deepep_limits_name_the_problem(nodes, gpus, overrides, expected):
    problems = _problems(nodes, gpus, **overrides)
    assert len(problems) == 1 and expected in problems[0], problems


def test_deepep_buffer_sized_from_config_hints_glm45_air_4x8():
    """Hand-computed from DeepEP's Config hints (csrc/legacy/config.hpp) for W = 32, rows of
    4096 x 2 + 16 = 8208 bytes, recommended configs Config(20, 32, 288, 8, 128) / Config(20, 1, 288,
    8, 128):
    NVL:  10 ch x 8 x (2 x 4 + 3) x 4 B + 10 x 8 x 288 x (8208 + 8 + 128 x 8 + 128 x 4 + 128 x 4) =
    236486080
          -> 236486144 (128-aligned; 225.5 MiB);
    RDMA: 10 x 4 x 18 x 2 x 4 B + 10 x 4 x 128 x (8208 + 8 + 1024 + 512 + 512 + 16) x 2 = 105272960
    (100.4 MiB).
    """
    api = fake_deep_ep(8)
    api.Buffer.set_num_sms(20)
    row = dispatch_row_bytes(4096, torch.bfloat16)
    assert row == 8208
    nvl, rdma = deepep_buffer_bytes(
        api.Buffer.get_dispatch_config(32),
        api.Buffer.get_combine_config(32),
        num_ranks=32,
        row_bytes=row,
    )
    assert (nvl, rdma) == (236486144, 105272960)


def test_fake_config_checks_like_deepep():
    api = fake_deep_ep(8)
    with pytest.raises(RuntimeError, match="nvl chunked send tokens < nvl chunked recv tokens"):
        api.Config(20, 8, 6, 6, 128)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 40"):
        api.Buffer.get_dispatch_config(40)


def test_fake_with_2_gpus_per_node_uses_the_configs_of_the_same_node_count():
    """Fake 4 x 2 (8 ranks) sizes like DeepEP's 4 x 8 (32 ranks): same chunk sizes, per-node peers
    2."""
    small, real_like = (
        fake_deep_ep(2).Buffer.get_dispatch_config(8),
        fake_deep_ep(8).Buffer.get_dispatch_config(32),
    )
    assert small.num_max_nvl_chunked_recv_tokens == real_like.num_max_nvl_chunked_recv_tokens == 288


def test_load_real_deep_ep_names_the_wheel_and_the_fallback():
    try:
        import deep_ep  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    else:
        pytest.skip("deep_ep imports here")
    with pytest.raises(
        ImportError,
        match=r"needs DeepEP 2.1 .*Install the `tokenspeed-deepep` wheel.*backend: torch",
    ):
        load_deep_ep()


def test_build_exchange_auto_on_a_cpu_job_is_torch():
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    ex = build_exchange(
        topo,
        virtual_rank_groups(topo, 0),
        backend="auto",
        num_experts=8,
        topk=2,
        **{"hidden_size": 256, "hidden_dtype": torch.bfloat16},
    )
    assert type(ex) is TorchDistExchange


def test_build_exchange_deepep_bad_layout_raises_before_communication():
    """One node: no process group exists here, so any communication would fail differently."""
    topo = RailTopology(num_nodes=1, gpus_per_node=2)
    with pytest.raises(
        ValueError, match=r"cannot run 1 nodes x 2 GPUs with the fake DeepEP .*inside one node"
    ):
        build_exchange(
            topo,
            virtual_rank_groups(topo, 0),
            backend="deepep",
            deepep_api=fake_deepep_api(topo.gpus_per_node),
            num_experts=8,
            topk=2,
            hidden_size=256,
            hidden_dtype=torch.float32,
        )


def test_use_fake_deepep_is_the_process_hook_and_auto_ignores_it():
    """Inside ``use_fake_deepep`` backend 'deepep' builds on the fake (its limits name it), 'auto'
    still never picks it; after the block the wheel is what 'deepep' loads again."""
    topo = RailTopology(num_nodes=1, gpus_per_node=2)
    kwargs = dict(num_experts=8, topk=2, hidden_size=256, hidden_dtype=torch.bfloat16)
    groups = virtual_rank_groups(topo, 0)
    with use_fake_deepep():
        with pytest.raises(ValueError, match=r"with the fake DeepEP \(2 GPUs per node\)"):
            build_exchange(topo, groups, backend="deepep", **kwargs)
        assert type(build_exchange(topo, groups, backend="auto", **kwargs)) is TorchDistExchange
    try:
        import deep_ep  # noqa: F401
    except Exception:  # noqa: BLE001
        with pytest.raises(ImportError, match=r"needs DeepEP 2.1"):
            build_exchange(topo, groups, backend="deepep", **kwargs)
    else:
        with pytest.raises(ValueError, match=r"cannot run 1 nodes x 2 GPUs with DeepEP:"):
            build_exchange(topo, groups, backend="deepep", **kwargs)


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"backend": "nccl"}, r"backend='nccl' must be 'torch', 'deepep' or 'auto'"),
        # The fake is a testing hook, not a user option: the removed key says what replaced it.
        (
            {"backend": "deepep", "deepep_buffer": "fake"},
            r"deepep_buffer='fake' was removed: .*testing hook, not a user option "
            r"\(megatron_railwave.testing.deepep_fake: use_fake_deepep\(\)",
        ),
        (
            {"backend": "deepep", "deepep_num_sms": 21},
            r"deepep_num_sms=21 must be an even integer >= 2",
        ),
    ],
)
def test_config_backend_fields_rejected(fields, expected):
    with pytest.raises(ValueError, match=expected):
        RailWaveConfig.from_dict(fields)


def test_config_backend_defaults_to_torch_and_flag_overrides():
    assert RailWaveConfig().backend == "torch"
    parser = add_railwave_args(argparse.ArgumentParser())
    cfg = config_from_args(parser.parse_args(["--railwave-backend", "deepep"]))
    assert cfg.backend == "deepep" and not hasattr(cfg, "deepep_buffer")
    with pytest.raises(SystemExit):
        parser.parse_args(["--railwave-backend", "nccl"])


def test_deepep_refuses_a_placement_whose_group_order_is_not_railwave_order():
    # SLURM cyclic over 2 hosts x 2 GPUs: EP [0, 2] on host a, [1, 3] on host b, global rank = EP
    # rank. Railwave rank -> global rank (0, 2, 1, 3); torch orders the EP group by global rank, so
    # DeepEP's rank 1 would be global rank 1 (host b) where the exchange means railwave rank 1
    # (global 2, host a): tokens would reach the wrong ranks. Old code built the exchange anyway.
    from megatron_railwave.exchange.groups import rank_groups
    from megatron_railwave.exchange.placement import RankFacts, place_ranks

    layout = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    facts = [
        RankFacts(
            ep_rank=e,
            global_rank=e,
            host=h,
            host_id=hash(h) % 2**62,
            local_rank=g,
            gpu=g,
            fingerprint=(),
        )
        for e, (h, g) in enumerate(layout)
    ]
    placement = place_ranks(facts, gpus_per_node=2)
    topo = RailTopology(num_nodes=2, gpus_per_node=2)
    torch_order = tuple(
        sorted(placement.global_rank_of_railwave).index(r)
        for r in placement.global_rank_of_railwave
    )
    assert torch_order == (0, 2, 1, 3)
    groups = rank_groups(topo, 0, placement=placement, group_ranks=(torch_order, None, None))
    with pytest.raises(
        ValueError, match=r"backend 'deepep': the EP group's rank order is not node by node"
    ):
        build_exchange(
            topo,
            groups,
            backend="deepep",
            deepep_api=fake_deepep_api(topo.gpus_per_node),
            num_experts=8,
            topk=2,
            hidden_size=256,
            hidden_dtype=torch.bfloat16,
        )


def test_shared_buffer_is_explicitly_destroyed_before_the_group(monkeypatch):
    """The Buffer is built with explicitly_destroy=True where the class takes it and
    destroy_deepep_buffers() destroys it (the hardware check calls it before
    destroy_process_group); a Buffer class without the argument is built without it and left to
    its destructor. Fake Buffers: deep_ep is not installed here (not yet run on hardware)."""
    from types import SimpleNamespace

    from megatron_railwave.exchange import deepep, destroy_deepep_buffers

    made = []

    class WithDestroy:
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, explicitly_destroy=False):
            self.explicitly_destroy, self.destroyed = explicitly_destroy, False
            made.append(self)

        def destroy(self):
            assert self.explicitly_destroy
            self.destroyed = True

    class Legacy:
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0):
            made.append(self)

    monkeypatch.setattr(deepep, "_BUFFERS", {})
    groups = SimpleNamespace(ep=SimpleNamespace(handle=object()))
    new = deepep._shared_buffer(SimpleNamespace(Buffer=WithDestroy), groups, 1024, 2048)
    assert (
        new.explicitly_destroy
        and deepep._shared_buffer(SimpleNamespace(Buffer=WithDestroy), groups, 1024, 2048) is new
    )  # shared
    old = deepep._shared_buffer(SimpleNamespace(Buffer=Legacy), groups, 1024, 2048)
    assert made == [new, old]
    assert destroy_deepep_buffers() == 1
    assert new.destroyed and deepep._BUFFERS == {}
    assert destroy_deepep_buffers() == 0


def test_dispatch_and_combine_row_widths_fit_deepep_internode_kernels_at_glm_size():
    """DeepEP 2.1 (dd758ca) internode: a dispatch row must be a multiple of 16 bytes
    (csrc/legacy/buffer.hpp) and, with its 8-byte SourceMeta and K top-k ints and floats rounded
    up to 16, fit a 16 KiB TMA buffer with 8 bytes to spare (internode.cu); hidden_int4 % 32 == 0
    only in combine's TMA path, whose rows are H wide. H = 4096 bf16, K = 8:
    dispatch 4096 x 2 + 16 = 8208 B = 513 int4 (no padding); per token align16(8208 + 8 + 32 +
    32) = 8288 <= 16376; combine 8192 B = 512 int4, 512 % 32 = 0."""
    row = dispatch_row_bytes(4096, torch.bfloat16)
    assert row == 8208 and row % 16 == 0 and row // 16 == 513
    assert -(-(row + 8 + 8 * 4 + 8 * 4) // 16) * 16 + 8 <= 16384
    assert (4096 * 2 // 16) % 32 == 0
    assert _problems(4, 8) == []
    # H = 4104 would break combine's TMA path (8208 B rows): named, with the fix.
    assert any("multiple of 512 bytes" in p for p in _problems(4, 8, hidden_size=4104))
