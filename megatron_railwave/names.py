"""The names a user writes: execution routes and exchange backends. One source of truth.

Every config check, CLI flag, log field and report reads the names from here, so a route or a
backend is added (or renamed) in one place. ``Route`` is the execution path of one layer call
(the paper's NATIVE, RAIL-ONLY, PERMUTATION-ONLY and JOINT, and FLOW, the min-max routing of
issue 43, in one pass or in waves); the enum is not called ``Path``, so
that ``pathlib.Path`` keeps its name everywhere.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, NamedTuple, get_args

__all__ = [
    "AUTO",
    "Backend",
    "BackendName",
    "BACKEND_NAMES",
    "Candidate",
    "STREAMED_SUFFIX",
    "parse_candidate",
    "Route",
    "RouteChoice",
    "ROUTES",
    "PAPER_ROUTES",
    "ROUTE_CHOICES",
    "parse_route",
    "route_list",
]

AUTO = "auto"
"""The choice that lets RailWave pick: the selector for a route, the job's environment for a
backend."""


class Route(StrEnum):
    """How one layer call is executed; every route moves the same records and gives the same
    results, bit for bit.

    NATIVE: every record leaves on its owner GPU's rail, all node pairs at once.
    RAIL: RailBalance (each node pair spread over the eligible rails), all pairs at once.
    PERM: owner rails, node pairs in one-to-one (or bounded fan-in) waves.
    JOINT: RailBalance inside each wave.
    FLOW: min-max routing (``planner.flow``: each owner's records split over the eligible rails
        so that the most loaded NVLink / NIC direction of any GPU is as light as the heuristic
        finds), all pairs at once.
    FLOW_WAVES: the min-max routing inside each of the permutation waves.
    """

    NATIVE = "native"
    RAIL = "rail"
    PERM = "perm"
    JOINT = "joint"
    FLOW = "flow"
    FLOW_WAVES = "flow-waves"

    @property
    def balanced(self) -> bool:
        """RailBalance spreads the records over the rails (equal quotas; not the min-max plan)."""
        return self in (Route.RAIL, Route.JOINT)

    @property
    def min_max(self) -> bool:
        """The min-max relay plan (``planner.flow``) spreads the records over the rails."""
        return self in (Route.FLOW, Route.FLOW_WAVES)

    @property
    def waved(self) -> bool:
        """Node pairs travel in permutation waves."""
        return self in (Route.PERM, Route.JOINT, Route.FLOW_WAVES)


ROUTES: tuple[Route, ...] = tuple(Route)
"""Every route, in declaration order (reports and parametrized tests walk this)."""

PAPER_ROUTES: tuple[Route, ...] = (Route.NATIVE, Route.RAIL, Route.PERM, Route.JOINT)
"""The paper's four paths: what its cost tables and the lab's comparisons are about."""

RouteChoice = Literal["auto", "native", "rail", "perm", "joint", "flow", "flow-waves"]
"""What a config's ``path`` may say: a route, or 'auto' (the selector picks per layer call)."""

ROUTE_CHOICES: tuple[str, ...] = (AUTO, *(str(r) for r in ROUTES))

_ROUTE_ALIASES = {
    **{str(r): r for r in ROUTES},
    "rail-only": Route.RAIL,
    "rail_only": Route.RAIL,
    "permutation": Route.PERM,
    "permutation-only": Route.PERM,
    "permutation_only": Route.PERM,
    "flow_waves": Route.FLOW_WAVES,
    "flowwaves": Route.FLOW_WAVES,
}


def route_list(*, auto: bool = False, extra: tuple[str, ...] = ()) -> str:
    """The route names as a user reads them in an error or a help text: 'native, rail, perm,
    joint, flow, flow-waves' (with 'auto' first, or ``extra`` names last)."""
    names = ((AUTO,) if auto else ()) + tuple(str(r) for r in ROUTES) + tuple(extra)
    return ", ".join(names)


def parse_route(name: str | Route) -> Route:
    """The route of a name (case-insensitive; the paper's names such as 'RAIL-ONLY' accepted).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, Route):
        return name
    key = str(name).strip().lower()
    if key not in _ROUTE_ALIASES:
        raise ValueError(
            f"unknown path {name!r}; choose one of {route_list()} (or 'auto' where the selector is "
            "allowed)"
        )
    return _ROUTE_ALIASES[key]


STREAMED_SUFFIX = "+streamed"
"""A candidate's name suffix for its streamed relay ('joint+streamed')."""


class Candidate(NamedTuple):
    """What the online selector may run on a layer call: a route, with its relay streamed into
    its rail phases or not (``PlanOptions.streamed``). Named ``route`` or ``route+streamed``."""

    route: Route
    streamed: bool = False

    def __str__(self) -> str:
        return str(self.route) + (STREAMED_SUFFIX if self.streamed else "")


def parse_candidate(name: str | Route | Candidate) -> Candidate:
    """The candidate of a name ('joint', 'joint+streamed'; route names as ``parse_route``). A
    streamed variant plans as its route where no record is relayed (NATIVE and PERM relay only
    around a failed rail).

    Raises:
        ValueError: an unknown route (the message lists the known ones).
    """
    if isinstance(name, Candidate):
        return name
    if isinstance(name, Route):
        return Candidate(name)
    key = str(name).strip().lower()
    streamed = key.endswith(STREAMED_SUFFIX)
    return Candidate(parse_route(key[: -len(STREAMED_SUFFIX)] if streamed else key), streamed)


class Backend(StrEnum):
    """What moves the bytes: torch.distributed point-to-point phases, DeepEP's internode
    dispatch / combine, or 'auto' (DeepEP on GPUs where it imports and serves the layout)."""

    TORCH = "torch"
    DEEPEP = "deepep"
    AUTO = "auto"


BackendName = Literal["torch", "deepep", "auto"]
BACKEND_NAMES: tuple[str, ...] = tuple(str(b) for b in Backend)

# The Literals are for type checkers; they must say what the enums say.
assert set(get_args(RouteChoice)) == set(ROUTE_CHOICES), "RouteChoice and Route disagree"
assert set(get_args(BackendName)) == set(BACKEND_NAMES), "BackendName and Backend disagree"
