"""``railwave doctor``: the report's parts, the NICs read from sysfs, the JSON and exit status."""

from __future__ import annotations

import json

from megatron_railwave.cli import main
from megatron_railwave.lab.bench import environment


def test_nics_from_a_sysfs_tree(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (tmp_path / "mlx5_0" / "device").mkdir()
    (tmp_path / "mlx5_0" / "device" / "numa_node").write_text("1\n")
    assert environment.read_nics(str(tmp_path)) == [
        {
            "device": "mlx5_0",
            "numa_node": "1",
            "ports": [
                {
                    "port": "1",
                    "state": "4: ACTIVE",
                    "rate": "400 Gb/sec (4X NDR)",
                    "link_layer": "InfiniBand",
                }
            ],
        }
    ]
    assert environment.read_nics(str(tmp_path / "absent")) == []


def test_doctor_json_without_self_test(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--no-self-test", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "railwave.doctor/1"
    assert report["versions"]["torch"] and report["compiled_ops"]["cpu"] in (True, False)
    assert report["railwave_config"]["source"] in ("defaults", report["railwave_config"]["source"])
    assert "self_test" not in report
    assert "railwave doctor: versions" in capsys.readouterr().out


def test_doctor_names_a_config_that_does_not_load(tmp_path, capsys):
    assert main(["doctor", "--no-self-test", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_doctor_self_test_passes_here():
    st = environment.self_test()
    assert st["ok"] is True and st["all_bitwise_equal"] is True and st["max_rel_error"] <= 1e-5
