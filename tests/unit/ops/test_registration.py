"""torch.library registration: schemas, fake implementations (torch.compile traces through the
ops) and the autograd of segment_sum, checked with torch.library.opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave import ops
from megatron_railwave.ops import reference
from megatron_railwave.ops._library import SCHEMAS
from tests.helpers.ops_cases import random_routing_map, same_bits


def _samples(compiled):
    gen = torch.Generator().manual_seed(0)
    routing = random_routing_map(16, 32, 4, gen)
    token, node, _, counts = compiled.records_from_routing(routing, 2, 4)
    payload = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    probs = torch.rand(16, 3, generator=gen)
    packed = compiled.pack_rows([payload, probs], [token.clamp(min=0), token.clamp(min=0)])
    deficit = torch.tensor([[0, 2, 2, 5], [1, 1, 4, 4]])
    return [
        (compiled.records_from_routing.default, (routing, 2, 4)),
        (
            compiled.assign_egress.default,
            (
                node,
                1,
                counts.sum(1),
                torch.tensor([3, 1]),
                torch.tensor([0, 2]),
                deficit,
                torch.tensor([-1, 0]),
            ),
        ),
        (
            compiled.records_per_node_rail.default,
            (node, node.clamp(min=0), torch.tensor([0, 1, 2, 3]), 2, 4),
        ),
        (compiled.pack_rows.default, ([payload, probs], [token.clamp(min=0), token.clamp(min=0)])),
        (compiled.unpack_rows.default, (packed, [16, 12], None, -1)),
        (
            compiled.unpack_rows.default,
            (packed, [16, 12], torch.randperm(40, generator=gen)[:32], 40),
        ),
        (
            compiled.rail_plan.default,
            (
                torch.tensor([[[2, 1], [3, 0]], [[1, 1], [0, 4]]]),
                torch.tensor([[[True, True], [True, True]], [[True, False], [True, True]]]),
                True,
                1,
            ),
        ),
        (
            compiled.rank_schedule.default,
            (
                torch.tensor([[[2, 1], [3, 0]], [[1, 1], [0, 4]]]),
                torch.tensor([[[2, 1], [2, 1]], [[1, 1], [2, 2]]]),
                torch.tensor(
                    [[[[2, 0], [0, 1]], [[2, 1], [0, 0]]], [[[1, 0], [0, 1]], [[0, 0], [0, 4]]]]
                ),
                torch.tensor([[-1, 0], [0, -1]]),
                torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]),
                1,
                1,
                8,
                [0],
                [2],
                [1, 3],
            ),
        ),
        (
            compiled.segment_sum.default,
            (
                torch.randn(10, 4, generator=gen, requires_grad=True),
                torch.randint(0, 3, (10,), generator=gen),
                3,
                torch.bfloat16,
            ),
        ),
    ]


# aot_dispatch_dynamic is left out here (seconds per op); test_torch_compile_traces_through_the_ops
# covers tracing.
_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def test_opcheck_every_op(compiled):
    for op, args in _samples(compiled):
        torch.library.opcheck(op, args, test_utils=_CHECKS)


def test_torch_compile_traces_through_the_ops(compiled):
    gen = torch.Generator().manual_seed(1)
    routing = random_routing_map(32, 64, 6, gen)
    payload = torch.randn(32, 16, generator=gen).to(torch.bfloat16)

    def layer(routing_TE, payload_TH):
        token, node, mask, counts = ops.records_from_routing(routing_TE, 4, 4)
        packed = ops.pack_rows([payload_TH, mask], [token.clamp(min=0), None])
        rows, masks = ops.unpack_rows(packed, [(torch.bfloat16, (16,)), (torch.int64, ())])
        summed = ops.segment_sum(rows, node.clamp(min=0), 4, out_dtype=torch.float32)
        return summed, masks, counts

    eager = layer(routing, payload)
    traced = torch.compile(layer, backend="aot_eager", fullgraph=True)(routing, payload)
    for a, b in zip(eager, traced, strict=True):
        assert same_bits(a, b)
    # and the eager result is the reference's
    token, node, mask, _ = reference.records_from_routing(routing, 4, 4)
    want = reference.segment_sum(
        payload[token.clamp(min=0)], node.clamp(min=0), 4, out_dtype=torch.float32
    )
    assert same_bits(eager[0], want)


_DATA_OPS = (
    "records_from_routing",
    "assign_egress",
    "records_per_node_rail",
    "pack_rows",
    "unpack_rows",
    "segment_sum",
)
_HOST_OPS = ("rail_plan", "flow_plan", "rank_schedule")
_RETIRED_OPS = ("arrival_copies", "path_estimates")
"""The offline path model's ops, retired with it: neither defined nor wrapped any more."""


