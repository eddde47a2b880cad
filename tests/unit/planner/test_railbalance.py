"""RailBalance quotas, remainder rotation, eligible policies and the greedy relay matching."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.planner import (
    EligiblePolicy,
    eligible_NNG,
    healthy_gpus_NG,
    rail_quota_NNG,
    relay_NNGG,
)
from megatron_railwave.topology import RailTopology


def _records(n: int, g: int, entries: dict[tuple[int, int], list[int]]) -> torch.Tensor:
    """records_NNG [s, d, g] with the given owner rows, zero elsewhere."""
    out = torch.zeros(n, n, g, dtype=torch.int64)
    for (s, d), row in entries.items():
        out[s, d] = torch.tensor(row)
    return out


def _quota(topo, records, *, balanced=True, phase=0, policy=EligiblePolicy.ALL, mask=None):
    eligible = eligible_NNG(topo, records, policy, mask)
    return rail_quota_NNG(records, eligible, balanced=balanced, phase=phase)


def test_rail_quota_remainder_rotates_with_destination():
    # 3 nodes x 4 GPUs; node 0 sends 6 records to node 1 and 6 to node 2, all owned by GPU 0.
    # base 1, remainder 2 goes to eligible positions p with (p - rot) mod 4 < 2, rot = (s + d) mod
    # 4: (0 -> 1): rot 1 -> GPUs 1, 2 get the extra: [1, 2, 2, 1]
    #   (0 -> 2): rot 2 -> GPUs 2, 3:               [1, 1, 2, 2]
    topo = RailTopology(num_nodes=3, gpus_per_node=4)
    records = _records(3, 4, {(0, 1): [6, 0, 0, 0], (0, 2): [6, 0, 0, 0]})
    quota = _quota(topo, records)
    assert quota[0, 1].tolist() == [1, 2, 2, 1]
    assert quota[0, 2].tolist() == [1, 1, 2, 2]


def test_rail_quota_remainder_rotates_with_source_and_phase():
    # Same 6 records from node 2 to node 1: rot = (2 + 1) mod 4 = 3 -> GPUs 3, 0: [2, 1, 1, 2].
    # Phase 1 on (0 -> 1): rot = 2 -> GPUs 2, 3: [1, 1, 2, 2]. Phase 4 wraps to phase 0.
    topo = RailTopology(num_nodes=3, gpus_per_node=4)
    records = _records(3, 4, {(2, 1): [0, 6, 0, 0], (0, 1): [6, 0, 0, 0]})
    assert _quota(topo, records)[2, 1].tolist() == [2, 1, 1, 2]
    assert _quota(topo, records, phase=1)[0, 1].tolist() == [1, 1, 2, 2]
    assert _quota(topo, records, phase=4)[0, 1].tolist() == _quota(topo, records)[0, 1].tolist()


def test_rail_quota_rotation_counts_eligible_positions_only():
    # 2 nodes x 4 GPUs, rail 1 failed on node 0: eligible GPUs of (0 -> 1) are 0, 2, 3 at
    # positions 0, 1, 2. 8 records: base 2, remainder 2, rot = 1 mod 3 -> positions 1, 2
    # (GPUs 2, 3): [2, 0, 3, 3].
    topo = RailTopology(num_nodes=2, gpus_per_node=4, failed_rails=frozenset({(0, 1)}))
    records = _records(2, 4, {(0, 1): [0, 8, 0, 0]})
    assert _quota(topo, records)[0, 1].tolist() == [2, 0, 3, 3]


def test_rail_quota_local_node_never_balanced():
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    records = _records(2, 4, {(0, 0): [9, 0, 1, 0], (1, 1): [0, 0, 0, 5]})
    quota = _quota(topo, records)
    assert torch.equal(quota[0, 0], records[0, 0]) and torch.equal(quota[1, 1], records[1, 1])


def test_unbalanced_quota_keeps_owners_and_hands_failed_gpu_records_to_eligible_ones():
    # NATIVE / PERM: owners keep their records, except GPU 1 whose rail failed on node 0.
    # Its 5 records are spread over eligible GPUs 0, 2, 3 (positions 0, 1, 2): base 1, remainder
    # 2 at rot = (0 + 1) mod 3 = 1 -> positions 1, 2 (GPUs 2, 3): [1, -, 2, 2].
    # Quota = own records + share: [1 + 1, 0, 2 + 2, 0 + 2] = [2, 0, 4, 2].
    topo = RailTopology(num_nodes=2, gpus_per_node=4, failed_rails=frozenset({(0, 1)}))
    records = _records(2, 4, {(0, 1): [1, 5, 2, 0], (1, 0): [3, 3, 3, 3]})
    quota = _quota(topo, records, balanced=False)
    assert quota[0, 1].tolist() == [2, 0, 4, 2]
    # Node 1 -> node 0: rail 1 is dead at the destination, so GPU (1, 1) hands its 3 records on:
    # base 1 over GPUs 0, 2, 3, no remainder -> [4, 0, 4, 4].
    assert quota[1, 0].tolist() == [4, 0, 4, 4]


def test_failed_rail_never_carries_traffic_balanced():
    topo = RailTopology(num_nodes=3, gpus_per_node=4, failed_rails=frozenset({(0, 1), (2, 3)}))
    records = torch.randint(0, 20, (3, 3, 4), generator=torch.Generator().manual_seed(0))
    for balanced in (True, False):
        quota = _quota(topo, records, balanced=balanced)
        assert quota[0, 1:, 1].sum() == 0  # node 0's rail 1 sends nothing remote
        assert quota[1:, 0, 1].sum() == 0  # and receives nothing
        assert quota[:2, 2, 3].sum() == 0 and quota[2, :2, 3].sum() == 0


def test_healthy_gpus_follow_rail_of_gpu():
    # Two GPUs per rail (rail_of_gpu = [0, 0, 1, 1]); rail 1 of node 1 failed -> GPUs 2, 3 of node
    # 1.
    topo = RailTopology(
        num_nodes=2, gpus_per_node=4, rail_of_gpu=(0, 0, 1, 1), failed_rails=frozenset({(1, 1)})
    )
    assert healthy_gpus_NG(topo).tolist() == [[True, True, True, True], [True, True, False, False]]


def test_active_policy_uses_only_sending_gpus():
    # GPUs 0 and 3 of node 0 send to node 1 (4 + 2 records): quota 3 each on GPUs 0 and 3.
    # Node 1 sends nothing to node 0: no active GPU, so all healthy GPUs are eligible.
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    records = _records(2, 4, {(0, 1): [4, 0, 0, 2]})
    eligible = eligible_NNG(topo, records, EligiblePolicy.ACTIVE)
    assert eligible[0, 1].tolist() == [True, False, False, True]
    assert eligible[1, 0].tolist() == [True, True, True, True]
    assert _quota(topo, records, policy=EligiblePolicy.ACTIVE)[0, 1].tolist() == [3, 0, 0, 3]


def test_active_policy_excludes_failed_active_gpu():
    # GPU 0 sends but its rail failed at node 0: the only eligible active GPU is 3.
    topo = RailTopology(num_nodes=2, gpus_per_node=4, failed_rails=frozenset({(0, 0)}))
    records = _records(2, 4, {(0, 1): [4, 0, 0, 2]})
    assert _quota(topo, records, policy=EligiblePolicy.ACTIVE)[0, 1].tolist() == [0, 0, 0, 6]


def test_mask_policy_narrows_to_mask_and_falls_back_when_empty():
    # Mask allows GPUs 0, 1 on node 0 and only GPU 2 on node 1, whose rail 2 failed there.
    topo = RailTopology(num_nodes=2, gpus_per_node=4, failed_rails=frozenset({(1, 2)}))
    mask = torch.tensor([[True, True, False, False], [False, False, True, False]])
    records = _records(2, 4, {(0, 1): [0, 0, 0, 7], (1, 0): [0, 0, 0, 6]})
    eligible = eligible_NNG(topo, records, EligiblePolicy.MASK, mask)
    assert eligible[0, 1].tolist() == [True, True, False, False]
    # node 1: mask & healthy is empty -> all healthy GPUs 0, 1, 3 of pair (1 -> 0)
    assert eligible[1, 0].tolist() == [True, True, False, True]
    # 7 over GPUs 0, 1: base 3, remainder 1 at rot = 1 mod 2 -> GPU 1: [3, 4, 0, 0]
    assert _quota(topo, records, policy=EligiblePolicy.MASK, mask=mask)[0, 1].tolist() == [
        3,
        4,
        0,
        0,
    ]


def test_mask_policy_errors():
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    records = torch.zeros(2, 2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"eligible policy 'mask' needs a rail mask \[N, G\]"):
        eligible_NNG(topo, records, EligiblePolicy.MASK)
    with pytest.raises(
        ValueError, match=r"rail mask has shape \(4,\), expected \[N, G\] = \[2, 4\]"
    ):
        eligible_NNG(topo, records, EligiblePolicy.MASK, torch.ones(4, dtype=torch.bool))


def test_relay_greedy_fill_hand_case():
    # One pair, 4 GPUs: records [5, 0, 3, 0], quota [2, 2, 2, 2].
    #   keep    [2, 0, 2, 0]; surplus [3, 0, 1, 0] laid end to end: owner 0 -> [0, 3), owner 2 ->
    # [3, 4) deficit [0, 2, 0, 2] laid end to end: GPU 1 -> [0, 2), GPU 3 -> [2, 4)
    #   owner 0: 2 records to GPU 1, 1 to GPU 3; owner 2: 1 record to GPU 3.
    records = torch.tensor([[[5, 0, 3, 0]]])
    quota = torch.tensor([[[2, 2, 2, 2]]])
    relay = relay_NNGG(records, quota)[0, 0]
    assert relay.tolist() == [
        [2, 2, 0, 1],
        [0, 0, 0, 0],
        [0, 0, 2, 1],
        [0, 0, 0, 0],
    ]


def test_relay_moves_minimum_and_conserves_counts():
    topo = RailTopology(num_nodes=4, gpus_per_node=8, failed_rails=frozenset({(2, 5)}))
    records = torch.randint(0, 50, (4, 4, 8), generator=torch.Generator().manual_seed(1))
    quota = _quota(topo, records)
    relay = relay_NNGG(records, quota)
    assert torch.equal(relay.sum(dim=-1), records)  # every owned record leaves on one GPU
    assert torch.equal(relay.sum(dim=-2), quota)  # every GPU sends its quota
    moved = relay.sum() - torch.diagonal(relay, dim1=-2, dim2=-1).sum()
    assert moved == (records - quota).clamp(min=0).sum()  # nothing moves twice
