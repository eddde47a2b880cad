"""records_from_routing: the compiled op equals the reference bitwise, and both give the hand
case."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine may lack it: skip, not a collection error
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_railwave import ops
from megatron_railwave.ops import reference
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import target_masks
from tests.helpers.ops_cases import random_routing_map

# Hand case: N = 2 nodes x G = 2 GPUs, 2 experts per GPU (E = 8): expert e is on node e // 4,
# GPU (e % 4) // 2.
#   token 0: experts 1, 6   -> node 0 mask 1 (GPU 0), node 1 mask 2 (GPU 1)
#   token 1: experts 2, 3   -> node 0 mask 2
#   token 2: experts 0, 7   -> node 0 mask 1, node 1 mask 2
#   token 3: experts 4, 6   -> node 1 mask 3
# Canonical order (node, mask, token): (0,1,t0) (0,1,t2) (0,2,t1) (1,2,t0) (1,2,t2) (1,3,t3), then
# two padding slots of the C = 8 capacity.
HAND_EXPERTS = [[1, 6], [2, 3], [0, 7], [4, 6]]


def _hand_map() -> torch.Tensor:
    routing = torch.zeros(4, 8, dtype=torch.bool)
    for token, experts in enumerate(HAND_EXPERTS):
        routing[token, experts] = True
    return routing


@pytest.mark.parametrize("impl", ["reference", "compiled"])
def test_records_from_routing_hand_case(impl, request):
    fn = reference.records_from_routing
    if impl == "compiled":
        fn = request.getfixturevalue("compiled").records_from_routing
    token, node, mask, counts = fn(_hand_map(), 2, 2)
    assert token.tolist() == [0, 2, 1, 0, 2, 3, -1, -1]
    assert node.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    assert mask.tolist() == [1, 1, 2, 2, 2, 3, 0, 0]
    assert counts.tolist() == [[0, 2, 1, 0], [0, 0, 2, 1]]


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    num_nodes=st.integers(1, 4),
    gpus_per_node=st.integers(1, 8),
    experts_per_gpu=st.integers(1, 3),
    topk=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_records_from_routing_compiled_equals_reference(
    compiled, num_tokens, num_nodes, gpus_per_node, experts_per_gpu, topk, seed
):
    num_experts = num_nodes * gpus_per_node * experts_per_gpu
    routing = random_routing_map(num_tokens, num_experts, topk, torch.Generator().manual_seed(seed))
    got = ops.records_from_routing(routing, num_nodes, gpus_per_node)
    want = reference.records_from_routing(routing, num_nodes, gpus_per_node)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.int64
        assert torch.equal(g, w)
    # The masks are the traffic layer's target masks of the same (token, node).
    token, node, mask, counts = got
    valid = node >= 0
    topo = RailTopology(num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    masks_TN = target_masks(routing, topo)
    assert torch.equal(masks_TN[token[valid], node[valid]], mask[valid])
    assert int(valid.sum()) == int(counts.sum()) == int((masks_TN > 0).sum())


def test_records_from_routing_accepts_a_transposed_view(compiled):
    routing = random_routing_map(16, 32, 4, torch.Generator().manual_seed(3))
    strided = routing.t().contiguous().t()  # same values, column-major strides
    for g, w in zip(
        ops.records_from_routing(strided, 2, 4), reference.records_from_routing(routing, 2, 4)
    ):
        assert torch.equal(g, w)


@pytest.mark.parametrize("impl", ["reference", "compiled"])
def test_records_from_routing_uneven_experts_raise(impl, request):
    fn = reference.records_from_routing
    if impl == "compiled":
        fn = request.getfixturevalue("compiled").records_from_routing
    with pytest.raises(ValueError, match="do not split evenly"):
        fn(torch.zeros(4, 10, dtype=torch.bool), 2, 2)


def test_records_from_routing_compiled_rejects_bad_arguments(compiled):
    with pytest.raises(ValueError, match="routing_map must be bool"):
        compiled.records_from_routing(torch.zeros(4, 8, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="gpus_per_node must be in 1..8"):
        compiled.records_from_routing(torch.zeros(4, 18, dtype=torch.bool), 1, 9)
