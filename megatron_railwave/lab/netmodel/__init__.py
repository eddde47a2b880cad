"""Flow-level network model: max-min fair sharing with an incast penalty.

Shape letters: L links, F flows, H hops per flow (padded), Q phases, S samples.

`simulate` runs a `FlowSet` on a `Network` under a `PhaseGraph` of start conditions and an
`IncastModel` (receiver-port goodput and per-phase latency); see `maxmin` for the algorithm,
`problem` for the input and output types and `incast` for the stated penalty. `simgrid_check`
(run by the system python3) replays a flow set in SimGrid: a solver check of the engine;
`bench_engine` times the engine.
`cluster` builds the links of a rail-optimized cluster; `program` turns phases and transfers into
flows on them and runs them in one simulation with their bandwidth lower bound; `execute` runs a
`PathPlan`'s compiled `ExecutionSchedule` (`execute_plan`, `simulate_plan`, `execute_schedule`);
`bounds` gives the two path-independent lower bounds of an input (per-record routing, any
routing); `peers` models DeepEP direct, Megatron's all-to-all (NCCL's rotating rounds or flat)
and a FAST-style per-layer schedule on the same links; `sensitivity` fits the incast alpha on
UltraEP alone and runs the sensitivity grid; `calibrate`
replays UltraEP (and keeps the withdrawn replay fit) (docs/netmodel.md).
"""

from megatron_railwave.lab.netmodel.bounds import (
    AnyRoutingBound,
    IdealBound,
    OwnerTokens,
    PerRecordBound,
    any_routing_bound,
    ideal_bound,
    owner_tokens_from_topk_ids,
    per_record_bound,
)
from megatron_railwave.lab.netmodel.cluster import Fabric, build_fabric
from megatron_railwave.lab.netmodel.execute import (
    MaskSource,
    NetModelConfig,
    PlanTiming,
    execute_plan,
    execute_schedule,
    load_netmodel_config,
    simulate_plan,
)
from megatron_railwave.lab.netmodel.incast import (
    IncastModel,
    alpha_from_slowdowns,
    fit_incast_alpha,
)
from megatron_railwave.lab.netmodel.maxmin import simulate
from megatron_railwave.lab.netmodel.problem import (
    FlowSet,
    Network,
    PhaseGraph,
    SimResult,
    TraceSegment,
    links_from_csr,
)

__all__ = [
    "AnyRoutingBound",
    "IdealBound",
    "OwnerTokens",
    "PerRecordBound",
    "any_routing_bound",
    "ideal_bound",
    "owner_tokens_from_topk_ids",
    "per_record_bound",
    "Fabric",
    "MaskSource",
    "NetModelConfig",
    "PlanTiming",
    "build_fabric",
    "execute_plan",
    "execute_schedule",
    "load_netmodel_config",
    "simulate_plan",
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
