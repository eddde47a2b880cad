"""The k-to-1 incast probe: the alpha fit on known slowdowns, and the command on gloo processes."""

import json

import pytest

from megatron_railwave.cli import main
from megatron_railwave.lab.bench.incast_probe import summarize_incast_probe
from megatron_railwave.lab.netmodel import IncastModel, load_netmodel_config


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
    assert out["rows"][1]["port_goodput_gbps"] == pytest.approx(
        2 * (1 << 20) * 8 / out["rows"][1]["median_s"] / 1e9
    )


def test_summary_with_the_line_rate_reads_a_sender_that_cannot_fill_the_port():
    """One sender reaches half the port; the fabric loses goodput with alpha 1. Against k x t(1)
    the loss would hide (two senders merely fill the port); against the line rate it shows."""
    nbytes, port_gbps = 1 << 20, 8.0
    full = nbytes * 8 / (port_gbps * 1e9)  # one sender's bytes at line rate
    law = IncastModel(alpha=1.0, k_free=1, k_sat=2)
    times = {k: [max(2 * full, k * full) * float(law.slowdown(k))] for k in (1, 2, 3)}
    with_rate = summarize_incast_probe(times, nbytes, port_gbps=port_gbps)
    assert with_rate["alpha"] == pytest.approx(1.0) and with_rate["sender_limited"]
    assert with_rate["fitted_senders"] == [2, 3]
    assert summarize_incast_probe(times, nbytes)["alpha"] < 0.5  # what k x t(1) alone would say


def test_summary_needs_a_second_sender_count():
    with pytest.raises(ValueError, match="k > 1"):
        summarize_incast_probe({1: [0.01]}, nbytes=8)


def test_probe_incast_command_on_local_gloo_processes(tmp_path, capsys):
    out, model = tmp_path / "probe.json", tmp_path / "fabric.yaml"
    assert (
        main(
            [
                "probe-incast",
                "--local",
                "3,1",
                "--nbytes",
                "65536",
                "--repeats",
                "2",
                "--warmups",
                "0",
                "--json",
                str(out),
                "--write-model",
                str(model),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["schema"] == "railwave.incast_probe/1" and (
        data["nodes"],
        data["gpus_per_node"],
    ) == (3, 1)
    assert [r["senders"] for r in data["rows"]] == [1, 2] and all(
        len(v) == 2 for v in data["samples_s"].values()
    )
    assert data["alpha"] >= 0
    written = load_netmodel_config(model)
    assert written.alpha == round(data["alpha"], 4) and written.k_sat == 2
    assert "mechanics only" in capsys.readouterr().out
    # --max-senders bounds k (and node 0's receive buffers)
    assert (
        main(
            [
                "probe-incast",
                "--local",
                "4,1",
                "--nbytes",
                "4096",
                "--repeats",
                "1",
                "--warmups",
                "0",
                "--max-senders",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert [r["senders"] for r in json.loads(out.read_text())["rows"]] == [1, 2]


def test_probe_incast_torchrun_refuses_a_rank_layout_it_cannot_map(monkeypatch, capsys):
    # rank 1 on its machine's second GPU while G = 1 says every GPU is its own node: refused
    # before any process group is set up
    for key, value in {
        "WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "3",
        "RANK": "1",
        "LOCAL_RANK": "1",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        main(["probe-incast", "--torchrun", "--gpus-per-node", "1"])
    assert exc.value.code == 2 and "--nproc-per-node G" in capsys.readouterr().err


def test_probe_incast_refuses_too_few_nodes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["probe-incast", "--local", "2,2"])
    assert exc.value.code == 2 and "N >= 3" in capsys.readouterr().err
