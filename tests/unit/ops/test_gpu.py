"""CUDA kernels against their CPU twins, bitwise, each run twice (determinism). Needs a GPU and
an extension built with CUDA (scripts/gpu_check_ops.sh builds it on the device machine).

Letters: T tokens, E experts, N nodes, G GPUs per node, n rows, S segments, W row width.
"""

from __future__ import annotations

import pytest
import torch

from megatron_railwave import ops
from megatron_railwave.ops import reference
from megatron_railwave.planner import build_plan
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts
from tests.helpers.ops_cases import egress_inputs, random_routing_map, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _twice_on_cuda(fn, *cpu_args):
    """fn on CPU, and twice on CUDA (all outputs back on CPU); asserts the two CUDA runs agree."""

    def to(x, device):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, (list, tuple)):
            return type(x)(to(v, device) for v in x)
        return x

    def flat(out):
        return [o.cpu() for o in out] if isinstance(out, (list, tuple)) else [out.cpu()]

    cpu = flat(fn(*cpu_args))
    first = flat(fn(*to(cpu_args, "cuda")))
    second = flat(fn(*to(cpu_args, "cuda")))
    torch.cuda.synchronize()
    for a, b in zip(first, second, strict=True):
        assert same_bits(a, b), "two CUDA runs differ"
    return cpu, first


