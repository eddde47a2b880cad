"""Which rails RailBalance may use: the eligible-rail policies."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["EligiblePolicy"]


class EligiblePolicy(StrEnum):
    """Which rails of a source node RailBalance may use for one destination.

    ALL: every healthy rail. ACTIVE: the healthy rails whose GPU already sends to that destination
    (all healthy ones when none does). MASK: an explicit per-(node, GPU) mask, AND healthy.
    Failed rails are never eligible.
    """

    ALL = "all"
    ACTIVE = "active"
    MASK = "mask"
