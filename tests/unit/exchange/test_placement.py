"""``exchange.placement``: the EP-rank -> (node, local GPU) map from the facts ranks report, and
the configuration fingerprint check (pure functions; the gloo run is in
tests/integration/test_dispatcher_errors.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_railwave.exchange.placement import (
    ConfigMismatchError,
    PlacementError,
    RankFacts,
    check_fingerprints,
    fingerprint_hashes,
    place_ranks,
)


def facts(layout: list[tuple[str, int]], *, cpu: bool = False, prints=None) -> list[RankFacts]:
    """One RankFacts per EP rank from (host, GPU) pairs."""
    return [
        RankFacts(
            ep_rank=e,
            global_rank=100 + e,
            host=h,
            host_id=abs(hash(h)) % (2**62),
            local_rank=gpu,
            gpu=-1 if cpu else gpu,
            fingerprint=prints[e] if prints else (),
        )
        for e, (h, gpu) in enumerate(layout)
    ]


def test_torchrun_order_is_the_identity():
    p = place_ranks(facts([("a", 0), ("a", 1), ("b", 0), ("b", 1)]), gpus_per_node=2)
    assert p.identity and p.railwave_rank_of_ep == (0, 1, 2, 3) and p.node_hosts == ("a", "b")
    assert p.global_rank_of_railwave == (100, 101, 102, 103)


def test_cyclic_launcher_is_mapped_by_host_and_gpu():
    # SLURM cyclic: EP rank e on host e % 2, GPU e // 2. Worked out: node a = EP [0, 2], node b =
    # [1, 3].
    p = place_ranks(facts([("a", 0), ("b", 0), ("a", 1), ("b", 1)]), gpus_per_node=2)
    assert p.railwave_rank_of_ep == (0, 2, 1, 3) and p.ep_rank_of_railwave == (0, 2, 1, 3)
    assert not p.identity
    # Expert columns in railwave order: railwave rank 1 is EP rank 2, so its experts are Megatron's
    # 4, 5.
    assert p.expert_columns(2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert p.describe() == "a: EP [0, 2]; b: EP [1, 3]"


def test_remapped_cuda_visible_devices_orders_a_node_by_physical_gpu():
    p = place_ranks(facts([("a", 1), ("a", 0), ("b", 0), ("b", 1)]), gpus_per_node=2)
    assert p.railwave_rank_of_ep == (1, 0, 2, 3)


def test_gpus_per_node_defaults_to_the_ranks_per_host():
    assert (
        place_ranks(
            facts([("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)])
        ).gpus_per_node
        == 3
    )


def test_ep_group_inside_one_node_on_upper_gpus_keeps_their_rails():
    p = place_ranks(
        facts([("a", 4), ("a", 5), ("a", 6), ("a", 7)]),
        gpus_per_node=4,
        rail_of_gpu=(0, 1, 2, 3, 4, 5, 6, 7),
    )
    assert p.identity and p.num_nodes == 1 and p.rail_of_local == (4, 5, 6, 7)


def test_cpu_ranks_of_one_machine_are_emulated_nodes_by_local_rank():
    p = place_ranks(facts([("m", 3), ("m", 2), ("m", 1), ("m", 0)], cpu=True), gpus_per_node=2)
    assert p.emulated and p.node_hosts == ("m#0", "m#1")
    assert p.railwave_rank_of_ep == (3, 2, 1, 0)


def test_uneven_ranks_per_node_name_the_layout_and_the_fix():
    with pytest.raises(
        PlacementError,
        match=r"4 EP ranks over 2 node\(s\) \(a: EP ranks \[0, 1, 2\]; b: EP ranks "
        r"\[3\]\); every node must hold the same number of EP ranks \(G = 3\)"
        r"\. Fix: .*expert_tensor_parallel_size 1",
    ):
        place_ranks(facts([("a", 0), ("a", 1), ("a", 2), ("b", 0)]))


def test_strided_gpus_would_make_rail_groups_cross_rails():
    # ETP 2 on 2 x 4 GPUs: EP group = GPUs {0, 2} of every node is fine, but {0, 2} on a and {1, 3}
    # on b is not.
    ok = place_ranks(
        facts([("a", 0), ("a", 2), ("b", 0), ("b", 2)]), gpus_per_node=2, rail_of_gpu=(0, 1, 2, 3)
    )
    assert ok.rail_of_local == (0, 2)
    with pytest.raises(
        PlacementError,
        match=r"local GPUs of a sit on rails \[0, 2\] but those of b on rails \[1, 3\]",
    ):
        place_ranks(
            facts([("a", 0), ("a", 2), ("b", 1), ("b", 3)]),
            gpus_per_node=2,
            rail_of_gpu=(0, 1, 2, 3),
        )


def test_two_ranks_on_one_gpu_and_gpus_outside_the_cluster_file():
    with pytest.raises(PlacementError, match=r"EP ranks \[0, 1\] on a report the same GPU \[0\]"):
        place_ranks(facts([("a", 0), ("a", 0), ("b", 0), ("b", 1)]), gpus_per_node=2)
    with pytest.raises(
        PlacementError, match=r"reports GPUs \[0, 9\] but the cluster file describes GPUs 0..1"
    ):
        place_ranks(
            facts([("a", 0), ("a", 9), ("b", 0), ("b", 1)]), gpus_per_node=2, rail_of_gpu=(0, 1)
        )


def test_config_fingerprints_name_the_ranks_and_fields():
    fields = {"path": "joint", "failed_rails": "[]"}
    same = fingerprint_hashes(fields)
    other = fingerprint_hashes({"path": "joint", "failed_rails": "[(1, 0)]"})
    check_fingerprints(facts([("a", 0), ("a", 1)], prints=[same, same]), fields)
    with pytest.raises(
        ConfigMismatchError,
        match=r"'failed_rails' differs \(EP ranks \[0, 2\] vs EP ranks \[1\]\)"
        r".*this rank: path=joint, failed_rails=\[\]",
    ):
        check_fingerprints(
            facts([("a", 0), ("a", 1), ("b", 0)], prints=[same, other, same]), fields
        )
    assert torch.tensor(same).dtype == torch.int64  # hashes fit the all-gather's int64 rows


@pytest.mark.parametrize("cpu", [True, False])
def test_two_torchrun_agents_on_one_host_are_split_by_group_rank(cpu):
    # torchrun --nnodes 2 on localhost: local ranks 0, 1 of agent 0 and 0, 1 of agent 1 on one host
    # name. Cut by local rank, the emulated nodes were [0, 0] and [1, 1]: "report the same GPU".
    # With GROUP_RANK the host is split by agent first. Worked out (EP order A0, B0, A1, B1):
    # node 0 = agent 0 = EP [0, 2], node 1 = agent 1 = EP [1, 3].
    layout = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (group rank, local rank) per EP rank
    fs = [
        RankFacts(
            ep_rank=e,
            global_rank=e,
            host="localhost",
            host_id=7,
            local_rank=local,
            gpu=-1 if cpu else local,
            fingerprint=(),
            group_rank=agent,
        )
        for e, (agent, local) in enumerate(layout)
    ]
    p = place_ranks(fs, gpus_per_node=2)
    assert p.railwave_rank_of_ep == (0, 2, 1, 3)
    assert p.node_hosts == ("localhost/node0", "localhost/node1")
    # Without the node rank (not torchrun) the repeat is still an error naming the launcher.
    bare = [
        RankFacts(
            ep_rank=f.ep_rank,
            global_rank=f.global_rank,
            host=f.host,
            host_id=f.host_id,
            local_rank=f.local_rank,
            gpu=f.gpu,
            fingerprint=(),
        )
        for f in fs
    ]
    with pytest.raises(
        PlacementError, match="report the same GPU" if cpu else "same number of EP ranks"
    ):
        place_ranks(bare, gpus_per_node=2)


def test_facts_travel_with_the_group_rank():
    from megatron_railwave.exchange.placement import _decode, _encode

    f = RankFacts(
        ep_rank=3,
        global_rank=9,
        host="h1",
        host_id=5,
        local_rank=1,
        gpu=-1,
        fingerprint=(11, 12),
        group_rank=4,
    )
    assert _decode(3, _encode(f).tolist()) == f