@pytest.mark.parametrize(
    "num_nodes,gpus_per_node,num_tokens,experts,topk",
    [
        (4, 8, 4096, 128, 8),
        (1, 1, 5, 3, 2),
        (3, 5, 777, 30, 4),
        (2, 8, 1000, 64, 6),
        (8, 2, 333, 32, 9),
        (2, 3, 0, 12, 2),
    ],
)
def test_records_and_egress_cuda_equal_cpu(
    cuda_ops, num_nodes, gpus_per_node, num_tokens, experts, topk
):
    # RailBalance bounds from a real plan of every rank's routing (as the exchange and ops-bench
    # pass them): random bounds need not agree with each other, and then the egress is not a GPU.
    topo = RailTopology(num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    gen = torch.Generator().manual_seed(num_tokens)
    maps = [random_routing_map(num_tokens, experts, topk, gen) for _ in range(topo.world_size)]
    plan = build_plan(DemandCounts.from_routing_maps(maps, topo), topo, "joint")
    for rank in sorted({0, topo.world_size - 1}):
        cpu, gpu = _twice_on_cuda(ops.records_from_routing, maps[rank], num_nodes, gpus_per_node)
        for a, b in zip(cpu, gpu, strict=True):
            assert same_bits(a, b)
        node = cpu[1]
        bounds = egress_inputs(plan, rank)
        args = (
            node,
            bounds["owner_gpu"],
            bounds["counts_N"],
            bounds["keep_N"],
            bounds["surplus_lo_N"],
            bounds["deficit_hi_NG"],
            bounds["wave_N"],
        )

        def egress(n, g, c, k, lo, hi, w):
            return ops.assign_egress(
                n, owner_gpu=g, counts_N=c, keep_N=k, surplus_lo_N=lo, deficit_hi_NG=hi, wave_N=w
            )

        cpu_e, gpu_e = _twice_on_cuda(egress, *args)
        for a, b in zip(cpu_e, gpu_e, strict=True):
            assert same_bits(a, b)
        valid = node >= 0
        assert bool(
            ((cpu_e[0] >= 0) & (cpu_e[0] < gpus_per_node))[valid].all()
        )  # a real plan: real GPUs
        rails = torch.randperm(gpus_per_node, generator=gen)
        cpu_l, gpu_l = _twice_on_cuda(
            ops.records_per_node_rail, node, cpu_e[0], rails, num_nodes, gpus_per_node
        )
        assert same_bits(cpu_l[0], gpu_l[0])
        assert int(cpu_l[0].sum()) == int(valid.sum())


def test_records_per_node_rail_cuda_leaves_a_bad_egress_out_like_cpu(cuda_ops):
    # The same case as test_assign.py's CPU test: CPU and CUDA both skip the out-of-range records.
    node = torch.tensor([0, 0, 1, 1, 1, -1])
    egress = torch.tensor([0, 3, 2, -2, 1, -1])
    rail_of_gpu = torch.tensor([0, 1, 7])
    cpu, gpu = _twice_on_cuda(ops.records_per_node_rail, node, egress, rail_of_gpu, 2, 3)
    assert same_bits(cpu[0], gpu[0]) and cpu[0].tolist() == [[1, 0, 0], [0, 1, 0]]


def _random_bytes(rows, width, gen):
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("case", ["glm", "dispatch_8336", "odd_widths", "many_parts", "empty"])
def test_pack_unpack_cuda_equal_cpu(cuda_ops, case):
    gen = torch.Generator().manual_seed(7)
    if (
        case == "glm"
    ):  # payload bf16 [T, H] and probs fp32 [T, K] gathered by token, int64 metadata per record
        n = 14000
        tensors = [
            torch.randn(4096, 4096, generator=gen).to(torch.bfloat16),
            torch.rand(4096, 8, generator=gen),
            torch.randint(0, 99, (n, 3), generator=gen),
        ]
        token = torch.randint(0, 4096, (n,), generator=gen)
        index = [token, token, None]
    elif case == "dispatch_8336":  # the real dispatch row (schedule.wire, H = 4096, E_node = 32):
        # bf16 [4096] + fp32 [32] by token, int32 [4] per record = 8336 B, 16-byte vectors
        n = 6000
        tensors = [
            torch.randn(2048, 4096, generator=gen).to(torch.bfloat16),
            torch.rand(2048, 32, generator=gen),
            torch.randint(-(2**31), 2**31 - 1, (n, 4), generator=gen, dtype=torch.int32),
        ]
        token = torch.randint(0, 2048, (n,), generator=gen)
        index = [token, token, None]
        assert ops.row_bytes([(t.dtype, tuple(t.shape[1:])) for t in tensors]) == 8336
    elif (
        case == "odd_widths"
    ):  # 3-, 6-, 1-, 10-byte parts: vector widths 1, 2, 4, 8 and unaligned offsets
        n = 1001
        tensors = [
            _random_bytes(n, 3, gen),
            torch.randn(50, 3, generator=gen).to(torch.float16),
            torch.rand(n, generator=gen) < 0.5,
            _random_bytes(70, 10, gen),
        ]
        index = [
            None,
            torch.randint(0, 50, (n,), generator=gen),
            None,
            torch.randint(0, 70, (n,), generator=gen),
        ]
    elif case == "many_parts":  # > 8 parts: several launches
        n = 513
        tensors = [torch.randn(n, k + 1, generator=gen) for k in range(11)]
        index = [None if k % 2 else torch.randint(0, n, (n,), generator=gen) for k in range(11)]
    else:
        n = 0
        tensors = [torch.zeros(5, 4), torch.zeros(0, 2, dtype=torch.int64)]
        index = [torch.zeros(0, dtype=torch.int64), None]
    cpu, gpu = _twice_on_cuda(ops.pack_rows, tensors, index)
    assert same_bits(cpu[0], gpu[0])
    specs = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
    scatter = torch.randperm(n + 17, generator=gen)[:n]
    permutation = torch.randperm(n, generator=gen)  # every row written: no zero fill
    for kwargs in (
        {},
        {"row_index": scatter, "num_rows": n + 17},
        {"row_index": permutation, "num_rows": n},
    ):

        def unpack(packed, idx=None, kwargs=kwargs):
            extra = {} if idx is None else {"row_index": idx, "num_rows": kwargs["num_rows"]}
            return ops.unpack_rows(packed, specs, **extra)

        cpu_u, gpu_u = _twice_on_cuda(unpack, cpu[0], kwargs.get("row_index"))
        for a, b in zip(cpu_u, gpu_u, strict=True):
            assert same_bits(a, b)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_segment_sum_cuda_equal_cpu_every_dtype(cuda_ops, dtype, out_dtype):
    gen = torch.Generator().manual_seed(11)
    for n, segments, shape in (
        (3000, 1200, (64,)),
        (257, 31, (3,)),
        (100, 7, (2, 5)),
        (0, 4, (8,)),
    ):
        scale = torch.exp2(torch.randint(-10, 10, (n, *shape), generator=gen).double())
        values = (torch.randn((n, *shape), generator=gen, dtype=torch.float64) * scale).to(dtype)
        ids = torch.randint(0, segments, (n,), generator=gen)
        cpu, gpu = _twice_on_cuda(
            lambda v, i, segments=segments: ops.segment_sum(v, i, segments, out_dtype=out_dtype),
            values,
            ids,
        )
        assert same_bits(cpu[0], gpu[0]), (n, segments, shape)


def test_segment_sum_cuda_glm_size_equals_cpu_and_reference_on_cuda(cuda_ops):
    gen = torch.Generator().manual_seed(5)
    n, segments, width = 29000, 14500, 4096
    values = torch.randn(n, width, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, segments, (n,), generator=gen)
    cpu, gpu = _twice_on_cuda(lambda v, i: ops.segment_sum(v, i, segments), values, ids)
    assert same_bits(cpu[0], gpu[0])
    longest = int(torch.bincount(ids, minlength=segments).max())
    ref = reference.segment_sum(
        values[:4000].cuda(), ids[:4000].cuda(), segments, max_segment_len=longest
    )
    assert same_bits(
        ops.segment_sum(values[:4000].cuda(), ids[:4000].cuda(), segments).cpu(), ref.cpu()
    )


def test_segment_sum_cuda_leaves_out_of_range_ids_out(cuda_ops):
    values = torch.ones(4, 2, device="cuda")
    out = ops.segment_sum(values, torch.tensor([0, 5, -1, 1], device="cuda"), 2)
    assert out.cpu().tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_segment_sum_cuda_backward_of_left_out_rows_is_zero_like_cpu(cuda_ops):
    # The old backward index-selected the gradient at an out-of-range id: a device assert.
    ids = torch.tensor([0, 3, -1, 1])
    grads = []
    for device in ("cpu", "cuda"):
        v = torch.tensor([[1.0], [5.0], [7.0], [2.0]], device=device, requires_grad=True)
        ops.segment_sum(v, ids.to(device), 3).backward(
            torch.tensor([[10.0], [20.0], [30.0]], device=device)
        )
        grads.append(v.grad.cpu())
    assert same_bits(grads[0], grads[1]) and grads[0].flatten().tolist() == [10.0, 0.0, 0.0, 20.0]


def test_segment_sum_cuda_backward_equals_cpu(cuda_ops):
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(50, 6, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 9, (50,), generator=gen)
    grad = torch.randn(9, 6, generator=gen)
    grads = []
    for device in ("cpu", "cuda"):
        v = values.to(device).requires_grad_(True)
        ops.segment_sum(v, ids.to(device), 9, out_dtype=torch.float32).backward(grad.to(device))
        grads.append(v.grad.cpu())
    assert same_bits(grads[0], grads[1])


def test_torch_compile_on_cuda(cuda_ops):
    gen = torch.Generator().manual_seed(3)
    routing = random_routing_map(256, 64, 8, gen).cuda()
    payload = torch.randn(256, 32, generator=gen).to(torch.bfloat16).cuda()

    def layer(routing_TE, payload_TH):
        token, node, _, _ = ops.records_from_routing(routing_TE, 4, 8)
        packed = ops.pack_rows([payload_TH], [token.clamp(min=0)])
        (rows,) = ops.unpack_rows(packed, [(torch.bfloat16, (32,))])
        return ops.segment_sum(rows, node.clamp(min=0), 4)

    eager = layer(routing, payload)
    traced = torch.compile(layer, backend="aot_eager", fullgraph=True)(routing, payload)
    assert same_bits(eager.cpu(), traced.cpu())
