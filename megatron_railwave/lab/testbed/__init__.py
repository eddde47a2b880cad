"""Network-namespace testbed: a rail-optimized cluster of shaped veth NICs on one Linux host.

Letters: N nodes, G GPUs per node (= rails R), W = N * G worker processes.

    spec = up(TestbedSpec(nodes=2, gpus_per_node=2))      # namespaces, bridges, tc
    results = run_workers(spec, "pkg.mod:fn", {...}, 60)   # fn(ctx, **args) in every rank
    down(spec)                                             # or down("rw") after a crash

Inside a worker, :func:`make_groups` returns node groups (loopback) and rail groups (rail NICs).
Needs root, ``ip`` and ``tc``; :func:`check_prerequisites` says what is missing.
"""

from megatron_railwave.lab.testbed.launch import (
    RailGroups,
    WorkerContext,
    current_context,
    make_control_group,
    make_groups,
    run_workers,
)
from megatron_railwave.lab.testbed.netns import (
    TestbedSpec,
    check_prerequisites,
    down,
    fail_rail,
    forget_spec,
    list_leftovers,
    load_spec,
    nic_counters,
    restore_rail,
    save_spec,
    up,
)
from megatron_railwave.lab.testbed.probes import incast_goodput

__all__ = [
    "RailGroups",
    "TestbedSpec",
    "WorkerContext",
    "check_prerequisites",
    "current_context",
    "down",
    "fail_rail",
    "forget_spec",
    "incast_goodput",
    "list_leftovers",
    "load_spec",
    "make_control_group",
    "make_groups",
    "nic_counters",
    "restore_rail",
    "run_workers",
    "save_spec",
    "up",
]
