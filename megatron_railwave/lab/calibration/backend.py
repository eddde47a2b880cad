"""Backends that time execution paths on replay requests (``MeasureBackend``), and the fixed
costs the path model charges (``path_costs``). The only backend is ``netmodel`` (the flow model);
a backend that times real exchanges does not exist yet: a new one is a class with a ``measure``
method here and a name in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from megatron_railwave.lab.calibration.requests import ReplayRequest, request_plan
from megatron_railwave.names import Route
from megatron_railwave.planner import PlanOptions
from megatron_railwave.selector.path_model import PathCosts
from megatron_railwave.topology import RailTopology

BACKENDS = ("netmodel",)


class MeasureBackend(Protocol):
    """Times execution paths on replay requests."""

    name: str

    def measure(self, request: ReplayRequest, path: Route, repeats: int) -> list[float]:
        """``repeats`` latencies in seconds of ``path`` on ``request`` (slowest rank per sample)."""
        ...


def path_costs(settings: dict[str, Any], num_ranks: int) -> PathCosts:
    """The fixed costs the path model's estimate charges, from a calibration's settings: the flow
    model's per-call costs (``settings['model']``, a ``NetModelConfig`` dict; its defaults when
    absent) over ``num_ranks`` ranks and the rail chunks (``settings['chunks']``, default 1)."""
    from megatron_railwave.lab.netmodel import NetModelConfig

    raw = settings.get("model")
    model = (
        NetModelConfig.from_dict(raw, source="context.settings.model")
        if isinstance(raw, dict)
        else NetModelConfig()
    )
    return PathCosts(
        rail_phase_s=model.wave_cost_s(num_ranks),
        layer_s=model.count_exchange_s + model.railbalance_barrier_s + model.railbalance_quota_s,
        chunks=int(settings.get("chunks", 1)),
    )


class NetmodelBackend:
    """Latencies from the flow-level network model (``netmodel.simulate_plan`` with ``model``,
    default ``NetModelConfig()``): deterministic, one simulation per (request, path)."""

    name = "netmodel"

    def __init__(
        self, topo: RailTopology, options: PlanOptions | None = None, model: Any = None
    ) -> None:
        from megatron_railwave.lab.netmodel import simulate_plan

        self._simulate: Callable[..., float] = simulate_plan
        self.topo = topo
        self.options = options
        self.model = model
        self._cache: dict[tuple[str, int, int, str], float] = {}

    def measure(self, request: ReplayRequest, path: Route, repeats: int) -> list[float]:
        key = (request.name, int(request.records_NGN.sum()), request.record_bytes, str(path))
        if key not in self._cache:
            plan = request_plan(request, self.topo, path, self.options)
            if plan.chunks != 1 and request.demand is None:
                raise ValueError(
                    f"request {request.name!r}: a plan with {plan.chunks} rail chunks per wave "
                    f"needs the "
                    "request's target masks (ReplayRequest.demand); build the requests with "
                    "glm_requests / synthetic_requests, or calibrate with chunks=1"
                )
            self._cache[key] = float(
                self._simulate(
                    plan, record_bytes=request.record_bytes, model=self.model, demand=request.demand
                )
            )
        return [self._cache[key]] * repeats


def make_backend(
    name: str, topo: RailTopology, *, options: PlanOptions | None = None, model: Any = None
) -> MeasureBackend:
    """The backend called ``name`` (``--backend``); ``model``: the netmodel's ``NetModelConfig``
    (None: its defaults)."""
    if name == "netmodel":
        return NetmodelBackend(topo, options, model)
    raise ValueError(f"--backend {name!r} is unknown; choose one of {list(BACKENDS)}")
