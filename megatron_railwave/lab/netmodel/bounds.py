"""Two lower bounds on one layer's dispatch + combine, from the demand and the links alone.

Letters: N nodes (s source, d destination), G GPUs per node (g owner, j target), W = N * G ranks,
M = 2**G target masks, R rails, A adapters.

`PlanTiming.bound_s` bounds one *path*: its own busiest link. Comparing a path with that bound
says how well the path uses its own links, not how far it is from what the fabric allows. The two
bounds here depend only on the demand and the links, so each is the same number for NATIVE,
RAIL, PERM, JOINT and the peers (docs/netmodel.md, "Two lower bounds"):

* the **per-record routing bound** (`per_record_bound`; its old name `ideal_bound` is kept as an
  alias) holds for every routing that sends each (token, destination node) record from its owner
  (or hands the owner's copy of it to one proxy) and never relays a token through a third node,
  i.e. every path and peer modelled here; ``T_native / bound`` is the largest speedup such a
  routing could have on that input;
* the **any-routing bound** (`any_routing_bound`) holds for every routing of the same rows on
  the same links: relays through local proxies, fan-out from a proxy, NVLink multicast,
  multi-hop through other nodes, combine rows summed on the way, dispatch and combine
  overlapping with no barrier. It is never above the per-record bound.

Per-record routing bound. Bytes such a routing must move (one payload row of ``payload_bytes``
per copy; the probs, metadata and Megatron's extra copies only add to it), dispatch:
  * into node d over its NIC downlinks: one row per (token, d) from another node, i.e. every
    remote record into d;
  * out of node s over its NIC uplinks: every remote record of s (no relay through a third node);
  * into GPU (d, j) over its NVLink in-port and its own NIC downlink: one row per (token, j)
    copy from any other GPU (the target masks' bit j);
  * out of GPU (s, g) over its NVLink out-port and its own NIC uplink: one row per record of g
    (a (token, destination node) pair) except those whose only target is g itself. Every path
    and peer modelled here sends a record from its owner, or hands the owner's own copy of it to
    one proxy (RailBalance).
Combine moves the same rows backwards (node ingress <-> egress, GPU in <-> out), so with the
links' up and down capacities equal its bound equals dispatch's. Dispatch + combine
(``phase_sync='global'``: combine starts after dispatch everywhere): the sum of the two. Per-rank
phases let one rank's combine overlap another's dispatch, so there only a resource's dispatch and
combine rows together bind: max over resources of (both) / capacity.

Any-routing bound. A cut around a node or a GPU: every row that must cross it crosses it on the
cut's links, whatever the route. Rows are whole payloads (no compression, no network coding); a
dispatch row may be copied anywhere (a proxy, a multicast, another node); combine rows of the
same token may be summed anywhere. Per direction of each cut, over the whole layer:
  * out of node s: each token of s with a target outside s at least once (dispatch) + each
    (token, s) record of another node's token at least once (combine: node s's partial sum of
    that token's expert outputs is needed outside and nothing outside holds it);
  * into node d: each (token, d) record from another node at least once (dispatch) + each token
    of d with a target outside d at least once (combine: the sum of its outside partials);
  * out of GPU (s, g): each token of g with a target outside g at least once (dispatch) + each
    (token, g) copy of another GPU's token (combine: g's expert outputs for it);
  * into GPU (d, j): each copy addressed to j from another GPU (dispatch) + each token of j with
    a target outside j (combine).
Links are full duplex and dispatch and combine may overlap, so the bound is the largest
(dispatch + combine rows) / capacity over cut directions, not a dispatch bound plus a combine
bound. Token counts (not record counts) enter the owner's terms: a token that goes to several
nodes may leave its owner once. The demand's counts ([W, N, M] records) do not say which records
of an owner are the same token; a token has at most one record per node, so an owner has at
least max over d of its records into d such tokens, and that is what the bound uses unless
`OwnerTokens` gives the exact counts (`owner_tokens_from_topk_ids`). With the estimate the bound
holds for every token-level demand with these counts.

Capacities (both bounds): a node's NIC aggregate is the sum over its adapters of min(adapter, its
ports); a GPU's is its NVLink port plus min(its port, its adapter). Failed rails count as
working (the model keeps their links and a peer may use them) and leaf uplinks are left out
(they never bind on one leaf group; the bounds stay valid, only looser, when they do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import mask_bits

__all__ = [
    "BOUNDS",
    "AnyRoutingBound",
    "IdealBound",
    "OwnerTokens",
    "PerRecordBound",
    "any_routing_bound",
    "bound_fields",
    "ideal_bound",
    "owner_tokens_from_topk_ids",
    "per_record_bound",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PerRecordBound:
    """The per-record routing bound of one layer (seconds) and the resource that sets it."""

    dispatch_s: float
    combine_s: float
    bound_s: float
    """Dispatch + combine: their sum ('global'), or the joint per-resource form ('rank')."""
    resource: str
    """The binding resource, e.g. 'node NIC in 2 (aggregate of 8 ports)', 'GPU in (1, 3) (NVLink +
    NIC)'."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "dispatch_s": self.dispatch_s,
            "combine_s": self.combine_s,
            "bound_s": self.bound_s,
            "resource": self.resource,
        }


