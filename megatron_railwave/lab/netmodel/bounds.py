"""A lower bound on one layer's dispatch + combine that holds for every path and peer.

Letters: N nodes (s source, d destination), G GPUs per node (g owner, j target), W = N * G ranks,
M = 2**G target masks, R rails, A adapters.

`PlanTiming.bound_s` bounds one *path*: its own busiest link. Comparing a path with that bound
says how well the path uses its own links, not how far it is from what the fabric allows. The
bound here depends only on the demand and the links, so it is the same for NATIVE, RAIL, PERM,
JOINT and the peers, and ``T_native / bound`` is the largest speedup any path could have on that
input (the *ideal speedup*).

Bytes every path must move (one payload row of ``payload_bytes`` per copy; the probs, metadata
and Megatron's extra copies only add to it), dispatch:
  * into node d over its NIC downlinks: one row per (token, d) from another node, i.e. every
    remote record into d (no path considered relays a token through a third node);
  * out of node s over its NIC uplinks: every remote record of s (the same assumption);
  * into GPU (d, j) over its NVLink in-port and its own NIC downlink: one row per (token, j)
    copy from any other GPU (the target masks' bit j);
  * out of GPU (s, g) over its NVLink out-port and its own NIC uplink: one row per record of g
    (a (token, destination node) pair) except those whose only target is g itself. Every path
    and peer modelled here sends a record from its owner, or hands the owner's own copy of it to
    one proxy (RailBalance): the same design assumption as the node egress. A scheme that sends
    a token once and copies it on another GPU or node would need only one row per token here.
Combine moves the same rows backwards (node ingress <-> egress, GPU in <-> out), so with the
links' up and down capacities equal its bound equals dispatch's.

Capacities: a node's NIC aggregate is the sum over its adapters of min(adapter, its
ports); a GPU's is its NVLink port plus min(its port, its adapter). Failed rails count as
working (the model keeps their links and a peer may use them) and leaf uplinks are left out
(they never bind on one leaf group; the bound stays valid, only looser, when they do).

Dispatch + combine (``phase_sync='global'``: combine starts after dispatch everywhere): the sum
of the two. Per-rank phases let one rank's combine overlap another's dispatch, so there only a
resource's dispatch and combine rows together bind: max over resources of (both) / capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import mask_bits

__all__ = ["IdealBound", "ideal_bound"]


@dataclass(frozen=True, kw_only=True, slots=True)
class IdealBound:
    """The path-independent bound of one layer (seconds) and the resource that sets it."""

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


def ideal_bound(
    demand: Any, topo: RailTopology, *, payload_bytes: int, phase_sync: str = "global"
) -> IdealBound:
    """The path-independent lower bound of one layer (see the module docstring).

    Args:
        demand: anything with ``masks_into(d) -> [W, M]`` records into node d by target mask
            (`DemandCounts`, `workloads.SparseDemand`).
        topo: the cluster (rail, adapter and NVLink speeds, failed rails).
        payload_bytes: bytes of one token's row (hidden x element size), the least any copy carries.
        phase_sync: 'global' (dispatch then combine) or 'rank' (see the module docstring).

    Returns:
        `IdealBound`. Host sync: no (CPU only).
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
        return IdealBound(
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
    return IdealBound(
        dispatch_s=one_way, combine_s=total - one_way, bound_s=total, resource=name(kind, idx)
    )
