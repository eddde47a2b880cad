"""Execution of path plans: rank programs that follow the ``ExecutionSchedule``, driven over
torch.distributed (``Exchange``) or in one process (``VirtualCluster``).

``Exchange`` (``driver``) owns what every backend shares (count exchange, planning, autograd,
asynchronous form, timing reduce) and drives one ``ExchangeBackend`` (``base``). Two sibling
backends: the torch.distributed one (``TorchDistBackend`` / ``TorchDistExchange``; run on gloo,
CPU, only) and DeepEP's internode dispatch / combine (``DeepEPBackend`` / ``DeepEPExchange``; run
only against the CPU fake of ``testing.deepep_fake``, not yet on hardware). ``build_exchange``
picks one (backend torch | deepep | auto).
"""

from megatron_railwave.exchange.backend import build_exchange
from megatron_railwave.exchange.base import ExchangeBackend
from megatron_railwave.exchange.capacity import (
    PaddedEntries,
    capacity_demand,
    capacity_layer,
    capacity_plan,
    check_capacity,
)
from megatron_railwave.exchange.deepep import (
    DeepEPBackend,
    DeepEPExchange,
    destroy_deepep_buffers,
)
from megatron_railwave.exchange.driver import DispatchOutput, Exchange
from megatron_railwave.exchange.groups import (
    RankGroups,
    build_rail_groups,
    rank_groups,
    survey_unresponsive,
    virtual_rank_groups,
)
from megatron_railwave.exchange.layer import (
    CapacityOverflowError,
    EntryIndex,
    InputError,
    LayerDemand,
    LayerHandle,
    RankContext,
    combine_backward,
    combine_forward,
    dispatch_backward,
    dispatch_forward,
    gather_demand,
    prepare_capacity_layer,
    prepare_layer,
)
from megatron_railwave.exchange.placement import (
    ConfigMismatchError,
    Placement,
    PlacementError,
    RankFacts,
    check_fingerprints,
    gather_rank_facts,
    identity_placement,
    place_ranks,
)
from megatron_railwave.exchange.timing_reduce import (
    TIMING_REDUCE_BYTES,
    PostedTimingReduce,
    post_timing_reduce,
)
from megatron_railwave.exchange.torch_dist import (
    ExchangeHandle,
    TorchDistBackend,
    TorchDistExchange,
)
from megatron_railwave.exchange.transport import (
    ExchangeError,
    ExchangeTimeoutError,
    TorchDistTransport,
    drive,
)
from megatron_railwave.exchange.virtual import PhaseEvent, VirtualCluster

__all__ = [
    "build_exchange",
    "Exchange",
    "ExchangeBackend",
    "DeepEPBackend",
    "DeepEPExchange",
    "destroy_deepep_buffers",
    "RankGroups",
    "build_rail_groups",
    "rank_groups",
    "survey_unresponsive",
    "virtual_rank_groups",
    "ConfigMismatchError",
    "Placement",
    "PlacementError",
    "RankFacts",
    "check_fingerprints",
    "gather_rank_facts",
    "identity_placement",
    "place_ranks",
    "PaddedEntries",
    "capacity_demand",
    "capacity_layer",
    "capacity_plan",
    "check_capacity",
    "CapacityOverflowError",
    "prepare_capacity_layer",
    "EntryIndex",
    "InputError",
    "LayerDemand",
    "LayerHandle",
    "RankContext",
    "gather_demand",
    "prepare_layer",
    "dispatch_forward",
    "dispatch_backward",
    "combine_forward",
    "combine_backward",
    "TIMING_REDUCE_BYTES",
    "PostedTimingReduce",
    "post_timing_reduce",
    "DispatchOutput",
    "ExchangeHandle",
    "TorchDistBackend",
    "TorchDistExchange",
    "ExchangeError",
    "ExchangeTimeoutError",
    "TorchDistTransport",
    "drive",
    "PhaseEvent",
    "VirtualCluster",
]