def _capacities(topo: RailTopology) -> tuple[np.ndarray, np.ndarray]:
    """([G] bytes/s each GPU reaches through NVLink + its own NIC port, scalar node NIC
    aggregate)."""
    g = topo.gpus_per_node
    rail_of_gpu = np.asarray(topo.rail_of_gpu, dtype=np.int64)
    adapter_of_rail = np.asarray(topo.adapter_of_rail, dtype=np.int64)
    port = np.full(topo.num_rails, topo.rail_bytes_per_s)
    adapter_bps = topo.adapter_gbps * 1e9 / 8 if topo.adapter_gbps > 0 else np.inf
    ports_of_adapter = np.zeros(int(adapter_of_rail.max()) + 1)
    np.add.at(ports_of_adapter, adapter_of_rail, port)
    node_nic = float(np.minimum(ports_of_adapter, adapter_bps).sum())
    gpu = topo.nvlink_bytes_per_s + np.minimum(port[rail_of_gpu], adapter_bps)
    assert gpu.shape == (g,)
    return gpu, node_nic


def per_record_bound(
    demand: Any, topo: RailTopology, *, payload_bytes: int, phase_sync: str = "global"
) -> PerRecordBound:
    """The per-record routing bound of one layer (see the module docstring).

    Args:
        demand: anything with ``masks_into(d) -> [W, M]`` records into node d by target mask
            (`DemandCounts`, `workloads.SparseDemand`).
        topo: the cluster (rail, adapter and NVLink speeds, failed rails).
        payload_bytes: bytes of one token's row (hidden x element size), the least any copy carries.
        phase_sync: 'global' (dispatch then combine) or 'rank' (see the module docstring).

    Returns:
        `PerRecordBound`. Host sync: no (CPU only).
    """
    if phase_sync not in ("global", "rank"):
        raise ValueError(f"phase_sync must be 'global' or 'rank', got {phase_sync!r}")
    n, g = topo.num_nodes, topo.gpus_per_node
    w = n * g
    bits_MG = mask_bits(g).numpy().astype(np.float64)
    node_in = np.zeros(n)
    node_out = np.zeros(n)
    gpu_in = np.zeros(w)
    gpu_out = np.zeros(w)  # records of a GPU that leave it
    rank_node = np.arange(w) // g
    self_only_M = 1 << (np.arange(w) % g)  # [W] the mask of a rank's own GPU alone
    for d in range(n):
        masks_WM = np.asarray(demand.masks_into(d), dtype=np.float64)
        rec_W = masks_WM.sum(axis=1)
        remote = rank_node != d
        node_in[d] = rec_W[remote].sum()
        np.add.at(node_out, rank_node[remote], rec_W[remote])
        copies_WG = masks_WM @ bits_MG  # [W, G] copies into GPU (d, j)
        own = np.flatnonzero(~remote)
        copies_WG[own, own % g] = 0.0  # a GPU does not send to itself
        gpu_in[d * g : (d + 1) * g] = copies_WG.sum(axis=0)
        leaving = rec_W.copy()
        leaving[own] -= masks_WM[own, self_only_M[own]]
        gpu_out += leaving
    gpu_cap, node_cap = _capacities(topo)
    gpu_cap_W = np.tile(gpu_cap, n)
    row = float(payload_bytes)
    with np.errstate(divide="ignore", invalid="ignore"):
        times = {
            "node NIC in": node_in * row / node_cap,
            "node NIC out": node_out * row / node_cap,
            "GPU in (NVLink + NIC)": gpu_in * row / gpu_cap_W,
            "GPU out (NVLink + NIC)": gpu_out * row / gpu_cap_W,
        }
    times = {k: np.nan_to_num(v, nan=0.0, posinf=np.inf) for k, v in times.items()}

    def name(kind: str, idx: int) -> str:
        return (
            f"{kind} node {idx}" if kind.startswith("node") else f"{kind} ({idx // g}, {idx % g})"
        )

    best_kind = max(times, key=lambda k: float(times[k].max()) if times[k].size else 0.0)
    best_idx = int(np.argmax(times[best_kind]))
    one_way = float(times[best_kind][best_idx])
    if phase_sync == "global":
        # Combine: the same rows backwards on links whose up and down capacities are equal.
        return PerRecordBound(
            dispatch_s=one_way,
            combine_s=one_way,
            bound_s=2 * one_way,
            resource=name(best_kind, best_idx),
        )
    # Per-rank phases: a resource's dispatch and combine rows together (node in: remote records
    # in during dispatch + the same node's remote records out again during combine, and so on).
    joint = {
        "node NIC (dispatch in + combine in)": times["node NIC in"] + times["node NIC out"],
        "GPU (dispatch in + combine in)": times["GPU in (NVLink + NIC)"]
        + times["GPU out (NVLink + NIC)"],
    }
    kind = max(joint, key=lambda k: float(joint[k].max()))
    idx = int(np.argmax(joint[kind]))
    total = max(one_way, float(joint[kind][idx]))
    return PerRecordBound(
        dispatch_s=one_way, combine_s=total - one_way, bound_s=total, resource=name(kind, idx)
    )


