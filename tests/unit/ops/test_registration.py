"""torch.library registration: schemas, fake implementations (torch.compile traces through the
ops) and the autograd of segment_sum, checked with torch.library.opcheck and torch.compile."""

from __future__ import annotations

import torch

from megatron_railwave import ops
from megatron_railwave.ops import reference
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
                0,
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
