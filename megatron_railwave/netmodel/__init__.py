"""Flow-level network model: max-min fair sharing with an incast penalty.

Shape letters: L links, F flows, H hops per flow (padded), Q phases, S samples.

`simulate` runs a `FlowSet` on a `Network` under a `PhaseGraph` of start conditions and an
`IncastModel` (receiver-port goodput and per-phase latency); see `maxmin` for the algorithm,
`problem` for the input and output types and `incast` for the stated penalty. `simgrid_check` (run by the system python3) replays a
flow set in SimGrid for cross-checks; `bench_engine` times the engine.
"""

from megatron_railwave.netmodel.incast import IncastModel, alpha_from_slowdowns, fit_incast_alpha
from megatron_railwave.netmodel.maxmin import simulate
from megatron_railwave.netmodel.problem import (
    FlowSet,
    Network,
    PhaseGraph,
    SimResult,
    TraceSegment,
    links_from_csr,
)

__all__ = [
    "FlowSet",
    "IncastModel",
    "Network",
    "PhaseGraph",
    "SimResult",
    "TraceSegment",
    "alpha_from_slowdowns",
    "fit_incast_alpha",
    "links_from_csr",
    "simulate",
]