IdealBound = PerRecordBound
"""The per-record routing bound's old name (kept so callers do not break)."""
ideal_bound = per_record_bound
"""The per-record routing bound's old name (kept so callers do not break)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnerTokens:
    """Token-level counts of one layer the [W, N, M] record counts do not carry.

    Attributes:
        leave_gpu_W: [W] int64, tokens of owner w with at least one target GPU other than w.
        leave_node_W: [W] int64, tokens of owner w with at least one target on another node.
    """

    leave_gpu_W: np.ndarray
    leave_node_W: np.ndarray


def owner_tokens_from_topk_ids(
    ids_WTK: np.ndarray, topo: RailTopology, num_experts: int
) -> OwnerTokens:
    """`OwnerTokens` of a routing (experts placed contiguously, E / W per rank).

    Args:
        ids_WTK: [W, T, K] int expert ids per owner rank, token and slot; -1 = empty slot.
        topo: the cluster (N x G = W ranks).
        num_experts: E, a multiple of W.
    """
    ids = np.asarray(ids_WTK, dtype=np.int64)
    world = topo.world_size
    if ids.ndim != 3 or ids.shape[0] != world or num_experts % world:
        raise ValueError(
            f"ids_WTK has shape {ids.shape}; need [W={world}, T, K] and E ({num_experts}) a "
            f"multiple of W"
        )
    valid = ids >= 0
    target_rank = np.where(valid, ids // (num_experts // world), -1)
    owner = np.arange(world).reshape(world, 1, 1)
    g = topo.gpus_per_node
    off_gpu = valid & (target_rank != owner)
    off_node = valid & (target_rank // g != owner // g)
    return OwnerTokens(
        leave_gpu_W=off_gpu.any(axis=2).sum(axis=1).astype(np.int64),
        leave_node_W=off_node.any(axis=2).sum(axis=1).astype(np.int64),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class AnyRoutingBound:
    """The any-routing bound of one layer (seconds): the busiest cut direction of each kind, the
    largest of them, and the resource that sets it."""

    node_nic_out_s: float
    """max over nodes s of (tokens of s leaving s + records into s of other nodes' tokens) rows /
    s's NIC aggregate (dispatch out + combine out)."""
    node_nic_in_s: float
    """max over nodes d of (records into d from other nodes + tokens of d leaving d) rows / d's
    NIC aggregate (dispatch in + combine in)."""
    gpu_out_s: float
    """max over GPUs of (its tokens leaving it + copies addressed to it by others) rows /
    (NVLink out-port + its NIC uplink)."""
    gpu_in_s: float
    """max over GPUs of (copies addressed to it by others + its tokens leaving it) rows /
    (NVLink in-port + its NIC downlink)."""
    bound_s: float
    """The largest of the four terms."""
    resource: str
    """The binding cut direction, e.g. 'node NIC out node 2', 'GPU in (NVLink + NIC) (1, 3)'."""
    exact_tokens: bool
    """True when `OwnerTokens` gave the owners' token counts; False: the estimate from the
    record counts (max over nodes of an owner's records into a node)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_nic_out_s": self.node_nic_out_s,
            "node_nic_in_s": self.node_nic_in_s,
            "gpu_out_s": self.gpu_out_s,
            "gpu_in_s": self.gpu_in_s,
            "bound_s": self.bound_s,
            "resource": self.resource,
            "exact_tokens": self.exact_tokens,
        }


def any_routing_bound(
    demand: Any,
    topo: RailTopology,
    *,
    payload_bytes: int,
    tokens: OwnerTokens | None = None,
) -> AnyRoutingBound:
    """The lower bound of one layer's dispatch + combine over every routing (module docstring;
    proof in docs/netmodel.md, "Two lower bounds"). It has no ``phase_sync``: a routing with no
    barrier between dispatch and combine is one of the routings it bounds.

    Args:
        demand: anything with ``masks_into(d) -> [W, M]`` records into node d by target mask
            (`DemandCounts`, `workloads.SparseDemand`).
        topo: the cluster (rail, adapter and NVLink speeds, failed rails).
        payload_bytes: bytes of one token's row (hidden x element size), the least any row carries.
        tokens: the owners' exact token counts (None: the least number consistent with the
            record counts).

    Returns:
        `AnyRoutingBound`. Host sync: no (CPU only).

    Raises:
        ValueError: ``tokens`` gives an owner fewer tokens than its records into one node (the
            counts cannot come from the same routing).
    """
    n, g = topo.num_nodes, topo.gpus_per_node
    w = n * g
    bits_MG = mask_bits(g).numpy().astype(np.float64)
    rank_node = np.arange(w) // g
    self_only_M = 1 << (np.arange(w) % g)  # [W] the mask of a rank's own GPU alone
    records_in_N = np.zeros(n)  # (token, d) records into node d from other nodes
    copies_in_W = np.zeros(w)  # (token, j) copies into GPU j from other GPUs
    least_gpu_W = np.zeros(w)  # max over d of w's records into d that leave w
    least_node_W = np.zeros(w)  # max over d != own of w's records into d
    for d in range(n):
        masks_WM = np.asarray(demand.masks_into(d), dtype=np.float64)
        rec_W = masks_WM.sum(axis=1)
        remote = rank_node != d
        records_in_N[d] = rec_W[remote].sum()
        copies_WG = masks_WM @ bits_MG
        own = np.flatnonzero(~remote)
        copies_WG[own, own % g] = 0.0
        copies_in_W[d * g : (d + 1) * g] = copies_WG.sum(axis=0)
        leaving = rec_W.copy()
        leaving[own] -= masks_WM[own, self_only_M[own]]
        least_gpu_W = np.maximum(least_gpu_W, leaving)
        least_node_W = np.maximum(least_node_W, np.where(remote, rec_W, 0.0))
    if tokens is None:
        leave_gpu_W, leave_node_W = least_gpu_W, least_node_W
    else:
        leave_gpu_W = np.asarray(tokens.leave_gpu_W, dtype=np.float64)
        leave_node_W = np.asarray(tokens.leave_node_W, dtype=np.float64)
        if leave_gpu_W.shape != (w,) or leave_node_W.shape != (w,):
            raise ValueError(f"OwnerTokens needs [W={w}] counts")
        if (leave_gpu_W < least_gpu_W).any() or (leave_node_W < least_node_W).any():
            raise ValueError(
                "OwnerTokens gives an owner fewer tokens than its records into one node: the "
                "token counts and the demand are not of the same routing"
            )
    tokens_out_N = np.bincount(rank_node, weights=leave_node_W, minlength=n)
    gpu_cap, node_cap = _capacities(topo)
    gpu_cap_W = np.tile(gpu_cap, n)
    row = float(payload_bytes)
    # Equal up / down capacities: each cut's two directions carry the same row count (dispatch
    # out + combine out = tokens leaving + records (copies) coming in, and the reverse).
    rows = {
        "node NIC out": tokens_out_N + records_in_N,
        "node NIC in": records_in_N + tokens_out_N,
        "GPU out (NVLink + NIC)": leave_gpu_W + copies_in_W,
        "GPU in (NVLink + NIC)": copies_in_W + leave_gpu_W,
    }
    caps = {"node NIC out": node_cap, "node NIC in": node_cap}
    with np.errstate(divide="ignore", invalid="ignore"):
        times = {
            k: np.nan_to_num(
                v * row / caps.get(k, gpu_cap_W) if v.size else np.zeros(1), nan=0.0, posinf=np.inf
            )
            for k, v in rows.items()
        }
    best = {k: float(v.max()) for k, v in times.items()}
    kind = max(best, key=best.get)
    idx = int(np.argmax(times[kind]))
    resource = (
        f"{kind} node {idx}" if kind.startswith("node") else f"{kind} ({idx // g}, {idx % g})"
    )
    return AnyRoutingBound(
        node_nic_out_s=best["node NIC out"],
        node_nic_in_s=best["node NIC in"],
        gpu_out_s=best["GPU out (NVLink + NIC)"],
        gpu_in_s=best["GPU in (NVLink + NIC)"],
        bound_s=best[kind],
        resource=resource,
        exact_tokens=tokens is not None,
    )


BOUNDS = ("per_record", "any_routing")
"""The two bounds, as the JSON of ``railwave sensitivity`` and ``railwave bench`` names them: per
row or sample ``<bound>_bound_s`` and ``<bound>_resource`` (`bound_fields`)."""


def bound_fields(demand: Any, topo: RailTopology, *, record_bytes: int, phase_sync: str) -> dict:
    """{'per_record_bound_s', 'per_record_resource', 'any_routing_bound_s',
    'any_routing_resource'} of one layer's input (``phase_sync``: the per-record bound's)."""
    per = per_record_bound(demand, topo, payload_bytes=record_bytes, phase_sync=phase_sync)
    anyr = any_routing_bound(demand, topo, payload_bytes=record_bytes)
    return {
        "per_record_bound_s": per.bound_s,
        "per_record_resource": per.resource,
        "any_routing_bound_s": anyr.bound_s,
        "any_routing_resource": anyr.resource,
    }
