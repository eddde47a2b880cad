"""The links of a rail-optimized cluster, built from a `RailTopology`, for the flow engine.

Shape letters: N nodes (s source, d destination), G GPUs per node (g owner, l egress, j target),
R rails (NIC ports) per node, A adapters per node, Q leaf groups, F flows, H hops.

Links (all directed, capacities in bytes/s):

| link | id | capacity |
|---|---|---|
| NVLink out of GPU (n, g) | ``n*G + g`` | ``nvlink_gBps`` |
| NVLink into GPU (n, g) | ``N*G + n*G + g`` | ``nvlink_gBps`` |
| NIC port up (n, r): node -> leaf | ``nic_up_NR[n, r]`` | ``rail_gbps / 8`` |
| NIC port down (n, r): leaf -> node (receiver port) | ``nic_down_NR[n, r]`` | ``rail_gbps / 8`` |
| adapter up / down (n, a), if ``adapter_gbps > 0`` | ``adapter_up_NA``, ``adapter_down_NA`` |
``adapter_gbps / 8`` | | leaf <-> spine of rail r, leaf group q, if Q > 1 | ``leaf_up_RQ``,
``leaf_down_RQ`` | see below |

A leaf uplink (or downlink) carries ``nodes_per_leaf * rail_gbps / 8 / spine_oversubscription``.

Rail-optimized wiring: port r of every node hangs off rail r's leaf switch. A rail transfer
GPU (s, l) -> GPU (d, l) leaves on port ``rail_of_gpu[l]`` of node s and arrives on the same
port of node d: one leaf crossing when s and d share a leaf group (``nodes_per_leaf`` nodes per
rail leaf), else leaf -> spine -> leaf, where the uplinks of one (rail, leaf group) are one
aggregated link (ideal ECMP). Switches themselves are non-blocking. NVSwitch inside a node is a
non-blocking crossbar: only the GPUs' own NVLink ports limit intra-node transfers. PCIe between
GPU and NIC is not modelled (it is not the bottleneck on H800 / H20 at these rates).

Receiver ports for the incast model (`incast.IncastModel`): the NIC port downlinks.
A failed rail keeps its links (capacities must be positive) but the planner sends nothing on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_railwave.lab.netmodel.problem import Network
from megatron_railwave.topology import RailTopology

__all__ = ["Fabric", "build_fabric"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fabric:
    """Link table of one cluster (global, identical for every caller)."""

    topology: RailTopology
    network: Network
    """Capacities [L] and receiver ports [L] (the NIC downlinks)."""
    nic_up_NR: np.ndarray
    """[N, R] int64 link id of each NIC port's uplink."""
    nic_down_NR: np.ndarray
    """[N, R] int64 link id of each NIC port's downlink (receiver port)."""
    adapter_up_NA: np.ndarray | None
    """[N, A] int64 adapter uplinks, None when adapters impose no limit."""
    adapter_down_NA: np.ndarray | None
    leaf_group_N: np.ndarray
    """[N] int64 leaf group of each node (node // nodes_per_leaf)."""
    leaf_up_RQ: np.ndarray | None
    """[R, Q] int64 leaf -> spine links, None with a single leaf group."""
    leaf_down_RQ: np.ndarray | None

    @property
    def num_links(self) -> int:
        return self.network.num_links

    def nvlink_links_FH(
        self, node_F: np.ndarray, src_gpu_F: np.ndarray, dst_gpu_F: np.ndarray
    ) -> np.ndarray:
        """[F, 2] NVLink links of intra-node transfers GPU (n, g) -> GPU (n, j), g != j."""
        n, g = self.topology.num_nodes, self.topology.gpus_per_node
        node_F = np.asarray(node_F, dtype=np.int64)
        return np.stack([node_F * g + src_gpu_F, n * g + node_F * g + dst_gpu_F], axis=1)

    def rail_links_FH(
        self, src_node_F: np.ndarray, dst_node_F: np.ndarray, gpu_F: np.ndarray
    ) -> np.ndarray:
        """[F, H] links of rail transfers GPU (s, l) -> GPU (d, l), s != d; -1 pads.

        Hops: NIC up at s, [adapter up at s], [leaf up, leaf down when the leaf groups differ],
        NIC down at d, [adapter down at d].
        """
        topo = self.topology
        src = np.asarray(src_node_F, dtype=np.int64)
        dst = np.asarray(dst_node_F, dtype=np.int64)
        rail = np.asarray(topo.rail_of_gpu, dtype=np.int64)[np.asarray(gpu_F, dtype=np.int64)]
        cols = [self.nic_up_NR[src, rail], self.nic_down_NR[dst, rail]]
        if self.adapter_up_NA is not None:
            adapter = np.asarray(topo.adapter_of_rail, dtype=np.int64)[rail]
            cols += [self.adapter_up_NA[src, adapter], self.adapter_down_NA[dst, adapter]]
        if self.leaf_up_RQ is not None:
            qs, qd = self.leaf_group_N[src], self.leaf_group_N[dst]
            cross = qs != qd
            cols += [
                np.where(cross, self.leaf_up_RQ[rail, qs], -1),
                np.where(cross, self.leaf_down_RQ[rail, qd], -1),
            ]
        return np.stack(cols, axis=1)


