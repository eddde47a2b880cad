"""Shared cases of the online selector's unit tests (tests/unit/test_online_selector.py and
test_online_capacity.py): a 4 x 8 topology, its selector scales, true per-path times and
descriptors at a chosen payload and shape."""

from __future__ import annotations

import math

from megatron_railwave.names import Route
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import MiB, SelectorScales, TrafficStats

TOPO = RailTopology(num_nodes=4, gpus_per_node=8)
SCALES = SelectorScales().resolve(TOPO)
TRUE_S = {Route.NATIVE: 4e-3, Route.RAIL: 2.2e-3, Route.PERM: 3e-3, Route.JOINT: 2e-3}


def stats(b_mib: float, rho: float = 3.0, kappa: float = 2.0) -> TrafficStats:
    """Descriptors of a layer with mean payload ``b_mib`` MiB, rail skew ``rho`` and ``kappa``."""
    b = b_mib * MiB
    coords = (
        math.log2(b / SCALES[0]) if b > 0 else -math.inf,
        (rho - 1) / SCALES[1],
        (kappa - 1) / SCALES[2],
    )
    return TrafficStats(
        B_mean_bytes=b,
        B_max_bytes=b,
        rho_g=rho,
        kappa=kappa,
        coords=coords,
        records_total=0,
        remote_records=0,
    )
