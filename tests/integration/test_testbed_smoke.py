"""Network-namespace testbed: bring-up, rail/node groups, byte counters, shaping, clean-up.

Letters: N nodes, G GPUs per node (= rails). Needs root, ip and tc; skipped otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megatron_railwave.lab.testbed import (
    TestbedSpec,
    check_prerequisites,
    down,
    fail_rail,
    list_leftovers,
    nic_counters,
    restore_rail,
    up,
)
from megatron_railwave.lab.testbed.launch import run_workers
from megatron_railwave.lab.testbed.probes import incast_goodput

_REASON = check_prerequisites()
pytestmark = [
    pytest.mark.testbed,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


@pytest.fixture
def testbed_2x2():
    spec = up(TestbedSpec(nodes=2, gpus_per_node=2, prefix="rwt"))
    try:
        yield spec
    finally:
        down(spec)
    assert list_leftovers(spec) == []


def test_testbed_alltoall_in_rail_and_node_groups_uses_expected_nics(testbed_2x2):
    spec = testbed_2x2
    rail_numel, node_numel = 16384, 65536  # float32 per peer: 64 KiB on rails, 256 KiB on lo
    t0 = time.perf_counter()
    before = nic_counters(spec)
    results = run_workers(
        spec,
        "megatron_railwave.lab.testbed.probes:alltoall_check",
        {"rail_numel": rail_numel, "node_numel": node_numel},
        timeout_s=60,
    )
    after = nic_counters(spec)
    print(f"\n2x2 smoke run (rendezvous + groups + all_to_all): {time.perf_counter() - t0:.2f} s")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["rail_bad"] == 0 and r["node_bad"] == 0 for r in results), results
    # Rail group l = {(0, l), (1, l)} sends 64 KiB * (l + 1) per peer: NIC (n, 0) sends and
    # receives 64 KiB, NIC (n, 1) 128 KiB (plus headers and a few KiB of control). Node-group
    # bytes (256 KiB per peer) must not show up on any NIC.
    node_bytes = node_numel * 4
    for key in sorted(after):
        rail_bytes = rail_numel * 4 * (key[1] + 1)
        tx = after[key][0] - before[key][0]
        rx = after[key][1] - before[key][1]
        print(f"NIC {key}: tx {tx} B, rx {rx} B (rail payload {rail_bytes} B)")
        assert rail_bytes <= tx < rail_bytes * 1.1 + 20_000 < rail_bytes + node_bytes, (key, tx)
        assert rail_bytes <= rx < rail_bytes * 1.1 + 20_000 < rail_bytes + node_bytes, (key, rx)


def test_testbed_worker_failure_raises_with_stderr_tail(testbed_2x2):
    with pytest.raises(RuntimeError, match=r"(?s)rank \d .*No module named 'no_such_module_rw'"):
        run_workers(testbed_2x2, "no_such_module_rw:main", {}, timeout_s=30)


def test_testbed_hard_timeout_kills_workers(testbed_2x2):
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"timeout_s=3.*ranks still running: \[0, 1, 2, 3\]"):
        run_workers(
            testbed_2x2,
            "megatron_railwave.lab.testbed.probes:sleep_probe",
            {"seconds": 120},
            timeout_s=3,
        )
    assert time.perf_counter() - t0 < 20
    # No worker survives inside the namespaces.
    for node in range(testbed_2x2.nodes):
        pids = subprocess.run(
            ["ip", "netns", "pids", testbed_2x2.node_ns(node)], capture_output=True, text=True
        ).stdout.split()
        assert pids == []


def test_testbed_fail_and_restore_rail(testbed_2x2):
    spec = testbed_2x2

    def operstate(node: int, rail: int) -> str:
        out = subprocess.run(
            ["ip", "-n", spec.node_ns(node), "-j", "link", "show", spec.rail_ifname(rail)],
            capture_output=True,
            text=True,
        ).stdout
        return json.loads(out)[0]["operstate"]

    fail_rail(spec, 1, 1)
    assert operstate(1, 1) == "DOWN"
    restore_rail(spec, 1, 1)
    assert operstate(1, 1) == "UP"
    results = run_workers(
        spec,
        "megatron_railwave.lab.testbed.probes:alltoall_check",
        {"rail_numel": 256, "node_numel": 256},
        timeout_s=60,
    )
    assert all(r["rail_bad"] == 0 and r["node_bad"] == 0 for r in results), results
    with pytest.raises(ValueError, match=r"\(node, rail\) = \(2, 0\) is outside"):
        fail_rail(spec, 2, 0)


# prints goodputs only (~55 s on a loaded 2-core host); `testbed run --incast` measures them
@pytest.mark.slow
def test_testbed_shaped_rail_and_incast_throughput_printed():
    spec = up(TestbedSpec(nodes=4, gpus_per_node=1, prefix="rwt"))
    try:
        for fan_in in (1, 2, 3):
            r = incast_goodput(spec, fan_in, nbytes=1 << 20, repeats=3)
            print(
                f"\n{fan_in}-to-1 into one {spec.rail_mbit:.0f} Mbit/s port "
                f"(buffer {spec.port_buffer_bytes} B): goodput {r['goodput_mbit']:.1f} Mbit/s "
                f"= {r['goodput_over_rate']:.2f} x rate, times "
                f"{[round(t, 3) for t in r['times_s']]}"
            )
            assert r["goodput_mbit"] > 0
    finally:
        down(spec)
    assert list_leftovers(spec) == []


_CRASH_SCRIPT = """
import os, sys
from megatron_railwave.lab.testbed import TestbedSpec, up
spec = up(TestbedSpec(nodes=2, gpus_per_node=2, prefix=sys.argv[1], run_id=sys.argv[2]))
print("UP", flush=True)
os._exit(3)  # a crash: no atexit, no signal handler, nothing cleaned
"""


def test_testbed_down_by_prefix_removes_leftovers_after_crash():
    prefix, run_id = "rwc", f"{int(time.time() * 1000) % 0xFFFF:x}"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, prefix, run_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and "UP" in proc.stdout, proc.stderr
    name = prefix + run_id
    assert len(list_leftovers(name)) == 3  # fabric + 2 node namespaces survived the crash
    removed = down(name)
    assert sorted(removed) == sorted([f"{name}-fab", f"{name}-n0", f"{name}-n1"])
    assert list_leftovers(name) == []


def test_testbed_sigterm_cleans_up():
    prefix, run_id = "rwc", f"{(int(time.time() * 1000) + 7) % 0xFFFF:x}"
    script = _CRASH_SCRIPT.replace("os._exit(3)", "import time; time.sleep(60)")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, prefix, run_id],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "UP"
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    leftovers = list_leftovers(prefix + run_id)
    down(prefix + run_id)
    assert leftovers == []


def test_testbed_spec_rejects_bad_prefix_and_longest_names_fit():
    with pytest.raises(ValueError, match="prefix must be 1-4 lowercase .* got 'Rail-'"):
        TestbedSpec(nodes=2, gpus_per_node=2, prefix="Rail-")
    spec = TestbedSpec(nodes=250, gpus_per_node=64, prefix="abcd", run_id="ffff")
    assert len(spec.switch_ifname(249, 63)) == 15
