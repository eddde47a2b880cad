"""Execution of path plans: torch.distributed (NCCL/gloo) and, optionally, DeepEP."""

from .groups import RailGroups, build_rail_groups
from .p2p import ExchangeTimeoutError
from .torch_dist import DispatchOutput, ExchangeHandle, InputError, TorchDistExchange

__all__ = ["RailGroups", "build_rail_groups", "ExchangeTimeoutError", "DispatchOutput", "ExchangeHandle", "InputError",
           "TorchDistExchange"]
