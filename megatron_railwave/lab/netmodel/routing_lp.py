"""The exact reference of FLOW's min-max routing: the same resource model as the runtime heuristic
(``planner.flow``), with continuous splits, solved as a linear program (scipy's HiGHS).

Letters: N nodes, G GPUs per node, R rails per node, V waves.

Variables x[s, d, g, l] >= 0: records of owner (s, g) for remote node d that leave on the rail of
eligible GPU l, with sum over l = the owner's records; one peak per stage: the relay's t_relay
(one phase before every wave) and, per wave v, the rail's t_rail[v] and the delivery's
t_deliver[v]. Every resource (``planner.flow.flow_loads``' six kinds: the relay's NVLink out / in,
NIC up / down of every (node, rail) port, the delivery's NVLink out / in under the hit model, plus
the fixed local copies in wave 0's delivery) loads linearly in x and must stay <= its stage's
peak; the LP minimises t_relay + sum over waves of (t_rail[v] + t_deliver[v]), the heuristic's
objective (``planner.flow.flow_objective``). ``routing_gap`` reports how far the
heuristic's integer plan is above it, in the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_railwave.names import Route, parse_route
from megatron_railwave.planner import PlanOptions, build_plan
from megatron_railwave.planner.flow import (
    DELIVER_IN,
    DELIVER_OUT,
    NIC_DOWN,
    NIC_UP,
    NUM_KINDS,
    RELAY_IN,
    RELAY_OUT,
    fixed_loads,
    flow_loads,
    flow_objective,
)
from megatron_railwave.planner.plan import delivery_copies_NNGG
from megatron_railwave.planner.railbalance import eligible_NNG
from megatron_railwave.topology import RailTopology

__all__ = ["RoutingLP", "solve_routing_lp", "routing_gap"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingLP:
    """The LP's optimum.

    Attributes:
        peak_s_per_byte: the objective at the optimum (the relay's peak plus every wave's rail and
            delivery peaks), seconds per record byte.
        relay_NNGG: [N, N, G, G] float64, the optimal continuous split (diagonal = kept).
    """

    peak_s_per_byte: float
    relay_NNGG: np.ndarray


def solve_routing_lp(
    records_NNG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    eligible: torch.Tensor,
    wave_NN: torch.Tensor,
    topo: RailTopology,
    *,
    num_waves: int,
) -> RoutingLP:
    """Minimise the sum of the stages' peak loads over continuous splits (HiGHS).

    Args:
        records_NNG: [N, N, G] int64, records owned by GPU (s, g) for node d.
        copies_NNGG: [N, N, G, G] int64, their copies per target GPU of node d.
        eligible: [N, N, G] bool, GPUs of s allowed to carry the pair's records.
        wave_NN: [N, N] int64, wave of each remote pair (-1 local).
        topo: the cluster (rates, rails).
        num_waves: V.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    records = records_NNG.numpy().astype(np.float64)
    copies = copies_NNGG.numpy().astype(np.float64)
    allowed = eligible.numpy()
    wave = wave_NN.numpy()
    n, _, g = records.shape
    q = max(g, topo.num_rails)
    rail_G = np.asarray(topo.rail_of_gpu)
    # Coefficients in seconds per GB (1e9 record bytes): per byte they would be ~1e-11, below the
    # matrix values HiGHS keeps (it drops entries under 1e-9 as zeros).
    unit = 1e9
    nvl, nic = unit / topo.nvlink_bytes_per_s, unit / topo.rail_bytes_per_s
    kinds = NUM_KINDS
    num_res = num_waves * kinds * n * q

    def res(v: int, kind: int, node: int, idx: int) -> int:
        return ((v * kinds + kind) * n + node) * q + idx

    fixed = fixed_loads(copies, num_waves, topo.num_rails, nvl)[:num_waves].reshape(-1)

    var_cells: list[tuple[int, int, int, int]] = []
    rows, cols, vals = [], [], []
    eq_rows, eq_cols, eq_b = [], [], []
    for s in range(n):
        for d in range(n):
            v = int(wave[s, d])
            if v < 0:
                continue
            for o in range(g):
                if records[s, d, o] <= 0:
                    continue
                share_J = copies[s, d, o] / records[s, d, o]
                eq = len(eq_b)
                eq_b.append(records[s, d, o])
                for l in range(g):
                    if not allowed[s, d, l]:
                        continue
                    x = len(var_cells)
                    var_cells.append((s, d, o, l))
                    eq_rows.append(eq)
                    eq_cols.append(x)
                    terms = [
                        (res(v, NIC_UP, s, rail_G[l]), nic),
                        (res(v, NIC_DOWN, d, rail_G[l]), nic),
                    ]
                    if l != o:
                        terms += [(res(0, RELAY_OUT, s, o), nvl), (res(0, RELAY_IN, s, l), nvl)]
                    terms.append((res(v, DELIVER_OUT, d, l), (share_J.sum() - share_J[l]) * nvl))
                    terms += [
                        (res(v, DELIVER_IN, d, j), share_J[j] * nvl) for j in range(g) if j != l
                    ]
                    for r, c in terms:
                        if c > 0:
                            rows.append(r)
                            cols.append(x)
                            vals.append(c)
    num_x = len(var_cells)
    # Variables: x (num_x), then the stage peaks: t_relay, t_rail[v], t_deliver[v]
    # (1 + 2 V). Load_r(x) + fixed_r - t_stage(r) <= 0.
    res_index = np.arange(num_res)
    res_wave = res_index // (kinds * n * q)
    res_kind = (res_index // (n * q)) % kinds
    res_peak = np.where(
        res_kind <= RELAY_IN,
        0,
        np.where(res_kind <= NIC_DOWN, 1 + res_wave, 1 + num_waves + res_wave),
    )
    num_peaks = 1 + 2 * num_waves
    a_ub = coo_matrix(
        (
            np.concatenate([vals, -np.ones(num_res)]),
            (
                np.concatenate([rows, res_index]).astype(np.int64),
                np.concatenate([cols, num_x + res_peak]).astype(np.int64),
            ),
        ),
        shape=(num_res, num_x + num_peaks),
    ).tocsr()
    a_eq = coo_matrix(
        (np.ones(len(eq_cols)), (eq_rows, eq_cols)), shape=(len(eq_b), num_x + num_peaks)
    ).tocsr()
    cost = np.concatenate([np.zeros(num_x), np.ones(num_peaks)])
    out = linprog(
        cost,
        A_ub=a_ub,
        b_ub=-fixed,
        A_eq=a_eq if eq_b else None,
        b_eq=np.asarray(eq_b) if eq_b else None,
        bounds=(0, None),
        method="highs",
    )
    if out.status != 0:
        raise RuntimeError(f"routing LP did not solve: {out.message}")
    relay = np.zeros((n, n, g, g))
    for (s, d, o, l), value in zip(var_cells, out.x[:num_x]):
        relay[s, d, o, l] = value
    for s in range(n):
        relay[s, s, np.arange(g), np.arange(g)] = records[s, s]
    return RoutingLP(peak_s_per_byte=float(out.fun) / unit, relay_NNGG=relay)


def routing_gap(demand: Any, topo: RailTopology, path: Route | str = Route.FLOW) -> dict[str, Any]:
    """The heuristic's modelled peak against the LP optimum for one layer's demand.

    Args:
        demand: ``DemandCounts`` (full form) or a lab demand with ``records_NGN`` and
            ``masks_into`` for every node.
        path: FLOW (one pass) or FLOW_WAVES (the cyclic waves; the sum of the waves' peaks).

    Returns:
        {'path', 'heuristic_s_per_byte', 'lp_s_per_byte', 'gap' (heuristic / LP - 1),
        'rail_s_per_byte' (RailBalance's plan in the same model, all pairs at once or the same
        waves), 'lp_over_rail'}.
    """
    route = parse_route(path)
    if not route.min_max:
        raise ValueError(f"routing_gap is for the min-max routes (flow, flow-waves), got {path!r}")
    plan = build_plan(demand, topo, route, options=PlanOptions())
    g = topo.gpus_per_node
    copies = delivery_copies_NNGG(demand, plan.records_NNG, g)
    eligible = eligible_NNG(topo, plan.records_NNG)
    v = plan.num_waves
    lp = solve_routing_lp(plan.records_NNG, copies, eligible, plan.pair_wave_NN, topo, num_waves=v)

    def peak(relay: torch.Tensor) -> float:
        return flow_objective(flow_loads(relay, copies, plan.pair_wave_NN, topo, num_waves=v))

    heuristic = peak(plan.relay_NNGG)
    rail = peak(build_plan(demand, topo, Route.JOINT if route.waved else Route.RAIL).relay_NNGG)
    return {
        "path": str(route),
        "heuristic_s_per_byte": heuristic,
        "lp_s_per_byte": lp.peak_s_per_byte,
        "gap": heuristic / lp.peak_s_per_byte - 1.0 if lp.peak_s_per_byte > 0 else 0.0,
        "rail_s_per_byte": rail,
        "lp_over_rail": lp.peak_s_per_byte / rail if rail > 0 else 1.0,
    }
