"""The k-to-1 incast probe: the alpha fit on known slowdowns, and the command on gloo processes."""

import json

import pytest

from megatron_railwave.bench.incast_probe import summarize_incast_probe
from megatron_railwave.cli import main
from megatron_railwave.netmodel import IncastModel, load_netmodel_config


def _times(alpha: float, nodes: int = 5, one_s: float = 0.01) -> dict[int, list[float]]:
    """What a fabric with the flow model's saturating law would measure: k senders share a port
    (k x the one-sender time) and lose goodput by the law's factor."""
    law = IncastModel(alpha=alpha, k_free=1, k_sat=2)
    return {k: [k * one_s * float(law.slowdown(k))] * 3 for k in range(1, nodes)}


@pytest.mark.parametrize("alpha", [0.0, 0.25, 4.9121])
def test_summary_recovers_the_alpha_of_the_law(alpha):
    out = summarize_incast_probe(_times(alpha), nbytes=1 << 20)
    assert out["alpha"] == pytest.approx(alpha, abs=1e-9)
    assert out["goodput_at_3_senders"] == pytest.approx(1 / (1 + 2 * alpha))
    assert [r["senders"] for r in out["rows"]] == [1, 2, 3, 4]
    assert out["rows"][0]["slowdown"] == 1.0
    # one receiver port's goodput: k x bytes over the time
    assert out["rows"][1]["port_goodput_gbps"] == pytest.approx(2 * (1 << 20) * 8 / out["rows"][1]["median_s"] / 1e9)


def test_summary_needs_a_second_sender_count():
    with pytest.raises(ValueError, match="k > 1"):
        summarize_incast_probe({1: [0.01]}, nbytes=8)


def test_probe_incast_command_on_local_gloo_processes(tmp_path, capsys):
    out, model = tmp_path / "probe.json", tmp_path / "fabric.yaml"
    assert main(["probe-incast", "--local", "3,1", "--nbytes", "65536", "--repeats", "2", "--warmups", "0",
                 "--json", str(out), "--write-model", str(model)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "railwave.incast_probe/1" and (data["nodes"], data["gpus_per_node"]) == (3, 1)
    assert [r["senders"] for r in data["rows"]] == [1, 2] and all(len(v) == 2 for v in data["samples_s"].values())
    assert data["alpha"] >= 0
    written = load_netmodel_config(model)
    assert written.alpha == round(data["alpha"], 4) and written.k_sat == 2
    assert "mechanics only" in capsys.readouterr().out


def test_probe_incast_refuses_too_few_nodes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["probe-incast", "--local", "2,2"])
    assert exc.value.code == 2 and "N >= 3" in capsys.readouterr().err
