"""segment_sum: fixed order (hand case), compiled == reference bitwise over dtypes and shapes,
autograd, errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine may lack it: skip, not a collection error
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_railwave import ops
from megatron_railwave.ops import reference
from tests.helpers.ops_cases import same_bits

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def test_segment_sum_adds_in_row_order(compiled):
    # Segment 0 gets rows 0, 2, 3 = 1e8, 1, -1e8 in that order: fp32 (1e8 + 1) rounds back to 1e8,
    # so the sum is exactly 0; any other order ((1e8 - 1e8) + 1) gives 1. Segment 1: row 1 only.
    values = torch.tensor([[1e8], [5.0], [1.0], [-1e8]])
    ids = torch.tensor([0, 1, 0, 0])
    for impl in (ops, reference):
        assert impl.segment_sum(values, ids, 3).flatten().tolist() == [0.0, 5.0, 0.0]


def test_segment_sum_accumulates_in_fp32_and_casts_once(compiled):
    # bf16 has 8 significant bits: 256 + 1 + 1 = 258 is exact in fp32 and in bf16, while adding in
    # bf16 would round 256 + 1 back to 256 twice.
    values = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    out = ops.segment_sum(values, torch.tensor([0, 0, 0]), 1)
    assert out.dtype == torch.bfloat16 and out.item() == 258.0


def _values(
    n: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    # Magnitudes spread over many binades, so a different order or a fused add changes the bits.
    mantissa = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    scale = torch.exp2(torch.randint(-12, 12, (n, *shape), generator=gen).to(torch.float64))
    return (mantissa * scale).to(dtype)


@settings(max_examples=120, deadline=None)
@given(
    num_rows=st.integers(0, 40),
    num_segments=st.integers(1, 9),
    shape=st.lists(st.integers(0, 5), max_size=2),
    dtype=st.sampled_from(FLOATS),
    out_dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**16),
)
def test_segment_sum_compiled_equals_reference(
    compiled, num_rows, num_segments, shape, dtype, out_dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    values = _values(num_rows, tuple(shape), dtype, gen)
    ids = torch.randint(0, num_segments, (num_rows,), generator=gen)
    got = ops.segment_sum(values, ids, num_segments, out_dtype=out_dtype)
    want = reference.segment_sum(values, ids, num_segments, out_dtype=out_dtype)
    assert same_bits(got, want)


def test_segment_sum_special_values_match_reference(compiled):
    # inf, -inf, subnormals, overflow to inf in fp16, values that round to even in bf16/fp16.
    values = torch.tensor(
        [
            [float("inf"), 1e-40, 65504.0, 1.0 + 2**-8],
            [1.0, 1e-40, 16.0, 2**-9],
            [-float("inf"), -3e-45, 1.0, 0.0],
        ]
    )
    ids = torch.tensor([0, 1, 1])
    for out_dtype in FLOATS:
        got = ops.segment_sum(values, ids, 2, out_dtype=out_dtype)
        assert same_bits(got, reference.segment_sum(values, ids, 2, out_dtype=out_dtype)), out_dtype


@pytest.mark.parametrize(
    "dtype,out_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_segment_sum_backward_equals_reference(compiled, dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    values = _values(12, (3,), dtype, gen)
    ids = torch.randint(0, 4, (12,), generator=gen)
    grad = _values(4, (3,), out_dtype, gen)
    grads = []
    for impl in (ops, reference):
        v = values.clone().requires_grad_(True)
        impl.segment_sum(v, ids, 4, out_dtype=out_dtype).backward(grad)
        grads.append(v.grad)
    assert same_bits(grads[0], grads[1])


def test_segment_sum_leaves_out_of_range_ids_out_like_the_cuda_kernel(compiled):
    # Rows 1 (id 3 = S) and 2 (id -1) are left out by the CPU twin and the reference, as the CUDA
    # kernel leaves them out (test_gpu.py): fixed-capacity padding takes such an id.
    values = torch.tensor([[1.0], [5.0], [7.0], [2.0]])
    ids = torch.tensor([0, 3, -1, 1])
    for impl in (ops, reference):
        assert impl.segment_sum(values, ids, 3).flatten().tolist() == [1.0, 2.0, 0.0]


@pytest.mark.parametrize("impl", ["compiled", "reference"])
def test_segment_sum_backward_gives_left_out_rows_zero_gradient(compiled, impl):
    # The old backward index-selected the gradient at every id: an IndexError here, a device
    # assert on CUDA, for the rows the forward left out.
    fn = ops.segment_sum if impl == "compiled" else reference.segment_sum
    values = torch.tensor([[1.0], [5.0], [7.0], [2.0]], requires_grad=True)
    fn(values, torch.tensor([0, 3, -1, 1]), 3).backward(torch.tensor([[10.0], [20.0], [30.0]]))
    assert values.grad.flatten().tolist() == [10.0, 0.0, 0.0, 20.0]


def test_segment_sum_other_dtypes_take_the_reference(compiled):
    values = torch.randn(4, 2).to(torch.float8_e4m3fn)
    ids = torch.tensor([0, 1, 0, 1])
    assert same_bits(
        ops.segment_sum(values, ids, 2, out_dtype=torch.float32),
        reference.segment_sum(values, ids, 2, out_dtype=torch.float32),
    )
