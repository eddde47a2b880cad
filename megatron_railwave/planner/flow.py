"""The min-max relay plan of FLOW / FLOW_WAVES: which rail of its node each owner's records take.

Letters: N nodes (s source, d destination), G GPUs per node (g owner, l egress rail's GPU,
j target), R rails per node, V waves (or sending windows), U units per owner and node pair.

For every remote pair (s, d) and owner (s, g) the plan picks ``relay[s, d, g, l]``: records of
owner g that leave node s on the rail of local GPU l (l eligible: ``railbalance.eligible_NNG``;
failed rails carry nothing). A record of owner (s, g) on rail l loads

    relay:    NVLink out of (s, g) and NVLink in of (s, l)   when l != g (stage 1),
    rail:     NIC up of (s, rail(l)) and NIC down of (d, rail(l))   (stage 2; a NIC is a
              (node, rail) port: GPUs that share a rail share its port),
    delivery: NVLink out of (d, l) and NVLink in of (d, j)   once per target j != l of its mask
              (stage 3; target j == l needs no copy).

The exchange runs the stages as phases (relay, then the rail waves, each wave's delivery after
its rail), so a layer takes about the relay's peak plus, per wave, the rail's peak and the
delivery's peak: that sum (``flow_objective``) is what the plan minimises, in seconds. (A first
version minimised the single largest load over all resources, as if the stages overlapped: on
the flow model it traded NIC balance for NVLink balance and lost to RailBalance, 0.54x
DeepEP-like NATIVE at token skew 0 where JOINT has 0.92x.) Fixed loads every GPU carries anyway
are counted first: the local node's delivery copies (owner (s, g) -> each other local target, in
wave 0's delivery). Where a record's targets are is known only per (owner, node pair): the plan
uses a hit model, unit k of (s, d, g) carrying the k-th near-equal part (``chunks.chunk_sizes``)
of the owner's copies for each target j.

Heuristic (deterministic integer water-filling): each (s, d, g)'s records are split into U
(``flow_units``) near-equal units; the units, the largest first (ties: unit index, then s, d, g
ascending), are assigned one at a time to the eligible rail minimising (the sum of the three
stages' peaks after the unit, the largest load the unit touches after, the added work, the GPU
index); then ``sweeps`` refinement passes take each unit off its rail and re-add it where it is
best. Loads are integers: a record costs ``nvlink_cost`` on an NVLink direction and ``nic_cost`` on
a NIC direction (``flow_costs``: proportional to the inverse bandwidths), so the compiled twin
(``ops.flow_plan``, csrc/cpu/flow.cpp) gives the same plan bit for bit.

What the plan does not do: choose which records of an owner ride which rail by their targets
(the canonical order decides; the hit model only sees the owner's target shares), or stream the
relay into the rail phase.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.planner.chunks import chunk_sizes
from megatron_railwave.topology import RailTopology

__all__ = [
    "FLOW_UNITS",
    "FLOW_SWEEPS",
    "flow_costs",
    "fixed_loads",
    "flow_relay_NNGG",
    "flow_units",
    "flow_loads",
    "flow_objective",
    "flow_objective_cost",
]

FLOW_UNITS = 16
"""Most units per (owner, node pair): the finest split (1/16 of an owner's records)."""
_UNITS_PER_NIC = 48
"""About how many units each source NIC gets to choose from (``flow_units``)."""


def flow_units(num_nodes: int) -> int:
    """Units per (owner, node pair) on ``num_nodes`` nodes: enough that each source NIC sees
    about 48 units over its N - 1 destination nodes (16 at 4 nodes, 2 at 32, 1 from 49 on), so the
    water-filling's work grows with the N (N - 1) G cells, not 16 times that (measured, 2-core CPU
    dev box, GLM layer at T = 4096: 32 x 8 took ~110 ms per plan at 16 units)."""
    return max(1, min(FLOW_UNITS, -(-_UNITS_PER_NIC // max(num_nodes - 1, 1))))


FLOW_SWEEPS = 2
"""Refinement passes after the first assignment."""

_COST_SCALE = 1_000_000
"""Integer cost of one record on the slower of NVLink and NIC (the faster one costs less)."""


def flow_costs(topo: RailTopology) -> tuple[int, int]:
    """(nvlink_cost, nic_cost): integer cost of one record on one NVLink direction and on one
    NIC direction, proportional to 1 / bandwidth (the slower link costs ``_COST_SCALE``)."""
    nvl, nic = topo.nvlink_bytes_per_s, topo.rail_bytes_per_s
    slow = min(nvl, nic)
    return max(1, round(_COST_SCALE * slow / nvl)), max(1, round(_COST_SCALE * slow / nic))


def _units(
    records_NNG: np.ndarray, copies_NNGG: np.ndarray, wave_NN: np.ndarray, units: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cell_X [X, 3] (s, d, g), size_X [X], copies_XG [X, G]) of the nonzero units of the remote
    pairs, in assignment order: size descending, then unit index, then (s, d, g) ascending."""
    n, _, g = records_NNG.shape
    remote = wave_NN >= 0
    s, d, o = np.nonzero(remote[:, :, None] & (records_NNG > 0))
    size_CU = chunk_sizes(records_NNG[s, d, o], units)  # [cells, U]
    copies_CUJ = chunk_sizes(copies_NNGG[s, d, o], units).transpose(0, 2, 1)  # [cells, U, G]
    cell_CU = np.broadcast_to(np.arange(s.size)[:, None], size_CU.shape)
    unit_CU = np.broadcast_to(np.arange(units)[None, :], size_CU.shape)
    keep = size_CU > 0
    size, cell, unit = size_CU[keep], cell_CU[keep], unit_CU[keep]
    copies = copies_CUJ[keep]
    order = np.lexsort((cell, unit, -size))  # last key first: size desc, unit, cell (s, d, g)
    cells = np.stack([s, d, o], axis=1)[cell[order]]
    return cells, size[order], copies[order]


RELAY_OUT, RELAY_IN, NIC_UP, NIC_DOWN, DELIVER_OUT, DELIVER_IN = range(6)
"""Resource kinds of ``flow_loads`` (second axis): the relay's NVLink out / in (stage 1), the NIC
up / down of a (node, rail) port (stage 2) and the delivery's NVLink out / in (stage 3)."""
NUM_KINDS = 6
_CLASSES = ((RELAY_OUT, RELAY_IN), (NIC_UP, NIC_DOWN), (DELIVER_OUT, DELIVER_IN))


def fixed_loads(
    copies_NNGG: np.ndarray, num_waves: int, num_rails: int, nvlink_cost: float
) -> np.ndarray:
    """[max(V, 1), 6, N, max(G, R)] loads before any remote record: the local node's delivery
    copies (delivery NVLink out / in of wave 0, where the local round runs), in the dtype of
    ``copies_NNGG`` times ``nvlink_cost`` (int64 for the heuristic's integer costs, float64 for
    seconds). The one start of every load table here and of ``lab.netmodel.routing_lp``'s."""
    n, _, g, _ = copies_NNGG.shape
    dtype = np.result_type(copies_NNGG.dtype, type(nvlink_cost))
    loads = np.zeros((max(num_waves, 1), NUM_KINDS, n, max(g, num_rails)), dtype=dtype)
    local = copies_NNGG[np.arange(n), np.arange(n)].copy()  # [s, owner, target]
    local[:, np.arange(g), np.arange(g)] = 0
    loads[0, DELIVER_OUT, :, :g] += local.sum(axis=2) * nvlink_cost
    loads[0, DELIVER_IN, :, :g] += local.sum(axis=1) * nvlink_cost
    return loads


def _deltas(
    s: int,
    d: int,
    o: int,
    v: int,
    size: int,
    copies_J: np.ndarray,
    l: int,
    rail_G: np.ndarray,
    nvlink_cost: int,
    nic_cost: int,
) -> list[tuple[int, int, int, int, int]]:
    """[(wave, kind, node, index, added load)] of one unit of owner (s, o) for node d (wave v)
    on the rail of GPU l: only the resources it adds to, in a fixed order. The relay is one
    phase before every wave, so its loads sit in wave 0."""
    out = []
    if l != o:
        out += [(0, RELAY_OUT, s, o, size * nvlink_cost), (0, RELAY_IN, s, l, size * nvlink_cost)]
    r = int(rail_G[l])
    out += [(v, NIC_UP, s, r, size * nic_cost), (v, NIC_DOWN, d, r, size * nic_cost)]
    sent = int(copies_J.sum() - copies_J[l])
    if sent:
        out.append((v, DELIVER_OUT, d, l, sent * nvlink_cost))
    for j in range(copies_J.size):
        if j != l and copies_J[j]:
            out.append((v, DELIVER_IN, d, j, int(copies_J[j]) * nvlink_cost))
    return out


def _class_peaks(loads: np.ndarray, v: int) -> list[int]:
    """The current peak of each stage's resources: the relay's (one phase for every wave) and
    wave v's rail and delivery."""
    return [int(loads[0 if kinds[0] == RELAY_OUT else v, list(kinds)].max()) for kinds in _CLASSES]


def _best_rail(loads, eligible_G, unit, v, rail_G, nvlink_cost, nic_cost) -> int:
    """The eligible GPU whose rail minimises (sum of the stages' peaks after, largest touched
    load after, added work, index): the stages run one after the other, so their peaks add."""
    s, d, o, size, copies_J = unit
    peaks = _class_peaks(loads, v)
    best, best_key = -1, None
    for l in range(eligible_G.size):
        if not eligible_G[l]:
            continue
        deltas = _deltas(s, d, o, v, size, copies_J, l, rail_G, nvlink_cost, nic_cost)
        after = list(peaks)
        touched = 0
        for w, kind, node, q, add in deltas:
            value = int(loads[w, kind, node, q]) + add
            c = kind // 2
            after[c] = max(after[c], value)
            touched = max(touched, value)
        key = (sum(after), touched, sum(add for *_, add in deltas))
        if best_key is None or key < best_key:
            best, best_key = l, key
    return best


def _apply(loads, unit, v, l, rail_G, nvlink_cost, nic_cost, sign: int) -> None:
    s, d, o, size, copies_J = unit
    for w, kind, node, q, add in _deltas(
        s, d, o, v, size, copies_J, l, rail_G, nvlink_cost, nic_cost
    ):
        loads[w, kind, node, q] += sign * add


def flow_objective(loads: np.ndarray) -> float:
    """What the plan minimises, from ``flow_loads``' [V, 6, N, Q] loads: the relay's peak (one
    phase, wave 0's slot) plus, per wave, the rail's peak and the delivery's peak (the stages
    run one after the other; a rail chunking that overlaps rail and delivery makes this an
    upper estimate)."""
    if loads.shape[0] == 0:
        return 0.0
    relay = loads[0, [RELAY_OUT, RELAY_IN]].max()
    rail = loads[:, [NIC_UP, NIC_DOWN]].reshape(loads.shape[0], -1).max(axis=1).sum()
    deliver = loads[:, [DELIVER_OUT, DELIVER_IN]].reshape(loads.shape[0], -1).max(axis=1).sum()
    return float(relay + rail + deliver)


def flow_relay_reference(
    records_NNG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    eligible_NNG: torch.Tensor,
    wave_NN: torch.Tensor,
    rail_of_gpu_G: torch.Tensor,
    *,
    num_waves: int,
    num_rails: int,
    nvlink_cost: int,
    nic_cost: int,
    units: int = FLOW_UNITS,
    sweeps: int = FLOW_SWEEPS,
) -> torch.Tensor:
    """The min-max relay plan in plain Python (the reference of ``ops.flow_plan``).

    Args:
        records_NNG: [N_src, N_dst, G_owner] int64, records owned by GPU (s, g) for node d.
        copies_NNGG: [N_src, N_dst, G_owner, G_target] int64, (record, target GPU) copies of
            those records for GPU (d, j) (the local pair's: the local delivery copies).
        eligible_NNG: [N_src, N_dst, G] bool, GPUs of s allowed to carry the pair's records.
        wave_NN: [N, N] int64, wave of each remote pair (-1 on the diagonal).
        rail_of_gpu_G: [G] int64, the rail (NIC port) of each local GPU.
        num_waves / num_rails: V and R.
        nvlink_cost / nic_cost: ``flow_costs``.
        units / sweeps: U and the refinement passes.

    Returns:
        relay_NNGG [N_src, N_dst, G_owner, G_egress] int64 (diagonal = kept; local pairs
        diagonal).
    """
    records = records_NNG.numpy().astype(np.int64)
    copies = copies_NNGG.numpy().astype(np.int64)
    eligible = eligible_NNG.numpy().astype(bool)
    wave = wave_NN.numpy().astype(np.int64)
    rail_G = rail_of_gpu_G.numpy().astype(np.int64)
    n, _, g = records.shape
    loads = fixed_loads(copies, num_waves, num_rails, nvlink_cost)
    cells, sizes, unit_copies = _units(records, copies, wave, units)
    units_X = [
        (int(c[0]), int(c[1]), int(c[2]), int(u), cj) for c, u, cj in zip(cells, sizes, unit_copies)
    ]
    rail_X = [-1] * len(units_X)
    for sweep in range(1 + sweeps):
        for x, unit in enumerate(units_X):
            s, d, o = unit[:3]
            v = int(wave[s, d])
            if sweep:
                _apply(loads, unit, v, rail_X[x], rail_G, nvlink_cost, nic_cost, -1)
            rail_X[x] = _best_rail(loads, eligible[s, d], unit, v, rail_G, nvlink_cost, nic_cost)
            _apply(loads, unit, v, rail_X[x], rail_G, nvlink_cost, nic_cost, +1)
    relay = np.zeros((n, n, g, g), dtype=np.int64)
    for unit, l in zip(units_X, rail_X):
        s, d, o, size = unit[:4]
        relay[s, d, o, l] += size
    for s in range(n):  # the local pair: every owner keeps its records
        relay[s, s, np.arange(g), np.arange(g)] = records[s, s]
    return torch.from_numpy(relay)


def flow_relay_NNGG(
    records_NNG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    eligible_NNG: torch.Tensor,
    wave_NN: torch.Tensor,
    topo: RailTopology,
    *,
    num_waves: int,
    units: int | None = None,
    sweeps: int = FLOW_SWEEPS,
) -> torch.Tensor:
    """The min-max relay plan (see the module docstring): the compiled ``ops.flow_plan`` where
    the compiled ops load, else ``flow_relay_reference`` (the same counts, bit for bit:
    tests/unit/planner/test_flow.py). Arguments as ``flow_relay_reference``'s."""
    nvlink_cost, nic_cost = flow_costs(topo)
    rail_G = torch.tensor(topo.rail_of_gpu, dtype=torch.int64)
    args = (
        records_NNG.to(torch.int64).contiguous(),
        copies_NNGG.to(torch.int64).contiguous(),
        eligible_NNG.to(torch.bool).contiguous(),
        wave_NN.to(torch.int64).contiguous(),
        rail_G,
    )
    kwargs = dict(
        num_waves=num_waves,
        num_rails=topo.num_rails,
        nvlink_cost=nvlink_cost,
        nic_cost=nic_cost,
        units=flow_units(topo.num_nodes) if units is None else units,
        sweeps=sweeps,
    )
    compiled = ops.flow_plan(*args, **kwargs)
    return compiled if compiled is not None else flow_relay_reference(*args, **kwargs)


def flow_objective_cost(
    relay_NNGG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    wave_NN: torch.Tensor,
    topo: RailTopology,
    *,
    num_waves: int,
) -> int:
    """``flow_objective`` of a relay plan in the heuristic's integer costs (``flow_costs``), exact
    on every rank: a cell's copies ride its rails as the integer cut of their cumulative share
    (the copies for target j among the first x of the cell's records: c_j * x // records).
    Vectorised numpy; used to keep RailBalance's plan where the water-filling does not beat it.
    """
    relay = relay_NNGG.numpy().astype(np.int64)
    copies = copies_NNGG.numpy().astype(np.int64)
    wave = wave_NN.numpy().astype(np.int64)
    n, _, g, _ = relay.shape
    nvl, nic = flow_costs(topo)
    rail_G = np.asarray(topo.rail_of_gpu, dtype=np.int64)
    v_count = max(num_waves, 1)
    loads = fixed_loads(copies, num_waves, topo.num_rails, nvl)
    s_, d_ = np.nonzero(wave >= 0)
    if s_.size == 0:
        return 0
    v_ = wave[s_, d_]
    x = relay[s_, d_]  # [P, owner, l]
    c = copies[s_, d_]  # [P, owner, j]
    records = np.maximum(x.sum(axis=2), 1)  # [P, owner]
    cum = np.concatenate([np.zeros(x.shape[:2] + (1,), np.int64), np.cumsum(x, axis=2)], axis=2)
    cut = c[:, :, None, :] * cum[:, :, :, None] // records[:, :, None, None]  # [P, o, G+1, j]
    part = cut[:, :, 1:, :] - cut[:, :, :-1, :]  # [P, owner, l, j] copies riding rail l
    eye = np.eye(g, dtype=bool)
    moved = np.where(eye[None], 0, x)  # relayed records
    np.add.at(loads, (0, RELAY_OUT, s_[:, None], np.arange(g)[None, :]), moved.sum(axis=2) * nvl)
    np.add.at(loads, (0, RELAY_IN, s_[:, None], np.arange(g)[None, :]), moved.sum(axis=1) * nvl)
    per_rail = x.sum(axis=1)  # [P, l]
    np.add.at(loads, (v_[:, None], NIC_UP, s_[:, None], rail_G[None, :]), per_rail * nic)
    np.add.at(loads, (v_[:, None], NIC_DOWN, d_[:, None], rail_G[None, :]), per_rail * nic)
    sent = np.where(eye[None, None], 0, part)  # [P, o, l, j], j != l
    np.add.at(
        loads,
        (v_[:, None], DELIVER_OUT, d_[:, None], np.arange(g)[None, :]),
        sent.sum(axis=(1, 3)) * nvl,
    )
    np.add.at(
        loads,
        (v_[:, None], DELIVER_IN, d_[:, None], np.arange(g)[None, :]),
        sent.sum(axis=(1, 2)) * nvl,
    )
    relay_peak = int(loads[0, [RELAY_OUT, RELAY_IN]].max())
    rail_peak = int(loads[:, [NIC_UP, NIC_DOWN]].reshape(v_count, -1).max(axis=1).sum())
    deliver_peak = int(loads[:, [DELIVER_OUT, DELIVER_IN]].reshape(v_count, -1).max(axis=1).sum())
    return relay_peak + rail_peak + deliver_peak


def flow_loads(
    relay_NNGG: torch.Tensor,
    copies_NNGG: torch.Tensor,
    wave_NN: torch.Tensor,
    topo: RailTopology,
    *,
    num_waves: int,
) -> np.ndarray:
    """[V, 6, N, max(G, R)] float64 seconds per record byte of every resource (kinds
    ``RELAY_OUT`` .. ``DELIVER_IN``; the relay's in wave 0's slot: it is one phase before every
    wave) under a relay plan and the hit model (copies of a cell spread over its rails in
    proportion to the records): the continuous form of what the plan balances
    (``flow_objective`` of it is what the plan minimises, and the LP reference in
    ``lab.netmodel.routing_lp`` minimises the same). Multiply by the record's bytes for seconds."""
    relay = relay_NNGG.numpy().astype(np.float64)
    copies = copies_NNGG.numpy().astype(np.float64)
    wave = wave_NN.numpy()
    n, _, g, _ = relay.shape
    rail_G = np.asarray(topo.rail_of_gpu)
    nvl, nic = 1.0 / topo.nvlink_bytes_per_s, 1.0 / topo.rail_bytes_per_s
    loads = fixed_loads(copies, num_waves, topo.num_rails, nvl)[:num_waves]  # none without waves
    records = relay.sum(axis=3)
    for s in range(n):
        for d in range(n):
            v = int(wave[s, d])
            if v < 0:
                continue
            for o in range(g):
                if records[s, d, o] <= 0:
                    continue
                share_J = copies[s, d, o] / records[s, d, o]  # copies per record, per target
                for l in range(g):
                    x = relay[s, d, o, l]
                    if x <= 0:
                        continue
                    if l != o:
                        loads[0, RELAY_OUT, s, o] += x * nvl
                        loads[0, RELAY_IN, s, l] += x * nvl
                    loads[v, NIC_UP, s, rail_G[l]] += x * nic
                    loads[v, NIC_DOWN, d, rail_G[l]] += x * nic
                    other = share_J * x
                    loads[v, DELIVER_OUT, d, l] += (other.sum() - other[l]) * nvl
                    for j in range(g):
                        if j != l:
                            loads[v, DELIVER_IN, d, j] += other[j] * nvl
    return loads
