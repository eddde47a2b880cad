"""Planning: RailBalance quotas and proxies, wave schedules and per-path execution plans.

Pure functions of (topology, global demand counts, options): the same inputs give the same plan
on every rank; nothing here communicates.
"""

from megatron_railwave.planner.eligible import EligiblePolicy
from megatron_railwave.planner.flow import flow_relay_NNGG
from megatron_railwave.planner.plan import (
    PathPlan,
    PlanOptions,
    build_plan,
    chunk_sizes,
    relay_chunk_rows_NNGGC,
)
from megatron_railwave.planner.railbalance import (
    eligible_NNG,
    healthy_gpus_NG,
    rail_quota_NNG,
    relay_NNGG,
)
from megatron_railwave.planner.routes import (
    RankSplits,
    RecordRoutes,
    arrival_mask_counts_NGM,
    chunk_arrival_counts,
    delivery_copies_NGG,
    owner_egress_bounds,
    rank_splits,
    route_records,
)
from megatron_railwave.planner.waves import (
    WaveSchedule,
    all_at_once,
    bounded_fanin_schedule,
    cyclic_schedule,
    schedule_from_windows,
)

__all__ = [
    "EligiblePolicy",
    "flow_relay_NNGG",
    "PathPlan",
    "PlanOptions",
    "build_plan",
    "chunk_sizes",
    "relay_chunk_rows_NNGGC",
    "chunk_arrival_counts",
    "eligible_NNG",
    "healthy_gpus_NG",
    "rail_quota_NNG",
    "relay_NNGG",
    "RankSplits",
    "RecordRoutes",
    "delivery_copies_NGG",
    "owner_egress_bounds",
    "arrival_mask_counts_NGM",
    "rank_splits",
    "route_records",
    "WaveSchedule",
    "all_at_once",
    "bounded_fanin_schedule",
    "cyclic_schedule",
    "schedule_from_windows",
]