def test_retired_ops_are_gone():
    for op in _RETIRED_OPS:
        assert not any(schema.startswith(f"{op}(") for schema in SCHEMAS), op
        assert not hasattr(ops, op), op
        with pytest.raises((AttributeError, RuntimeError)):
            getattr(torch.ops.railwave, op)


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"railwave::{op}", key)


def test_forcing_the_reference_takes_the_compiled_kernels_out_of_the_dispatcher(compiled):
    # The reference is every data op's CompositeExplicitAutograd kernel: the dispatcher runs it
    # wherever no compiled kernel is registered for the tensors' key. Forcing the reference drops
    # the compiled kernels; unforcing registers them again.
    for op in _DATA_OPS:
        assert _has_kernel(op, "CompositeExplicitAutograd"), op
    for op in _HOST_OPS:
        assert not _has_kernel(op, "CompositeExplicitAutograd"), op
    assert all(_has_kernel(op, "CPU") for op in _DATA_OPS + _HOST_OPS)
    old = ops.set_forced_reference(True)
    try:
        assert not any(_has_kernel(op, "CPU") for op in _DATA_OPS + _HOST_OPS)
        assert not ops.compiled_for(torch.device("cpu"))
        assert (
            ops.rail_plan(
                torch.zeros(1, 1, 1, dtype=torch.int64),
                torch.ones(1, 1, 1, dtype=torch.bool),
                balanced=True,
                phase=0,
            )
            is None
        )
    finally:
        ops.set_forced_reference(old)
    assert all(_has_kernel(op, "CPU") for op in _DATA_OPS + _HOST_OPS)
    assert ops.compiled_for(torch.device("cpu"))


def test_the_reference_kernels_give_the_references_bits(compiled):
    # Through torch.ops.railwave with the compiled kernels out: the public ops (unpack_rows' byte
    # parts viewed as their dtypes, segment_sum's registered autograd) equal ops.reference.
    gen = torch.Generator().manual_seed(2)
    routing = random_routing_map(24, 16, 3, gen)
    payload = torch.randn(24, 5, generator=gen).to(torch.bfloat16)
    probs = torch.rand(24, 3, generator=gen)
    specs = [(torch.bfloat16, (5,)), (torch.float32, (3,)), (torch.int64, ())]
    values = torch.randn(24, 4, generator=gen, requires_grad=True)
    ids = torch.randint(-1, 7, (24,), generator=gen)
    bounds = dict(
        owner_gpu=1,
        keep_N=torch.tensor([3, 1]),
        surplus_lo_N=torch.tensor([0, 2]),
        deficit_hi_NG=torch.tensor([[0, 2, 2, 5], [1, 1, 4, 4]]),
        wave_N=torch.tensor([-1, 0]),
    )

    def run(impl):
        token, node, mask, counts = impl.records_from_routing(routing, 2, 4)
        egress, wave = impl.assign_egress(node, counts_N=counts.sum(1), **bounds)
        per_rail = impl.records_per_node_rail(node, egress, torch.tensor([0, 1, 2, 3]), 2, 4)
        index = token.clamp(min=0)
        packed = impl.pack_rows([payload, probs, mask], [index, index, None])
        parts = impl.unpack_rows(packed, specs)
        scattered = impl.unpack_rows(
            packed,
            specs,
            row_index=torch.randperm(60, generator=gen.manual_seed(3))[:48],
            num_rows=60,
        )
        summed = impl.segment_sum(values, ids, 7, out_dtype=torch.bfloat16, max_segment_len=24)
        (grad,) = torch.autograd.grad(summed.float().square().sum(), values)
        return [
            token,
            node,
            mask,
            counts,
            egress,
            wave,
            per_rail,
            packed,
            *parts,
            *scattered,
            summed,
            grad,
        ]

    old = ops.set_forced_reference(True)
    try:
        got = run(ops)
    finally:
        ops.set_forced_reference(old)
    want = run(reference)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert same_bits(a.detach(), b.detach())


def test_opcheck_the_reference_kernels(compiled):
    samples = [(op, args) for op, args in _samples(compiled) if op.__name__[:-8] in _DATA_OPS]
    assert {op.__name__[:-8] for op, _ in samples} == set(_DATA_OPS)
    old = ops.set_forced_reference(True)
    try:
        for op, args in samples:
            torch.library.opcheck(op, args, test_utils=_CHECKS)
    finally:
        ops.set_forced_reference(old)
