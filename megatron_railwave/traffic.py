"""Traffic demand and descriptors (B, rho_g, kappa) from routing maps.

Letters: N nodes, G GPUs per node, R rails, W = N * G ranks, T tokens of one rank, E experts,
M = 2**G target-GPU masks of one node.

A *record* is a unique (token, destination node) pair, as in DeepEP's internode dispatch: a token
routed to several experts of one node crosses the network once and is fanned out over NVLink
there. Each record carries a *target mask*: bit j set when local GPU j of the destination node owns
one of the token's experts. Experts are placed contiguously: expert e lives on rank e // (E / W).

The demand of one layer is summarised by two small integer tensors that every rank gathers
(``DemandCounts``); everything a planner needs follows from them, so all ranks plan alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_railwave.topology import RailTopology

__all__ = [
    "DemandCounts",
    "TrafficStats",
    "SelectorScales",
    "target_masks",
    "local_demand",
    "mask_bits",
    "rail_load_NRN",
    "rail_imbalance",
    "receiver_concentration",
    "traffic_stats",
    "dtype_bytes",
]

MiB = 1 << 20


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or its name ('bf16', 'fp32', ...)."""
    if isinstance(dtype, str):
        names = {
            "bf16": 2,
            "bfloat16": 2,
            "fp16": 2,
            "float16": 2,
            "fp32": 4,
            "float32": 4,
            "fp8": 1,
            "float8": 1,
        }
        if dtype not in names:
            raise ValueError(f"unknown dtype name {dtype!r}; use one of {sorted(names)}")
        return names[dtype]
    return torch.empty((), dtype=dtype).element_size()


def mask_bits(gpus_per_node: int) -> torch.Tensor:
    """[M, G] int64: bit j of mask m (M = 2**G)."""
    m = torch.arange(1 << gpus_per_node, dtype=torch.int64)
    return (m.unsqueeze(1) >> torch.arange(gpus_per_node, dtype=torch.int64)) & 1


def _experts_per_rank(num_experts: int, world_size: int) -> int:
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {world_size}; "
            "experts are placed contiguously, E / W per rank"
        )
    return num_experts // world_size


def target_masks(routing_map_TE: torch.Tensor, topo: RailTopology) -> torch.Tensor:
    """Target-GPU mask of every (token, destination node).

    Args:
        routing_map_TE: [T, E] bool, rank-local; True where the token is routed to the expert.
        topo: the cluster.

    Returns:
        [T, N] int64, rank-local: bit j set when GPU (n, j) owns one of the token's experts;
        0 means no record for that node.
    """
    num_tokens, num_experts = routing_map_TE.shape
    n, g = topo.num_nodes, topo.gpus_per_node
    per_rank = _experts_per_rank(num_experts, topo.world_size)
    hit_TNG = routing_map_TE.view(num_tokens, n, g, per_rank).any(dim=-1)
    weights_G = 1 << torch.arange(g, dtype=torch.int64, device=routing_map_TE.device)
    return (hit_TNG.to(torch.int64) * weights_G).sum(dim=-1)