def build_fabric(
    topo: RailTopology, *, nodes_per_leaf: int = 32, spine_oversubscription: float = 1.0
) -> Fabric:
    """The links of ``topo`` (see the module docstring).

    Args:
        topo: the cluster (rail speed, NVLink speed, adapters).
        nodes_per_leaf: nodes under one rail leaf switch; more nodes form several leaf groups
            joined by spines. 0 = one leaf per rail for any N.
        spine_oversubscription: downlink / uplink capacity ratio of a leaf (1 = non-blocking).

    Raises:
        ValueError: ``nodes_per_leaf`` < 0, or ``spine_oversubscription`` < 1 or not finite.
    """
    if (
        isinstance(nodes_per_leaf, bool)
        or not isinstance(nodes_per_leaf, int)
        or nodes_per_leaf < 0
    ):
        raise ValueError(
            f"nodes_per_leaf must be an int >= 0 (0 = one leaf per rail), got {nodes_per_leaf!r}"
        )
    if not (np.isfinite(spine_oversubscription) and spine_oversubscription >= 1.0):
        raise ValueError(
            f"spine_oversubscription must be a finite number >= 1 (1 = non-blocking), got "
            f"{spine_oversubscription!r}"
        )
    n, g, r = topo.num_nodes, topo.gpus_per_node, topo.num_rails
    rail_bps = topo.rail_bytes_per_s
    caps: list[np.ndarray] = [np.full(2 * n * g, topo.nvlink_bytes_per_s)]
    next_id = 2 * n * g

    def block(count: int, capacity: float) -> np.ndarray:
        nonlocal next_id
        ids = np.arange(next_id, next_id + count, dtype=np.int64)
        caps.append(np.full(count, capacity))
        next_id += count
        return ids

    nic_up = block(n * r, rail_bps).reshape(n, r)
    nic_down = block(n * r, rail_bps).reshape(n, r)
    rx_lo, rx_hi = int(nic_down.min()), int(nic_down.max()) + 1
    adapter_up = adapter_down = None
    if topo.adapter_gbps > 0:
        num_adapters = max(topo.adapter_of_rail) + 1
        adapter_bps = topo.adapter_gbps * 1e9 / 8
        adapter_up = block(n * num_adapters, adapter_bps).reshape(n, num_adapters)
        adapter_down = block(n * num_adapters, adapter_bps).reshape(n, num_adapters)
    per_leaf = nodes_per_leaf if nodes_per_leaf > 0 else n
    leaf_group = np.arange(n, dtype=np.int64) // per_leaf
    num_groups = int(leaf_group.max()) + 1
    leaf_up = leaf_down = None
    if num_groups > 1:
        uplink_bps = per_leaf * rail_bps / spine_oversubscription
        leaf_up = block(r * num_groups, uplink_bps).reshape(r, num_groups)
        leaf_down = block(r * num_groups, uplink_bps).reshape(r, num_groups)
    capacity_L = np.concatenate(caps)
    rx_L = np.zeros(capacity_L.size, dtype=bool)
    rx_L[rx_lo:rx_hi] = True
    return Fabric(
        topology=topo,
        network=Network(capacity_Bps_L=capacity_L, receiver_port_L=rx_L),
        nic_up_NR=nic_up,
        nic_down_NR=nic_down,
        adapter_up_NA=adapter_up,
        adapter_down_NA=adapter_down,
        leaf_group_N=leaf_group,
        leaf_up_RQ=leaf_up,
        leaf_down_RQ=leaf_down,
    )
