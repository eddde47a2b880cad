"""scripts/gpu_check.sh on this CPU machine: its exit status is true (no CUDA device: 2 with a
clear line; a failing step: 1; all selected steps passing: 0), it writes one summary JSON, and
its step limits fit 8 minutes. The old script set ``status=1`` inside ``{ ... } | tee`` (a
subshell) and exited 0 after failures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    # A generous preflight limit: on this shared 2-core machine importing torch can take 30 s.
    full_env = {
        **os.environ,
        "OUT": str(out),
        "PY": sys.executable,
        "GPU_CHECK_PREFLIGHT_S": "300",
        "GPU_CHECK_LIMIT_SCALE": "10",
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=240,
        check=False,
    )
    summary = json.loads((out / "summary.json").read_text())
    return done, summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_without_cuda_exits_2_with_a_clear_line(tmp_path):
    done, summary = _run(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout
    assert summary["exit_status"] == 2
    assert summary["steps"] == [
        {
            "step": "preflight",
            "result": "FAIL",
            "seconds": summary["steps"][0]["seconds"],
            "limit_s": 300,
            "note": "no CUDA device",
        }
    ]


def test_a_failing_step_makes_the_exit_status_1(tmp_path):
    done, summary = _run(
        tmp_path, GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_ONLY="doctor", GPU_CHECK_FAIL_STEP="doctor"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    by_step = {s["step"]: s for s in summary["steps"]}
    assert by_step["doctor"]["result"] == "FAIL" and "exit status 3" in by_step["doctor"]["note"]
    assert by_step["build"]["result"] == "SKIP"
    assert summary["exit_status"] == 1
    assert "forced failure" in (tmp_path / "out" / "doctor.log").read_text()


def test_selected_steps_that_pass_exit_0(tmp_path):
    # The doctor step for real (it needs no GPU): PASS, its JSON written, exit status 0.
    done, summary = _run(tmp_path, GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_ONLY="doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    by_step = {s["step"]: s for s in summary["steps"]}
    assert by_step["doctor"]["result"] == "PASS"
    assert json.loads((tmp_path / "out" / "doctor.json").read_text())["self_test"]["ok"] is True


def test_the_whole_check_is_bounded_by_8_minutes_and_each_limit_is_stated():
    """The step limits may add up to more than 480 s (each measured step keeps >= 2x its measured
    CPU cost); the script cuts a step's limit to the time left of TOTAL_LIMIT_S = 480 and fails
    a step with no time left, so the check ends within 8 minutes either way."""
    text = SCRIPT.read_text()
    steps = re.findall(r"^step (\w+) (\d+) ", text, flags=re.M)
    assert [name for name, _ in steps[:2]] == ["doctor", "build"]
    assert steps[-1][0] == "virtual_glm_bf16"  # the unmeasured GLM step last
    preflight = int(
        re.search(r"^PREFLIGHT_S=\$\{GPU_CHECK_PREFLIGHT_S:-(\d+)\}", text, flags=re.M).group(1)
    )
    assert 'timeout -k 10 "$PREFLIGHT_S" "$PY" - > "$OUT/preflight.log"' in text
    assert 'timeout -k 10 "$limit" "$@"' in text
    assert "TOTAL_LIMIT_S=${GPU_CHECK_TOTAL_S:-480}" in text
    assert "local left=$((DEADLINE - SECONDS - 10))" in text
    total = preflight + sum(int(limit) for _, limit in steps)
    header = text.split("set -u")[0]
    assert f"({total} with the preflight)" in header
    for name, limit in steps:  # every step's limit and what was measured, in the header table
        assert re.search(rf"^#   {name} +{limit} s ", header, flags=re.M), name
    for phrase in ("NCCL across processes", "DeepEP", "rails"):
        assert phrase in header


def test_a_step_without_time_left_in_the_total_fails(tmp_path):
    # A 1 s total (x 10 by the test's limit scale): the preflight uses it up, so the doctor step
    # gets no time and fails by name instead of running past the total.
    done, summary = _run(
        tmp_path, GPU_CHECK_REQUIRE_CUDA="0", GPU_CHECK_ONLY="doctor", GPU_CHECK_TOTAL_S="1"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    by_step = {s["step"]: s for s in summary["steps"]}
    assert by_step["doctor"]["result"] == "FAIL"
    assert by_step["doctor"]["note"] == "no time left in the 1 s total"


def test_every_virtual_step_fits_its_stated_memory_budget():
    # The estimate the script's --max-memory-gib 110 refuses on, for each virtual-cluster step as
    # the script writes it; the old fixed-capacity case (C = T = 1024, H = 4096 bf16) does not fit.
    from megatron_railwave.cli import build_parser
    from megatron_railwave.lab.bench.virtual_exchange import VirtualSpec, estimate_peak_bytes
    from megatron_railwave.topology import load_topology

    text = SCRIPT.read_text()
    base = re.search(
        r'VIRTUAL=\("\$PY" -m megatron_railwave.cli (simulate-exchange[^)]*)\)', text
    ).group(1)
    base = base.replace("\n", " ").split()
    assert base[base.index("--max-memory-gib") + 1] == "110"
    calls = re.findall(
        r'^step (virtual_\w+) \d+ "\$\{VIRTUAL\[@\]\}" (.*?)--json', text, flags=re.M | re.S
    )
    assert len(calls) == 3
    parser = build_parser()
    topo = load_topology(ROOT / "megatron_railwave/configs/clusters/h800_4x8.yaml")
    for name, extra in calls:
        args = parser.parse_args(base + extra.replace("\\", " ").split())
        spec = VirtualSpec(
            topology=topo,
            tokens=args.tokens,
            hidden=args.hidden,
            experts=args.experts,
            topk=args.topk,
            dtype=args.dtype,
            max_tokens_per_rank=args.max_tokens_per_rank,
        )
        assert estimate_peak_bytes(spec) / 2**30 < 110, name
    old = VirtualSpec(
        topology=topo,
        tokens=1024,
        hidden=4096,
        experts=128,
        topk=8,
        dtype="bf16",
        max_tokens_per_rank=1024,
    )
    assert estimate_peak_bytes(old) / 2**30 > 139


def test_simulate_exchange_refuses_a_run_over_its_memory_limit(capsys):
    from megatron_railwave.cli import main

    with pytest.raises(SystemExit) as exc:
        main(
            [
                "simulate-exchange",
                "--cluster",
                str(ROOT / "megatron_railwave/configs/clusters/h800_4x8.yaml"),
                "--tokens",
                "8",
                "--hidden",
                "8",
                "--max-memory-gib",
                "0.0001",
            ]
        )
    assert exc.value.code == 2
    assert "estimated peak memory" in capsys.readouterr().err


def _small_simulate(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    from megatron_railwave.cli import main

    cluster = tmp_path / "c2x2.yaml"
    cluster.write_text("name: c2x2\nnum_nodes: 2\ngpus_per_node: 2\n")
    out = tmp_path / "sim.json"
    argv = ["simulate-exchange", "--cluster", str(cluster), "--tokens", "12", "--hidden", "8"]
    argv += ["--experts", "8", "--topk", "3", "--json", str(out), *extra]
    rc = main(argv)
    return rc, json.loads(out.read_text())


def test_expect_host_syncs_turns_the_counts_into_the_exit_status(tmp_path, capsys):
    # The device check asserts 1 host sync per layer in the normal mode and 0 in fixed-capacity
    # mode through this flag; a wrong expectation must fail the run.
    rc, report = _small_simulate(tmp_path, "--expect-host-syncs", "1")
    assert rc == 0 and report["ok"] and report["expected_host_syncs_per_layer"] == 1
    rc, report = _small_simulate(tmp_path, "--expect-host-syncs", "0")
    assert rc == 1 and report["ok"] is False and report["all_bitwise_equal"]
    assert "expected 0 on every path" in capsys.readouterr().out
    rc, _ = _small_simulate(tmp_path, "--max-tokens-per-rank", "16", "--expect-host-syncs", "0")
    assert rc == 0
    rc, _ = _small_simulate(tmp_path, "--max-tokens-per-rank", "16", "--expect-host-syncs", "1")
    assert rc == 1


def test_require_compiled_fails_on_the_fallback(tmp_path, monkeypatch, capsys):
    from megatron_railwave import ops
    from megatron_railwave.cli import main

    cluster = tmp_path / "c2x2.yaml"
    cluster.write_text("name: c2x2\nnum_nodes: 2\ngpus_per_node: 2\n")
    argv = ["simulate-exchange", "--cluster", str(cluster), "--tokens", "12", "--hidden", "8"]
    argv += ["--experts", "8", "--topk", "3", "--require-compiled"]
    if ops.compiled_for(torch.device("cpu")):
        assert main(argv) == 0
    monkeypatch.setattr(ops, "compiled_for", lambda device: False)
    assert main(argv) == 1
    assert "would time the pure-torch fallback" in capsys.readouterr().out


def test_every_virtual_step_asserts_compiled_ops_and_its_host_syncs():
    text = SCRIPT.read_text()
    base = re.search(r"VIRTUAL=\((.*?)\)", text, flags=re.S).group(1)
    assert "--require-compiled" in base
    calls = re.findall(
        r'^step (virtual_\w+) \d+ "\$\{VIRTUAL\[@\]\}" (.*?)--json', text, flags=re.M | re.S
    )
    assert calls
    for name, extra in calls:
        want = "0" if "--max-tokens-per-rank" in extra else "1"
        assert f"--expect-host-syncs {want}" in extra, name
