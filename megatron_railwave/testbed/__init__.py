"""Network-namespace testbed: a rail-optimized cluster of shaped veth NICs on one Linux host.

Letters: N nodes, G GPUs per node (= rails R), W = N * G worker processes.
"""

from megatron_railwave.testbed.netns import (
    TestbedSpec,
    check_prerequisites,
    down,
    fail_rail,
    list_leftovers,
    nic_counters,
    restore_rail,
    up,
)

__all__ = [
    "TestbedSpec",
    "check_prerequisites",
    "down",
    "fail_rail",
    "list_leftovers",
    "nic_counters",
    "restore_rail",
    "up",
]
