"""Bytes on the wire of one dispatch + combine: RailWave paths (counted from the
``ExecutionSchedule``, the same table the exchange executes) and Megatron's ``alltoall``
dispatcher (from the routing maps). Pure functions; no communication.

Letters: N nodes, G GPUs per node, R rails, W = N * G ranks, T tokens per rank, E experts,
E_node experts of one node, H hidden.

What travels (forward dispatch + combine):
  * RailWave: rows of the schedule's wire format (``schedule.RecordWireFormat``): a dispatch
    row per record (hidden row, the node's probs, int32 metadata), a combine row (hidden row)
    back. Stage 2 (rail phases) is the only inter-node traffic; stage 1 relays and stage 3
    deliveries to another GPU are node-local (NVLink).
  * alltoall, dispatch: one *entry* per (token, expert): the hidden row and one float32 prob;
    combine returns the hidden row. An entry for a remote node crosses the network on the source
    GPU's rail; an entry for another GPU of the same node is node-local.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_railwave.schedule import Direction, ExecutionSchedule, PhaseKind, RecordWireFormat
from megatron_railwave.topology import RailTopology

__all__ = [
    "RecordBytes",
    "railwave_record_bytes",
    "alltoall_entry_bytes",
    "railwave_bytes",
    "alltoall_bytes",
]


RecordBytes = dict[str, int]
"""``{"dispatch": bytes per row sent by dispatch, "combine": bytes per row returned by combine,
"payload": hidden row bytes}``."""


def railwave_record_bytes(wire: RecordWireFormat) -> RecordBytes:
    """Bytes of one RailWave row in each direction (from the schedule's wire format)."""
    return {
        "payload": wire.payload_bytes,
        "dispatch": wire.dispatch_bytes,
        "combine": wire.combine_bytes,
    }


def alltoall_entry_bytes(*, hidden: int, elem_bytes: int) -> RecordBytes:
    """Bytes of one alltoall entry: hidden row + float32 prob; combine returns the row."""
    payload = hidden * elem_bytes
    return {"payload": payload, "dispatch": payload + 4, "combine": payload}


def _per_rail(send_NG: torch.Tensor, topo: RailTopology) -> list[int]:
    rails = torch.tensor(topo.rail_of_gpu, dtype=torch.int64)
    return (
        torch.zeros(topo.num_rails, dtype=torch.int64).index_add_(0, rails, send_NG.sum(0)).tolist()
    )


def _imbalance(send_NG: torch.Tensor) -> float:
    """max / mean of the per-(node, GPU) inter-node send load (1.0 = balanced; 0 when idle)."""
    mean = send_NG.double().mean().item()
    return float(send_NG.max().item() / mean) if mean > 0 else 0.0


def _node_imbalance(send_NG: torch.Tensor) -> float:
    """Worst node's max / mean over its own GPUs (what RailBalance evens out; 0 when idle)."""
    mean_N = send_NG.double().mean(dim=1)
    ratio_N = torch.where(mean_N > 0, send_NG.double().amax(dim=1) / mean_N.clamp(min=1e-30), 0.0)
    return float(ratio_N.max())


def railwave_bytes(schedule: ExecutionSchedule) -> dict[str, Any]:
    """Stage-2 (inter-node) and node-local rows and bytes of one path, forward dispatch + combine.

    Args:
        schedule: compiled with every node's deliveries (``compile_schedule(plan, wire,
            demand=full DemandCounts)``) for the node-local counts.

    Returns:
        ``inter_node_records``; ``inter_node_bytes`` (records x (dispatch + combine row bytes));
        ``inter_node_payload_bytes`` (records x hidden row); ``rail_send_bytes_NG`` [N][G]
        stage-2 bytes each GPU sends; ``rail_bytes_R`` [R] summed over nodes; ``rail_imbalance``
        (max/mean over all GPUs); ``node_rail_imbalance`` (worst node's max/mean over its GPUs);
        ``relayed_records`` (stage 1); ``delivered_copies`` (stage 3 to another GPU);
        ``node_local_bytes`` (stage 1 + stage 3, both directions).
    """
    topo = schedule.plan.topology
    n, g = topo.num_nodes, topo.gpus_per_node
    if len(schedule.delivery_nodes) != n:
        raise ValueError(
            "railwave_bytes needs a schedule compiled with every node's deliveries (full demand)"
        )
    wire = schedule.wire
    both = wire.dispatch_bytes + wire.combine_bytes
    send_NG = torch.zeros(n * g, dtype=torch.int64)
    relayed = delivered = 0
    for phase in schedule.phases:
        if phase.direction != Direction.DISPATCH:
            continue
        src, dst, rows = schedule.transfers(phase)
        off = src != dst
        if phase.kind == PhaseKind.RAIL:
            send_NG.index_add_(0, src, rows)
        elif phase.kind == PhaseKind.RELAY:
            relayed += int(rows[off].sum())
        else:
            delivered += int(rows[off].sum())
    send_NG = send_NG.view(n, g)
    records = int(send_NG.sum())
    return {
        "inter_node_records": records,
        "inter_node_bytes": records * both,
        "inter_node_payload_bytes": records * wire.payload_bytes,
        "rail_send_bytes_NG": (send_NG * both).tolist(),
        "rail_bytes_R": [b * both for b in _per_rail(send_NG, topo)],
        "rail_imbalance": _imbalance(send_NG),
        "node_rail_imbalance": _node_imbalance(send_NG),
        "relayed_records": relayed,
        "delivered_copies": delivered,
        "node_local_bytes": (relayed + delivered) * both,
    }


def alltoall_bytes(
    routing_maps: list[torch.Tensor], topo: RailTopology, rec: RecordBytes
) -> dict[str, Any]:
    """The same quantities for Megatron's alltoall (one entry per (token, expert)).

    Args:
        routing_maps: W tensors [T, E] bool (rank w's routing map), global.

    Returns:
        ``inter_node_entries``, ``inter_node_bytes``, ``inter_node_payload_bytes``,
        ``rail_send_bytes_NG`` [N][G] (an entry leaves on its source GPU's rail),
        ``rail_bytes_R``, ``rail_imbalance``, ``node_rail_imbalance``, ``node_local_entries``,
        ``node_local_bytes``.
    """
    n, g = topo.num_nodes, topo.gpus_per_node
    both = rec["dispatch"] + rec["combine"]
    send_NG = torch.zeros(n, g, dtype=torch.int64)
    node_local = 0
    for rank, routing in enumerate(routing_maps):
        s, l = divmod(rank, g)
        per_gpu = routing.reshape(routing.shape[0], n, g, routing.shape[1] // (n * g)).sum(
            dim=(0, 3)
        )  # [d, j]
        remote = int(per_gpu.sum() - per_gpu[s].sum())
        send_NG[s, l] = remote
        node_local += int(per_gpu[s].sum() - per_gpu[s, l])
    entries = int(send_NG.sum())
    return {
        "inter_node_entries": entries,
        "inter_node_bytes": entries * both,
        "inter_node_payload_bytes": entries * rec["payload"],
        "rail_send_bytes_NG": (send_NG * both).tolist(),
        "rail_bytes_R": [b * both for b in _per_rail(send_NG, topo)],
        "rail_imbalance": _imbalance(send_NG),
        "node_rail_imbalance": _node_imbalance(send_NG),
        "node_local_entries": node_local,
        "node_local_bytes": node_local * both,
    }