def local_demand(
    routing_map_TE: torch.Tensor, topo: RailTopology
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the demand counts.

    Returns:
        (records_NM [N, M] int64, experts_E [E] int64): records by destination node and target
        mask (column 0 always zero), and routed (token, expert) pairs per expert.
    """
    masks_TN = target_masks(routing_map_TE, topo)
    n, m = topo.num_nodes, 1 << topo.gpus_per_node
    node_N = torch.arange(n, dtype=torch.int64, device=masks_TN.device)
    keys = (node_N * m + masks_TN).flatten()
    records_NM = torch.bincount(keys, minlength=n * m).view(n, m)
    records_NM[:, 0] = 0
    experts_E = routing_map_TE.sum(dim=0, dtype=torch.int64)
    return records_NM, experts_E


@dataclass(frozen=True, kw_only=True, slots=True)
class DemandCounts:
    """Demand of one layer, identical on every rank that holds it.

    Two forms:
      * full (tools, tests): ``records_WNM`` and ``experts_WE`` for every rank and node;
      * node view (what the exchange gathers, so the size does not grow as W * N * M):
        ``records_WN`` for every rank plus, for one destination node ``view_node``, the mask
        histogram ``view_masks_WM`` of the records every rank sends there. That is all one rank
        needs: quotas use the per-node totals, its delivery maps only its own node's masks.

    Attributes:
        records_WNM: [W, N, M] int64 or None. Records from rank w to node n with target mask m.
        experts_WE: [W, E] int64 or None. Routed (token, expert) pairs from rank w per expert.
        records_WN: [W, N] int64. Records from rank w to node n (derived from records_WNM when
            not given).
        view_node: the node whose masks ``view_masks_WM`` holds (node view only).
        view_masks_WM: [W, M] int64. Records from rank w into ``view_node`` by target mask.
        view_experts_X: [E_loc] int64 or None. (token, expert) pairs every rank routes to the
            experts of the rank that holds this view (host tensor: Megatron's tokens_per_expert).
        delivery_WNG: [W, N, G] int64 or None. Node view only, when the count exchange
            carried it (``gather_demand(..., delivery_counts=True)``, for the min-max plans):
            (record, target GPU) copies from rank w to GPU j of node n, for every rank and GPU.
    """

    records_WNM: torch.Tensor | None = None
    experts_WE: torch.Tensor | None = None
    records_WN: torch.Tensor | None = None
    view_node: int | None = None
    view_masks_WM: torch.Tensor | None = None
    view_experts_X: torch.Tensor | None = None
    delivery_WNG: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.records_WN is None:
            if self.records_WNM is None:
                raise ValueError("DemandCounts needs records_WNM or records_WN")
            object.__setattr__(self, "records_WN", self.records_WNM.sum(dim=-1))
        assert self.records_WN.dim() == 2
        assert self.records_WNM is None or self.records_WNM.dim() == 3
        assert (self.view_node is None) == (self.view_masks_WM is None)

    @property
    def world_size(self) -> int:
        return self.records_WN.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.records_WN.shape[1]

    def records_NGN(self) -> torch.Tensor:
        """[N_src, G_owner, N_dst] int64: records owned by GPU (s, g) for node d."""
        w, n = self.records_WN.shape
        return self.records_WN.view(n, w // n, n)

    def remote_records(self) -> int:
        """Records sent to another node, from host counts. In numpy: the selector reads it on
        every layer call, and a torch view plus torch reductions cost twice as much on these few
        dozen numbers."""
        records_WN = self.records_WN.numpy()
        w, n = records_WN.shape
        records_NGN = records_WN.reshape(n, w // n, n)
        return int(records_NGN.sum() - records_NGN.diagonal(axis1=0, axis2=2).sum())

    def masks_into(self, node: int) -> torch.Tensor:
        """[W, M] int64: records every rank sends to ``node``, by target mask."""
        if self.records_WNM is not None:
            return self.records_WNM[:, node, :]
        if self.view_node == node:
            return self.view_masks_WM
        raise ValueError(
            f"this demand holds the target masks of node {self.view_node} only, not of node {node}"
        )

    def copies_WNG(self) -> torch.Tensor:
        """[W, N, G] int64: token copies from rank w delivered to GPU (n, j) (full form, or a node
        view gathered with ``delivery_WNG``)."""
        if self.delivery_WNG is not None:
            return self.delivery_WNG
        if self.records_WNM is None:
            raise ValueError(
                "the copies per target GPU need the full demand (records_WNM) or a node view "
                "gathered "
                "with delivery counts (exchange.layer.gather_demand(..., delivery_counts=True))"
            )
        w, n, _ = self.records_WNM.shape
        return self.records_WNM @ mask_bits(w // n).to(self.records_WNM.dtype)

    @staticmethod
    def from_routing_maps(routing_maps: list[torch.Tensor], topo: RailTopology) -> DemandCounts:
        """Build the global counts from every rank's routing map (tools and tests)."""
        topo.check_world_size(len(routing_maps))
        parts = [local_demand(r, topo) for r in routing_maps]
        return DemandCounts(
            records_WNM=torch.stack([p[0] for p in parts]),
            experts_WE=torch.stack([p[1] for p in parts]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectorScales:
    """Normalisation of the descriptors into selector coordinates (configuration-specific)."""

    payload_ref_bytes: float = 56 * MiB
    """B reference: coordinate 0 is log2(B / payload_ref_bytes)."""
    rho_scale: float = 0.0
    """Coordinate 1 is (rho_g - 1) / rho_scale; 0 means R - 1 of the topology."""
    kappa_scale: float = 0.0
    """Coordinate 2 is (kappa - 1) / kappa_scale; 0 means N - 2 of the topology (at least 1)."""

    def resolve(self, topo: RailTopology) -> tuple[float, float, float]:
        rho = self.rho_scale or max(topo.num_rails - 1, 1)
        kappa = self.kappa_scale or max(topo.num_nodes - 2, 1)
        return float(self.payload_ref_bytes), float(rho), float(kappa)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficStats:
    """Descriptors of one phase (see docs/descriptors.md for the exact definitions)."""

    B_mean_bytes: float
    B_max_bytes: float
    rho_g: float
    kappa: float
    coords: tuple[float, float, float]
    records_total: int
    remote_records: int

    def to_dict(self) -> dict[str, float | int | list[float | None]]:
        """JSON-ready; a coordinate that is not finite (log2 B with no remote bytes, e.g. on one
        node) is written as None, since JSON has no infinity."""
        return {
            "B_mean_bytes": self.B_mean_bytes,
            "B_max_bytes": self.B_max_bytes,
            "rho_g": self.rho_g,
            "kappa": self.kappa,
            "coords": [c if math.isfinite(c) else None for c in self.coords],
            "records_total": self.records_total,
            "remote_records": self.remote_records,
        }


def _remote_NGN(records_NGN: torch.Tensor) -> torch.Tensor:
    n = records_NGN.shape[0]
    local = torch.eye(n, dtype=torch.bool).unsqueeze(1)
    return records_NGN.masked_fill(local, 0)


def rail_load_NRN(load_NGN: torch.Tensor, topo: RailTopology) -> torch.Tensor:
    """[N_src, R, N_dst] int64: per-GPU egress counts [N_src, G, N_dst] summed onto each GPU's
    rail."""
    rails = torch.tensor(topo.rail_of_gpu, dtype=torch.int64)
    out = torch.zeros(topo.num_nodes, topo.num_rails, topo.num_nodes, dtype=torch.int64)
    return out.index_add_(1, rails, load_NGN.to(torch.int64))


def rail_imbalance(rail_load_NRN: torch.Tensor, topo: RailTopology) -> float:
    """rho_g: max over (node, rail) of remote egress load divided by their mean.

    Args:
        rail_load_NRN: [N_src, R, N_dst] records (or bytes) sent on each rail of each node to each
            node; the diagonal (local node) is ignored.

    The mean runs over healthy (node, rail) ports; 1.0 is perfectly balanced, 1.0 for no traffic.
    """
    n, r, _ = rail_load_NRN.shape
    local = torch.eye(n, dtype=torch.bool).unsqueeze(1)
    egress_NR = rail_load_NRN.masked_fill(local, 0).sum(dim=-1).to(torch.float64)
    healthy = torch.ones(n, r, dtype=torch.bool)
    for node, rail in topo.failed_rails:
        healthy[node, rail] = False
    used_rails = torch.zeros(r, dtype=torch.bool)
    used_rails[list(set(topo.rail_of_gpu))] = True
    healthy &= used_rails
    mean = egress_NR[healthy].mean().item()
    if mean <= 0:
        return 1.0
    return egress_NR.max().item() / mean


def receiver_concentration(rail_load_NRN: torch.Tensor, pair_window_NN: torch.Tensor) -> float:
    """kappa: max over receivers (node, rail) and windows of (sum v)^2 / sum v^2.

    v runs over the remote source nodes sending into that receiver port in that window, weighted
    by volume: k equal senders give k, one dominant sender gives ~1. 1.0 when nothing is sent.

    Args:
        rail_load_NRN: [N_src, R, N_dst] records (or bytes) per (source node, rail, destination).
        pair_window_NN: [N, N] int64, window (wave) index of each ordered node pair; entries < 0
            (the diagonal) are not remote.
    """
    n, r, _ = rail_load_NRN.shape
    num_windows = int(pair_window_NN.max().item()) + 1 if n > 1 else 0
    if num_windows <= 0:
        return 1.0
    load = rail_load_NRN.to(torch.float64)  # [s, r, d]
    win_onehot = torch.nn.functional.one_hot(pair_window_NN.clamp(min=0), num_windows).to(
        torch.float64
    )
    win_onehot = win_onehot * (pair_window_NN >= 0).unsqueeze(-1)  # [s, d, V]
    total = torch.einsum("srd,sdv->vrd", load, win_onehot)
    squares = torch.einsum("srd,sdv->vrd", load * load, win_onehot)
    valid = squares > 0
    if not bool(valid.any()):
        return 1.0
    return float((total[valid] ** 2 / squares[valid]).max().item())


def traffic_stats(
    records_NGN: torch.Tensor,
    rail_load_NRN: torch.Tensor,
    pair_window_NN: torch.Tensor,
    topo: RailTopology,
    *,
    record_bytes: int,
    scales: SelectorScales | None = None,
) -> TrafficStats:
    """Descriptors of a phase.

    Args:
        records_NGN: [N_src, G, N_dst] records owned by each source GPU per destination node
            (the demand, before any relay).
        rail_load_NRN: [N_src, R, N_dst] records leaving on each rail (the execution's egress).
        pair_window_NN: [N, N] window of each remote node pair in that execution.
        record_bytes: payload bytes of one record (hidden size x element size).
    """
    remote = _remote_NGN(records_NGN)
    per_gpu = remote.sum(dim=-1).to(torch.float64) * record_bytes  # [N, G]
    b_mean = per_gpu.mean().item()
    b_max = per_gpu.max().item()
    rho = rail_imbalance(rail_load_NRN, topo)
    kappa = receiver_concentration(rail_load_NRN, pair_window_NN)
    ref, rho_scale, kappa_scale = (scales or SelectorScales()).resolve(topo)
    coord_b = math.log2(b_mean / ref) if b_mean > 0 else -math.inf
    coords = (coord_b, (rho - 1.0) / rho_scale, (kappa - 1.0) / kappa_scale)
    return TrafficStats(
        B_mean_bytes=b_mean,
        B_max_bytes=b_max,
        rho_g=rho,
        kappa=kappa,
        coords=coords,
        records_total=int(records_NGN.sum().item()),
        remote_records=int(remote.sum().item()),
    )
