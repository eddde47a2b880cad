"""pack_rows / unpack_rows: the compiled ops equal the reference bitwise, round trips, errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine may lack it: skip, not a collection error
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_railwave import ops
from megatron_railwave.ops import reference
from tests.helpers.ops_cases import same_bits

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)


def _random_tensor(
    rows: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    # Random bytes: every bit pattern (NaNs, negative zeros) must survive the copies.
    raw = torch.randint(0, 256, (rows, *shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw[..., 0] & 1).bool()
    return raw.view(dtype).reshape(rows, *shape)


def test_pack_rows_hand_layout(compiled):
    # Row i = [payload bf16 x2 of token idx[i]] [prob fp32 of token idx[i]] [meta int16 of record
    # i]: 4 + 4 + 2 = 10 bytes per row.
    payload = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    prob = torch.tensor([0.5, 0.25, 0.125])
    meta = torch.tensor([7, 8], dtype=torch.int16)
    idx = torch.tensor([2, 0])
    packed = ops.pack_rows([payload, prob, meta], [idx, idx, None])
    assert packed.shape == (2, 10) and packed.dtype == torch.uint8
    assert same_bits(packed[0, :4].clone().view(torch.bfloat16), payload[2])
    assert same_bits(packed[1, 4:8].clone().view(torch.float32), prob[0:1])
    assert packed[:, 8:].contiguous().view(torch.int16).flatten().tolist() == [7, 8]
    specs = [(torch.bfloat16, (2,)), (torch.float32, ()), (torch.int16, ())]
    back = ops.unpack_rows(packed, specs, row_index=torch.tensor([1, 3]), num_rows=4)
    assert back[2].tolist() == [0, 7, 0, 8]  # rows 0 and 2 are not written: zero
    assert same_bits(back[0][3], payload[0])


@settings(max_examples=80, deadline=None)
@given(
    num_rows=st.integers(0, 12),
    parts=st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 5), max_size=2),
            st.booleans(),
            st.integers(1, 6),
        ),
        min_size=1,
        max_size=11,
    ),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_compiled_equal_reference(compiled, num_rows, parts, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors, index, specs = [], [], []
    for dtype, shape, gathered, source_rows in parts:
        shape = tuple(shape)
        if gathered:
            tensors.append(_random_tensor(source_rows, shape, dtype, gen))
            index.append(
                torch.randint(0, source_rows, (num_rows,), generator=gen)
            )  # repeats allowed
        else:
            tensors.append(_random_tensor(num_rows, shape, dtype, gen))
            index.append(None)
        specs.append((dtype, shape))
    packed = ops.pack_rows(tensors, index)
    assert same_bits(packed, reference.pack_rows(tensors, index))
    assert packed.shape == (num_rows, ops.row_bytes(specs))

    for got, want in zip(
        ops.unpack_rows(packed, specs), reference.unpack_rows(packed, specs), strict=True
    ):
        assert same_bits(got, want)
    out_rows = num_rows + int(torch.randint(0, 4, (1,), generator=gen))
    scatter = torch.randperm(out_rows, generator=gen)[:num_rows]
    got = ops.unpack_rows(packed, specs, row_index=scatter, num_rows=out_rows)
    want = reference.unpack_rows(packed, specs, row_index=scatter, num_rows=out_rows)
    for g, w in zip(got, want, strict=True):
        assert same_bits(g, w)


def test_pack_rows_takes_non_contiguous_tensors(compiled):
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    strided = base[:, ::2]  # [6, 5], not contiguous
    idx = torch.tensor([5, 1, 1])
    assert same_bits(ops.pack_rows([strided], [idx]), reference.pack_rows([strided], [idx]))


def test_pack_rows_mismatched_rows_raise(compiled):
    with pytest.raises(ValueError, match="tensors give 3 and 2 rows"):
        ops.pack_rows([torch.zeros(2, 1), torch.zeros(3, 1)], [None, None])
    with pytest.raises(ValueError, match="tensors give"):
        reference.pack_rows([torch.zeros(2, 1), torch.zeros(3, 1)], [None, None])


def test_pack_rows_index_out_of_range_raises(compiled):
    with pytest.raises(
        ValueError, match=r"row_index\[0\]\[1\] = 4 is out of range for a tensor of 3 rows"
    ):
        ops.pack_rows([torch.zeros(3, 2)], [torch.tensor([0, 4])])


def test_unpack_rows_errors(compiled):
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rows have 8 bytes, specs need 4"):
        ops.unpack_rows(packed, [(torch.float32, ())])
    with pytest.raises(ValueError, match="num_rows is required"):
        ops.unpack_rows(packed, [(torch.float64, ())], row_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="row_index must be distinct; row 1 appears twice"):
        ops.unpack_rows(packed, [(torch.float64, ())], row_index=torch.tensor([1, 1]), num_rows=3)
    with pytest.raises(ValueError, match="out of range for 2 rows"):
        ops.unpack_rows(packed, [(torch.float64, ())], row_index=torch.tensor([0, 2]), num_rows=2)


@pytest.mark.parametrize("num_rows", [0, 1, 2])
def test_reference_round_trip_with_unaligned_and_empty_parts(num_rows):
    # Regression: the reference failed on 0 rows (reshape(0, -1)), on 0 or 1 rows when a part's byte
    # offset is not a multiple of its element size (.contiguous() kept the offset) and on zero-width
    # parts (view(dtype) of a [n, 0] byte tensor).
    specs = [(torch.uint8, (3,)), (torch.float32, (1,)), (torch.float64, (0, 2)), (torch.int16, ())]
    tensors = [torch.full((num_rows, *shape), 7, dtype=dtype) for dtype, shape in specs]
    packed = reference.pack_rows(tensors, [None] * len(specs))
    assert packed.shape == (num_rows, 9)
    for original, back in zip(tensors, reference.unpack_rows(packed, specs), strict=True):
        assert same_bits(original, back)
    scattered = reference.unpack_rows(
        packed, specs, row_index=torch.arange(num_rows), num_rows=num_rows + 1
    )
    assert scattered[1].shape == (num_rows + 1, 1) and scattered[1][num_rows].item() == 0


def _dispatch_rows_8336(n: int, tokens: int, seed: int):
    """The real dispatch row at GLM size (schedule.wire, H = 4096, E_node = 32): payload bf16
    [4096] and probs fp32 [32] gathered by token, meta int32 [4] per record (2 + 1 routing word
    + 1 pad): 8192 + 128 + 16 = 8336 bytes, a multiple of 16 (the CUDA kernel's 16-byte vector
    path)."""
    gen = torch.Generator().manual_seed(seed)
    payload = _random_tensor(tokens, (4096,), torch.bfloat16, gen)
    probs = _random_tensor(tokens, (32,), torch.float32, gen)
    meta = _random_tensor(n, (4,), torch.int32, gen)
    token = torch.randint(0, tokens, (n,), generator=gen)
    return [payload, probs, meta], [token, token, None], gen


def test_pack_unpack_16_byte_aligned_8336_byte_rows_twin_equal_reference(compiled):
    tensors, index, gen = _dispatch_rows_8336(n=301, tokens=128, seed=3)
    specs = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
    packed = ops.pack_rows(tensors, index)
    assert packed.shape == (301, 8336) and ops.row_bytes(specs) % 16 == 0
    assert packed.data_ptr() % 16 == 0 and packed.stride(0) % 16 == 0  # every row 16-B aligned
    assert same_bits(packed, reference.pack_rows(tensors, index))
    for got, want in zip(
        ops.unpack_rows(packed, specs), reference.unpack_rows(packed, specs), strict=True
    ):
        assert same_bits(got, want)
    for out_rows in (301, 301 + 23):  # a full permutation (no zero fill) and a partial scatter
        scatter = torch.randperm(out_rows, generator=gen)[:301]
        got = ops.unpack_rows(packed, specs, row_index=scatter, num_rows=out_rows)
        want = reference.unpack_rows(packed, specs, row_index=scatter, num_rows=out_rows)
        for g, w, t, i in zip(got, want, tensors, index, strict=True):
            assert same_bits(g, w)
            rows = t if i is None else t.index_select(0, i)
            assert same_bits(g.index_select(0, scatter), rows)


class _ZeroFills(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten calls that zero-fill a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("zeros", "new_zeros", "zero_", "fill_", "zeros_like"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_unpack_scatter_of_a_full_permutation_is_not_zero_filled():
    # 5 rows scattered to 5 outputs by a permutation: every output row is written, so the
    # reference (and the twins, which follow it) allocate without a fill; 5 rows into 7 outputs
    # leave 2 rows zero, and those are filled.
    specs = [(torch.float32, (3,)), (torch.int32, ())]
    packed = torch.randint(0, 256, (5, ops.row_bytes(specs)), dtype=torch.uint8)
    perm = torch.tensor([3, 0, 4, 1, 2])
    with _ZeroFills() as full:
        got = reference.unpack_rows(packed, specs, row_index=perm, num_rows=5)
    assert full.count == 0
    plain = reference.unpack_rows(packed, specs)
    for g, p in zip(got, plain, strict=True):
        assert same_bits(g.index_select(0, perm), p)
    with _ZeroFills() as partial:
        got = reference.unpack_rows(packed, specs, row_index=perm, num_rows=7)
    assert partial.count == len(specs)
    assert not got[0][torch.tensor([5, 6])].any() and not got[1][torch.tensor([5, 6])].any()
