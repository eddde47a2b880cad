"""RailTopology: derived sizes, failed rails, validation errors and the YAML loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_railwave.topology import RailTopology, load_topology

CLUSTERS = Path(__file__).resolve().parents[2] / "megatron_railwave" / "configs" / "clusters"


def test_topology_defaults_one_rail_per_gpu():
    topo = RailTopology(num_nodes=2, gpus_per_node=4)
    assert topo.rail_of_gpu == (0, 1, 2, 3)
    assert topo.num_rails == 4
    assert topo.adapter_of_rail == (0, 1, 2, 3)
    assert topo.world_size == 8
    # rank 6 = node 1, local GPU 2
    assert (topo.node_of(6), topo.local_of(6), topo.rank_of(1, 2)) == (1, 2, 6)


def test_topology_failed_rail_blocks_pair_at_either_end():
    # 2 nodes x 4 GPUs, rail 1 failed on node 0 and rail 3 failed on node 1:
    #   pair 0 -> 1 may use GPUs 0 and 2 only (rail 1 dead at the source, rail 3 at the destination)
    topo = RailTopology(num_nodes=2, gpus_per_node=4, failed_rails=frozenset({(0, 1), (1, 3)}))
    assert topo.pair_gpu_eligible(0, 1) == [True, False, True, False]
    assert topo.pair_gpu_eligible(1, 0) == [True, False, True, False]
    assert not topo.rail_healthy(0, 1) and topo.rail_healthy(1, 1)


def test_topology_check_world_size_mismatch_raises():
    topo = RailTopology(num_nodes=4, gpus_per_node=8, name="h800")
    topo.check_world_size(32)
    with pytest.raises(
        ValueError, match=r"4 nodes x 8 GPUs = 32 ranks, but the expert-parallel group has 16"
    ):
        topo.check_world_size(16)


@pytest.mark.parametrize(
    ("failed", "match"),
    [
        ({(0, 8)}, r"failed rail \(0, 8\): rail 8 is out of range 0\.\.7"),
        ({(0, -1)}, r"rail -1 is out of range 0\.\.7"),
        ({(4, 0)}, r"failed rail \(4, 0\): node 4 is out of range 0\.\.3"),
    ],
)
def test_topology_failed_rail_out_of_range_raises(failed, match):
    with pytest.raises(ValueError, match=match):
        RailTopology(num_nodes=4, gpus_per_node=8, failed_rails=frozenset(failed))


def test_topology_every_rail_of_node_failed_raises():
    with pytest.raises(ValueError, match=r"every rail of node 1 is failed"):
        RailTopology(num_nodes=2, gpus_per_node=2, failed_rails=frozenset({(1, 0), (1, 1)}))


def test_topology_pair_without_common_healthy_rail_raises():
    # node 0 has only rail 1, node 1 has only rail 0: no rail is healthy at both ends.
    with pytest.raises(ValueError, match=r"nodes 0 and 1 share no healthy rail"):
        RailTopology(num_nodes=2, gpus_per_node=2, failed_rails=frozenset({(0, 0), (1, 1)}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_nodes": 0, "gpus_per_node": 8}, r"num_nodes must be a positive integer, got 0"),
        (
            {"num_nodes": 2, "gpus_per_node": 9},
            r"gpus_per_node must be an integer in 1\.\.8, got 9",
        ),
        (
            {"num_nodes": 2, "gpus_per_node": 2, "rail_of_gpu": (0,)},
            r"rail_of_gpu has 1 entries but gpus_per_node is 2",
        ),
        (
            {"num_nodes": 2, "gpus_per_node": 2, "rail_of_gpu": (0, 3), "num_rails": 2},
            r"rail_of_gpu\[1\] = 3 is out of range: rails are 0\.\.1",
        ),
        (
            {"num_nodes": 2, "gpus_per_node": 2, "adapter_of_rail": (0,)},
            r"adapter_of_rail has 1 entries, expected one per rail \(2\)",
        ),
        (
            {"num_nodes": 2, "gpus_per_node": 2, "rail_gbps": 0.0},
            r"bandwidths must be positive: rail_gbps=0\.0",
        ),
    ],
)
def test_topology_invalid_fields_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RailTopology(**kwargs)


def test_topology_with_failed_rails_and_with_nodes():
    topo = RailTopology(num_nodes=4, gpus_per_node=8).with_failed_rails({(3, 2)})
    assert topo.failed_rails == frozenset({(3, 2)})
    smaller = topo.with_nodes(2)  # the failed rail of node 3 no longer exists
    assert smaller.num_nodes == 2 and smaller.failed_rails == frozenset()
    with pytest.raises(ValueError, match=r"rail 9 is out of range"):
        topo.with_failed_rails({(0, 9)})


def test_topology_dict_round_trip():
    topo = RailTopology(
        num_nodes=3,
        gpus_per_node=4,
        rail_gbps=200.0,
        adapter_of_rail=(0, 0, 1, 1),
        adapter_gbps=400.0,
        failed_rails=frozenset({(2, 1)}),
        name="x",
    )
    assert RailTopology.from_dict(topo.to_dict()) == topo


def test_load_topology_presets():
    h800 = load_topology(CLUSTERS / "h800_4x8.yaml")
    assert (h800.num_nodes, h800.gpus_per_node, h800.num_rails, h800.rail_gbps) == (4, 8, 8, 400.0)
    h20 = load_topology(CLUSTERS / "h20_4x8.yaml")
    assert h20.adapter_of_rail == (0, 0, 1, 1, 2, 2, 3, 3) and h20.rail_gbps == 200.0
    assert load_topology(CLUSTERS / "h800_4x8.yaml", num_nodes=2).num_nodes == 2


def test_load_topology_nested_topology_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("topology:\n  num_nodes: 2\n  gpus_per_node: 4\n  failed_rails: [[1, 2]]\n")
    topo = load_topology(path)
    assert topo.world_size == 8 and topo.failed_rails == frozenset({(1, 2)})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("num_nodes: 2\ngpus_per_node: [4\n", r"is not valid YAML"),
        ("num_nodes: 2\n", r"missing required key 'gpus_per_node'"),
        ("num_nodes: two\ngpus_per_node: 4\n", r"key 'num_nodes' must be an integer, got 'two'"),
        ("num_nodes: 2\ngpus_per_node: 4\nnum_gpus: 4\n", r"unknown key\(s\) \['num_gpus'\]"),
        (
            "num_nodes: 2\ngpus_per_node: 4\nrail_of_gpu: 3\n",
            r"key 'rail_of_gpu' must be a list of integers, got 3",
        ),
        ("num_nodes: 2\ngpus_per_node: 4\nrail_gbps: fast\n", r"key 'rail_gbps' must be a number"),
        (
            "num_nodes: 2\ngpus_per_node: 4\nfailed_rails: [[0, 1, 2]]\n",
            r"key 'failed_rails' must be a list of \[node, rail\] pairs",
        ),
        (
            "num_nodes: 2\ngpus_per_node: 4\nfailed_rails: [[0, 7]]\n",
            r"c\.yaml'.*rail 7 is out of range 0\.\.3",
        ),
        ("- 1\n- 2\n", r"expected a mapping of topology keys, got list"),
    ],
)
def test_load_topology_malformed_yaml_names_the_key(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_topology(path)


def test_load_topology_missing_file_raises(tmp_path):
    with pytest.raises(ValueError, match=r"cluster file '.*nope\.yaml' does not exist"):
        load_topology(tmp_path / "nope.yaml")
