"""Packaged files by name (``presets``) and paths inside a config file relative to that file."""

from __future__ import annotations

import os

import pytest
import yaml

from megatron_railwave import presets
from megatron_railwave.config import load_config
from megatron_railwave.topology import load_topology


def test_packaged_names_of_every_kind():
    assert presets.packaged_names("clusters") == ["cpu_2x1", "h20_4x8", "h800_4x8"]
    assert presets.KINDS == ("clusters", "railwave", "netmodel")  # the anchors files are retired
    assert presets.packaged_names("railwave") == ["glm45_air_h800"]
    assert "h800_4x8_paper_incast" in presets.packaged_names("netmodel")
    # The package's own folder, whatever the working directory.
    assert presets.packaged_dir("clusters").parts[-3:] == (
        "megatron_railwave",
        "configs",
        "clusters",
    )


def test_bare_names_only():
    assert presets.is_bare_name("h800_4x8")
    for path in ("h800_4x8.yaml", "./h800_4x8", "clusters/h800_4x8", "x.yml", ""):
        assert not presets.is_bare_name(path), path
    assert presets.packaged_file("clusters", "h800_4x8.yaml") is None
    assert presets.packaged_file("clusters", "h900_64x8") is None


def test_resolve_prefers_an_existing_file_and_lists_the_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert presets.resolve("h800_4x8", "clusters", "cluster") == (
        presets.packaged_dir("clusters") / "h800_4x8.yaml"
    )
    (tmp_path / "h800_4x8").write_text("num_nodes: 2\ngpus_per_node: 2\n")
    assert presets.resolve("h800_4x8", "clusters", "cluster").resolve() == tmp_path / "h800_4x8"
    with pytest.raises(ValueError, match=r"cluster 'sub' is a directory"):
        (tmp_path / "sub").mkdir()
        presets.resolve("sub", "clusters", "cluster")
    with pytest.raises(
        ValueError,
        match=r"cluster file 'h900' does not exist and is not a preset name "
        r"\(presets: cpu_2x1, h20_4x8, h800_4x8\)",
    ):
        presets.resolve("h900", "clusters", "cluster")


def test_presets_and_example_config_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_topology("cpu_2x1").world_size == 2
    cfg = load_config("glm45_air_h800")  # the packaged example config, by name
    assert cfg.cluster == "h800_4x8" and cfg.topology(32).name == "h800_4x8"
    with pytest.raises(ValueError, match=r"does not exist \(packaged example configs, by name: "):
        load_config("glm46")


def _write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_config_file_reads_its_files_relative_to_itself(tmp_path, monkeypatch):
    cluster = yaml.safe_load((presets.packaged_dir("clusters") / "cpu_2x1.yaml").read_text())
    _write(tmp_path / "job" / "clusters" / "mine.yaml", {**cluster, "name": "mine"})
    config = _write(
        tmp_path / "job" / "railwave" / "rw.yaml",
        {
            "cluster": "../clusters/mine.yaml",
            "path": "auto",
            "log_dir": "logs",
        },
    )
    monkeypatch.chdir(tmp_path)  # the cluster path does not exist relative to the working dir
    cfg = load_config(os.path.relpath(config))
    assert load_topology(cfg.cluster).name == "mine"
    assert cfg.log_dir == "logs"  # what the job writes stays relative to the working directory
    # A bare name is a preset unless the config's folder holds a file of that name.
    bare = _write(tmp_path / "job" / "bare.yaml", {"cluster": "h800_4x8"})
    assert load_config(bare).cluster == "h800_4x8"


def test_a_missing_file_in_a_config_file_is_named_from_that_file(tmp_path, monkeypatch):
    config = _write(tmp_path / "job" / "rw.yaml", {"cluster": "clusters/none.yaml"})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as exc:
        load_config(config)
    assert f"cluster file {str(tmp_path / 'job' / 'clusters' / 'none.yaml')!r} does not exist" in (
        str(exc.value)
    )


def test_netmodel_parameters_by_name():
    from megatron_railwave.lab.netmodel import load_netmodel_config

    path = presets.packaged_dir("netmodel") / "h800_4x8_paper_incast.yaml"
    assert load_netmodel_config("h800_4x8_paper_incast") == load_netmodel_config(path)
    with pytest.raises(ValueError, match=r"netmodel config file 'h900' does not exist"):
        load_netmodel_config("h900")
