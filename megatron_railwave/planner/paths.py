"""The four execution paths and the rail-eligibility policies."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Path", "EligiblePolicy", "parse_path"]


class Path(StrEnum):
    """How one phase is executed; all four move the same records and give the same results.

    NATIVE: every record leaves on its owner GPU's rail, all node pairs at once.
    RAIL: RailBalance (spread each node pair over the eligible rails), all pairs at once.
    PERM: owner rails, node pairs in one-to-one (or bounded fan-in) waves.
    JOINT: RailBalance inside each wave.
    """

    NATIVE = "native"
    RAIL = "rail"
    PERM = "perm"
    JOINT = "joint"

    @property
    def balanced(self) -> bool:
        return self in (Path.RAIL, Path.JOINT)

    @property
    def waved(self) -> bool:
        return self in (Path.PERM, Path.JOINT)


_ALIASES = {
    "native": Path.NATIVE,
    "rail": Path.RAIL,
    "rail-only": Path.RAIL,
    "rail_only": Path.RAIL,
    "perm": Path.PERM,
    "permutation": Path.PERM,
    "permutation-only": Path.PERM,
    "permutation_only": Path.PERM,
    "joint": Path.JOINT,
}


def parse_path(name: str | Path) -> Path:
    """Path from its name (case-insensitive; paper names such as 'RAIL-ONLY' accepted)."""
    if isinstance(name, Path):
        return name
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(
            f"unknown path {name!r}; choose one of native, rail, perm, joint (or 'auto' where the "
            "selector is allowed)"
        )
    return _ALIASES[key]


class EligiblePolicy(StrEnum):
    """Which rails of a source node RailBalance may use for one destination.

    ALL: every healthy rail. ACTIVE: the healthy rails whose GPU already sends to that destination
    (all healthy ones when none does). MASK: an explicit per-(node, GPU) mask, AND healthy.
    Failed rails are never eligible.
    """

    ALL = "all"
    ACTIVE = "active"
    MASK = "mask"
