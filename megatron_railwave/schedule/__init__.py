"""The execution schedule: a ``PathPlan`` compiled into ordered phases, transfers and the record
wire format. The one truth that the exchange executes, the flow model simulates and the byte
counters count. Pure: no communication, host tensors only.
"""

from megatron_railwave.schedule.execution import (
    Direction,
    ExecutionSchedule,
    MaskSource,
    Phase,
    PhaseKind,
    compile_schedule,
)
from megatron_railwave.schedule.for_rank import RankSchedule, compile_for_rank
from megatron_railwave.schedule.rank_view import PhaseCounts, RankView, rank_view
from megatron_railwave.schedule.wire import (
    META_FIXED_WORDS,
    ROUTING_BITS_PER_WORD,
    RecordWireFormat,
)

__all__ = [
    "Direction",
    "ExecutionSchedule",
    "MaskSource",
    "Phase",
    "PhaseKind",
    "compile_schedule",
    "PhaseCounts",
    "RankView",
    "rank_view",
    "RankSchedule",
    "compile_for_rank",
    "RecordWireFormat",
    "META_FIXED_WORDS",
    "ROUTING_BITS_PER_WORD",
]
