"""RailWaveConfig: every field is checked at construction (install() time), with one line that
names the field, the value and the fix; load_config / install reject what is not a config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import megatron_railwave
from megatron_railwave.config import RailWaveConfig, load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"gpus_per_node": 0}, r"gpus_per_node=0 must be an integer in 1\.\.8"),
        ({"gpus_per_node": -2}, r"gpus_per_node=-2 must be an integer in 1\.\.8"),
        ({"gpus_per_node": "8"}, r"gpus_per_node='8' must be an integer in 1\.\.8"),
        ({"gpus_per_node": True}, r"gpus_per_node=True must be an integer"),
        ({"failed_rails": [[1]]}, r"failed_rails=\[\[1\]\] must be a list of \[node, rail\] pairs"),
        ({"failed_rails": [1, 2]}, r"failed_rails=\[1, 2\] must be a list of \[node, rail\] pairs"),
        (
            {"failed_rails": [[0, -1]]},
            r"failed_rails=\[\[0, -1\]\] must be a list of \[node, rail\] pairs",
        ),
        (
            {"timeout_s": -1},
            r"timeout_s=-1 must be a finite number > 0 \(seconds; null = the process group",
        ),
        ({"timeout_s": 0}, r"timeout_s=0 must be a finite number > 0"),
        ({"timeout_s": "soon"}, r"timeout_s='soon' must be a finite number > 0"),
        ({"timeout_s": float("nan")}, r"timeout_s=nan must be a finite number > 0"),
        (
            {"policy": "mask"},
            r"policy 'mask' needs rail_mask: \[N\]\[G\] of 0/1, e.g. \[\[1, 1, 0, 0\]",
        ),
        (
            {"rail_mask": [[1, 0]]},
            r"rail_mask is set but policy is 'all', which ignores it; set policy: mask",
        ),
        (
            {"policy": "mask", "rail_mask": [[1, 2]]},
            r"rail_mask=\[\[1, 2\]\] must be \[N\]\[G\] of 0/1",
        ),
        ({"policy": "mask", "rail_mask": [[1, 0], [1]]}, r"rows of equal length"),
        ({"policy": "sideways"}, r"policy='sideways' is not one of \['all', 'active', 'mask'\]"),
        ({"path": "fastest"}, r"unknown path 'fastest'; choose one of native, rail, perm, joint"),
        ({"path": 3}, r"path=3 must be a string: one of auto, native, rail, perm, joint"),
        ({"fanin": 0}, r"fanin=0 must be an integer >= 1"),
        ({"fanin": 1.5}, r"fanin=1.5 must be an integer >= 1"),
        ({"chunks": 0}, r"chunks=0 must be an integer in 1..64 \(rail chunks per wave"),
        ({"chunks": 65}, r"chunks=65 must be an integer in 1..64"),
        ({"chunks": True}, r"chunks=True must be an integer in 1..64"),
        (
            {"chunks": 2, "backend": "deepep"},
            r"chunks=2 \(rail chunks per wave\) runs on the torch backend only",
        ),
        ({"streamed": "yes"}, r"streamed='yes' must be true or false"),
        (
            {"streamed": True, "backend": "deepep"},
            r"streamed: true \(relay streamed into the rail phases\) runs on the torch backend",
        ),
        ({"rail_gbps": 0}, r"rail_gbps=0 must be a finite number > 0"),
        ({"rail_of_gpu": [0, "a"]}, r"rail_of_gpu=\[0, 'a'\] must be a list of rail indices >= 0"),
        (
            {"gpus_per_node": 2, "rail_of_gpu": [0]},
            r"rail_of_gpu has 1 entries but gpus_per_node is 2",
        ),
        ({"log_mode": "node"}, r"log_mode='node' must be 'rank' \(one file per rank\) or 'job'"),
        ({"log_interval": 0}, r"log_interval=0 must be an integer >= 1 \(steps\)"),
        ({"capture_interval": "10"}, r"capture_interval='10' must be an integer >= 1"),
        (
            {"cluster": "h900_64x8"},
            r"cluster file 'h900_64x8' does not exist and is not a preset name "
            r"\(presets: cpu_2x1, h20_4x8, h800_4x8\)",
        ),
        (
            {"cluster": "h800_4x8", "gpus_per_node": 4},
            r"gpus_per_node=4 differs from the cluster file's 8",
        ),
        ({"cluster": "h800_4x8", "failed_rails": [[0, 8]]}, r"rail 8 is out of range 0\.\.7"),
        ({"log_dir": 5}, r"log_dir=5 must be a directory path or null"),
        (
            {"max_tokens_per_rank": 0},
            r"max_tokens_per_rank=0 must be an integer >= 1 .*or null for the normal mode",
        ),
        ({"max_tokens_per_rank": 4.5}, r"max_tokens_per_rank=4.5 must be an integer >= 1"),
        (
            {"max_tokens_per_rank": 512, "backend": "deepep"},
            r"max_tokens_per_rank=512 \(fixed-capacity mode\) runs on the torch backend only",
        ),
    ],
)
def test_config_rejects_bad_field_naming_it(fields, match):
    with pytest.raises(ValueError, match=match):
        RailWaveConfig.from_dict(fields)


def test_config_error_is_one_line_prefixed_by_its_source():
    with pytest.raises(ValueError) as exc:
        RailWaveConfig.from_dict({"timeout_s": -1})
    assert str(exc.value).startswith("railwave config: timeout_s=-1") and "\n" not in str(exc.value)


def test_config_output_directories_must_be_writable(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"log_dir '.*file\.txt' is a file; give a directory"):
        RailWaveConfig(log_dir=str(a_file))
    with pytest.raises(
        ValueError,
        match=r"capture_dir '.*file\.txt/traces': cannot create this directory: "
        r"'.*file\.txt' is a file, not a directory",
    ):
        RailWaveConfig(capture_dir=str(a_file / "traces"))
    # A directory that does not exist yet but can be created is fine (nothing is created here).
    cfg = RailWaveConfig(log_dir=str(tmp_path / "new" / "logs"), capture_dir=str(tmp_path))
    assert cfg.log_dir.endswith("logs") and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"path": "auto", "anchors": "h800_4x8_c2"},
            r"railwave config: anchors='h800_4x8_c2' was removed: the offline anchors selector "
            r".*is retired: path: auto runs the online selector.*Delete the key",
        ),
        (
            {"anchors": None},
            r"anchors=None was removed: .*docs/selector\.md, Migrating\)\. Delete the key",
        ),
        (
            {"payload_ratio": 1.25},
            r"payload_ratio=1\.25 was removed: it was the offline anchor rule's payload window.*"
            r"online: \{payload_ratio: \.\.\.\}\. Delete the key, or move it under online:",
        ),
        (
            {"shape_distance": 0.02},
            r"shape_distance=0\.02 was removed: it was the offline anchor rule's shape window.*"
            r"online: \{shape_distance: \.\.\.\}\. Delete the key, or move it under online:",
        ),
        (
            {"path": "auto", "selector": "anchors"},
            r"selector='anchors' was removed: the offline anchors rule is retired; path: auto "
            r"runs the online selector .*Delete selector .*or set a fixed path",
        ),
        (
            {"selector": "model"},
            r"selector='model' must be 'online' or null",
        ),
    ],
)
def test_config_retired_selector_keys_name_what_replaced_them(fields, match):
    with pytest.raises(ValueError, match=match):
        RailWaveConfig.from_dict(fields)


def test_config_old_file_with_anchors_fails_at_load_and_the_window_moves_under_online(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("path: auto\nanchors: h800_4x8\nchunks: 1\n")
    with pytest.raises(ValueError, match=r"railwave config '.*old\.yaml': anchors='h800_4x8' was"):
        load_config(str(old))
    # The migrated file: the key deleted, the neighbourhood window under online.
    new = tmp_path / "new.yaml"
    new.write_text("path: auto\nonline: {payload_ratio: 1.5, shape_distance: 0.1}\n")
    cfg = load_config(str(new))
    assert cfg.selector_kind() == "online"
    assert (cfg.online.payload_ratio, cfg.online.shape_distance) == (1.5, 0.1)


def test_config_accepts_a_cluster_preset_name_like_the_cli():
    cfg = RailWaveConfig(cluster="h800_4x8", failed_rails=[[1, 3]])
    topo = cfg.topology(32)
    assert (topo.num_nodes, topo.gpus_per_node, sorted(topo.failed_rails)) == (4, 8, [(1, 3)])


def test_config_mask_policy_checks_the_mask_against_the_topology():
    cfg = RailWaveConfig(gpus_per_node=2, policy="mask", rail_mask=[[1, 0], [1, 1]])
    assert cfg.plan_options(cfg.topology(4)).rail_mask_NG.tolist() == [[True, False], [True, True]]
    with pytest.raises(
        ValueError, match=r"rail_mask is \[2, 2\] but the topology is 4 nodes x 2 GPUs"
    ):
        cfg.plan_options(cfg.topology(8))


def test_config_yaml_nulls_mean_empty_lists(tmp_path):
    path = tmp_path / "rw.yaml"
    path.write_text("gpus_per_node: 2\nfailed_rails: null\nrail_of_gpu: null\n")
    cfg = load_config(path)
    assert cfg.failed_rails == () and cfg.rail_of_gpu == ()


def test_config_file_missing_or_not_yaml_names_the_file(tmp_path):
    with pytest.raises(
        ValueError,
        match=re.escape(f"railwave config file {str(tmp_path / 'no.yaml')!r} does not exist"),
    ):
        load_config(tmp_path / "no.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus_per_node: [2\n")
    with pytest.raises(
        ValueError, match=re.escape(f"railwave config file {str(bad)!r} is not valid YAML")
    ):
        load_config(bad)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            [1, 2],
            r"railwave config: got list \[1, 2\]; give a RailWaveConfig, a dict of its fields",
        ),
        (42, r"railwave config: got int 42; give a RailWaveConfig"),
    ],
)
def test_install_rejects_what_is_not_a_config(config, match):
    # load_config runs before Megatron is touched, so this needs no Megatron shims.
    with pytest.raises(ValueError, match=match):
        megatron_railwave.install(config)


def test_install_rejects_a_directory(tmp_path):
    with pytest.raises(
        ValueError,
        match=re.escape(f"railwave config {str(tmp_path)!r} is a directory; give the YAML file"),
    ):
        megatron_railwave.install(str(tmp_path))


def test_the_shipped_config_is_valid():
    cfg = load_config(REPO / "megatron_railwave" / "configs" / "railwave" / "glm45_air_h800.yaml")
    assert cfg.topology(32).num_nodes == 4


def test_config_max_tokens_per_rank_is_part_of_the_fingerprint():
    """Ranks that disagree on the fixed capacity move different buffers: the construction check
    must tell them apart."""
    assert RailWaveConfig(max_tokens_per_rank=512).fingerprint()["max_tokens_per_rank"] == "512"
    assert RailWaveConfig().fingerprint()["max_tokens_per_rank"] == "None"


def test_config_chunks_reach_the_plan_and_the_fingerprint():
    cfg = RailWaveConfig.from_dict({"chunks": 3, "gpus_per_node": 2})
    assert cfg.plan_options(cfg.topology(8)).chunks == 3
    assert cfg.fingerprint()["chunks"] == "3" != RailWaveConfig().fingerprint()["chunks"]
