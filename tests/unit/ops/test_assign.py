"""assign_egress and records_per_node_rail against the planner's route_records: for every path,
every eligible-rail policy and failed rails, the records + egress chain on the ops (compiled and
reference) gives exactly the planner's routes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine may lack it: skip, not a collection error
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_railwave import ops
from megatron_railwave.names import ROUTES
from megatron_railwave.ops import reference
from megatron_railwave.planner import EligiblePolicy, PlanOptions, build_plan, route_records
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, target_masks
from tests.helpers.ops_cases import egress_inputs, random_routing_map

PATHS = tuple(map(str, ROUTES))


def _plans(topo: RailTopology, demand: DemandCounts, mask_NG: torch.Tensor):
    for path in PATHS:
        for policy in EligiblePolicy:
            options = PlanOptions(
                policy=policy, rail_mask_NG=mask_NG if policy == EligiblePolicy.MASK else None
            )
            yield build_plan(demand, topo, path, options=options, phase=3)


def _check_rank(plan, rank: int, routing: torch.Tensor, impl) -> None:
    topo = plan.topology
    n_nodes, g = topo.num_nodes, topo.gpus_per_node
    want = route_records(plan, rank, target_masks(routing, topo))
    token, node, mask, counts = impl.records_from_routing(routing, n_nodes, g)
    egress, wave = impl.assign_egress(node, **egress_inputs(plan, rank))
    n = want.token_R.numel()
    assert torch.equal(
        counts.sum(dim=1), plan.records_NNG[topo.node_of(rank), :, topo.local_of(rank)]
    )
    assert torch.equal(token[:n], want.token_R) and torch.equal(node[:n], want.node_R)
    assert torch.equal(mask[:n], want.mask_R)
    assert torch.equal(egress[:n], want.egress_R), (plan.path, plan.quota_NNG)
    assert torch.equal(wave[:n], want.wave_R)
    assert (egress[n:] == -1).all() and (wave[n:] == -1).all()  # padding
    rail_of_gpu = torch.tensor(topo.rail_of_gpu)
    load = impl.records_per_node_rail(node, egress, rail_of_gpu, n_nodes, topo.num_rails)
    direct = torch.bincount(
        want.node_R * topo.num_rails + rail_of_gpu[want.egress_R],
        minlength=n_nodes * topo.num_rails,
    ).view(n_nodes, topo.num_rails)
    assert torch.equal(load, direct)


@settings(max_examples=25, deadline=None)
@given(
    num_nodes=st.integers(1, 4),
    gpus_per_node=st.integers(1, 8),
    num_tokens=st.integers(0, 24),
    topk=st.integers(1, 6),
    num_failed=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_ops_route_like_the_planner_every_path_policy_and_failed_rail(
    compiled, num_nodes, gpus_per_node, num_tokens, topk, num_failed, seed
):
    gen = torch.Generator().manual_seed(seed)
    failed = {
        (
            int(torch.randint(num_nodes, (1,), generator=gen)),
            int(torch.randint(gpus_per_node, (1,), generator=gen)),
        )
        for _ in range(num_failed)
    }
    try:
        topo = RailTopology(
            num_nodes=num_nodes, gpus_per_node=gpus_per_node, failed_rails=frozenset(failed)
        )
    except ValueError:  # a node or a node pair without any healthy rail: not a valid cluster
        assume(False)
    num_experts = topo.world_size * 2
    maps = [random_routing_map(num_tokens, num_experts, topk, gen) for _ in range(topo.world_size)]
    demand = DemandCounts.from_routing_maps(maps, topo)
    mask_NG = torch.rand(num_nodes, gpus_per_node, generator=gen) < 0.5
    for plan in _plans(topo, demand, mask_NG):
        for rank in range(topo.world_size):
            _check_rank(plan, rank, maps[rank], ops)  # compiled (the fixture made sure)
            _check_rank(plan, rank, maps[rank], reference)  # and the reference


def test_assign_egress_hand_case_owner_keeps_then_proxies(compiled):
    # One destination node (N = 1 is enough for the arithmetic), G = 3, owner GPU 0 with 5 records:
    # keep 2; its surplus starts at 1 on the pair's surplus line (another owner's surplus is first);
    # deficit intervals end at [0, 2, 6]: GPU 0 has no deficit, GPU 1 covers [0, 2), GPU 2 [2, 6).
    # Surplus positions of records 2, 3, 4: 1, 2, 3 -> proxies 1, 2, 2.
    args = dict(
        owner_gpu=0,
        counts_N=torch.tensor([5]),
        keep_N=torch.tensor([2]),
        surplus_lo_N=torch.tensor([1]),
        deficit_hi_NG=torch.tensor([[0, 2, 6]]),
        wave_N=torch.tensor([4]),
    )
    node = torch.tensor([0, 0, 0, 0, 0, -1])
    for impl in (ops, reference):
        egress, wave = impl.assign_egress(node, **args)
        assert egress.tolist() == [0, 0, 1, 2, 2, -1]
        assert wave.tolist() == [4, 4, 4, 4, 4, -1]


def test_records_per_node_rail_skips_padding(compiled):
    node = torch.tensor([0, 1, 1, -1])
    egress = torch.tensor([1, 0, 1, -1])
    rails = torch.tensor([1, 0])  # GPU 0 on rail 1, GPU 1 on rail 0
    for impl in (ops, reference):
        assert impl.records_per_node_rail(node, egress, rails, 2, 2).tolist() == [[1, 0], [1, 1]]


def test_assign_egress_compiled_rejects_bad_arguments(compiled):
    args = dict(
        owner_gpu=0,
        counts_N=torch.tensor([1]),
        keep_N=torch.tensor([1]),
        surplus_lo_N=torch.tensor([0]),
        deficit_hi_NG=torch.tensor([[0, 0]]),
        wave_N=torch.tensor([0]),
    )
    with pytest.raises(ValueError, match="is not a node of 1"):
        ops.assign_egress(torch.tensor([3]), **args)
    with pytest.raises(ValueError, match="owner_gpu=5"):
        ops.assign_egress(torch.tensor([0]), **{**args, "owner_gpu": 5})
    with pytest.raises(ValueError, match="keep_N must be \\[1\\]"):
        ops.assign_egress(torch.tensor([0]), **{**args, "keep_N": torch.tensor([1, 2])})


def test_records_per_node_rail_leaves_a_bad_egress_out_on_cpu_as_on_cuda(compiled):
    # Egress 3 of G = 3 (what assign_egress gives for bounds that do not come from one plan), -2,
    # and a rail out of range: the CUDA kernel cannot raise without a host sync and skips such
    # records, so the CPU twin (which used to raise) and the reference skip them too; the counts
    # then sum to 2 of the 5 records. test_gpu.py checks CUDA against this.
    node = torch.tensor([0, 0, 1, 1, 1, -1])
    egress = torch.tensor([0, 3, 2, -2, 1, -1])
    rail_of_gpu = torch.tensor([0, 1, 7])  # GPU 2's rail 7 is out of range for R = 3 too
    want = [[1, 0, 0], [0, 1, 0]]
    for impl in (ops, reference):
        assert impl.records_per_node_rail(node, egress, rail_of_gpu, 2, 3).tolist() == want
