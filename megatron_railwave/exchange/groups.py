"""Process groups of a rail-optimized expert-parallel group, created once, collectively.

Letters: N nodes, G GPUs per node. EP rank e sits on node e // G as local GPU e % G.

* EP (count) group: every EP rank; the per-layer count exchange. Our own copy of the EP group,
  so that it carries RailWave's ``timeout_s`` (Megatron's EP group keeps its own timeout).
* node group n: the G ranks of node n (the NVLink domain): stage 1 relay and stage 3 delivery.
* rail group l: local GPU l of every node (rail l): stage 2, the only inter-node traffic, as with
  DeepEP and NCCL PXN.

``build_rail_groups`` runs at dispatcher construction, before any data moves: every EP rank
creates its count group, then its node group, then its rail group (``new_group`` with
``use_local_synchronization=True``: only members take part, in the same order everywhere), and
warms each up with one tiny all-reduce, so NCCL communicators exist before the first layer and no
later point-to-point batch is the first call of its group. Each group gets ``timeout_s``.

When a step fails, ``survey_unresponsive`` names the peers that never reached it: the ranks that
did write a key into the job's store and wait briefly for the others.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..topology import RailTopology
from .transport import GroupRef

__all__ = ["RankGroups", "build_rail_groups", "rank_groups", "virtual_rank_groups", "survey_unresponsive"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """This rank's groups within one expert-parallel group.

    Attributes:
        ep: the count group (all EP ranks; group rank = EP rank).
        node: the G ranks of this rank's node; group rank = local GPU index.
        rail: local GPU ``local`` of every node; group rank = node index (index = local GPU).
        ep_rank: this rank's index in the EP group.
        node_index: this rank's node.
        local: this rank's local GPU index (= its rail group).
        global_ranks: global rank of each EP rank (for messages; equals the EP ranks in the
            virtual cluster).
    """

    ep: GroupRef
    node: GroupRef
    rail: GroupRef
    ep_rank: int
    node_index: int
    local: int
    global_ranks: tuple[int, ...]


def _members(topo: RailTopology, ep_rank: int) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    g = topo.gpus_per_node
    node, local = divmod(ep_rank, g)
    return node, local, tuple(node * g + j for j in range(g)), tuple(n * g + local for n in range(topo.num_nodes))


def _node_label(node: int) -> str:
    return f"node {node} (NVLink)"


def _rail_label(topo: RailTopology, local: int) -> str:
    return f"rail {topo.rail_of_gpu[local]} (GPU {local} of every node)"


def rank_groups(topo: RailTopology, ep_rank: int, *, ep_handle: Any = None, node_handle: Any = None,
                rail_handle: Any = None, global_ranks: tuple[int, ...] | None = None) -> RankGroups:
    """``RankGroups`` of ``ep_rank`` around existing process groups (None: the virtual cluster).

    The handles must be the EP group, this rank's node group (members in local-GPU order) and
    its rail group (members in node order), as ``build_rail_groups`` creates them.
    """
    node, local, node_ranks, rail_ranks = _members(topo, ep_rank)
    world = tuple(range(topo.world_size))
    return RankGroups(ep=GroupRef(kind="ep", index=0, ranks=world, handle=ep_handle),
                      node=GroupRef(kind="node", index=node, ranks=node_ranks, handle=node_handle,
                                    label=_node_label(node)),
                      rail=GroupRef(kind="rail", index=local, ranks=rail_ranks, handle=rail_handle,
                                    label=_rail_label(topo, local)),
                      ep_rank=ep_rank, node_index=node, local=local, global_ranks=global_ranks or world)


def virtual_rank_groups(topo: RailTopology, ep_rank: int) -> RankGroups:
    """Groups of ``ep_rank`` for the in-process virtual cluster (no process groups)."""
    return rank_groups(topo, ep_rank)


_CACHE: dict[tuple, RankGroups] = {}


def build_rail_groups(ep_group: dist.ProcessGroup | None, topo: RailTopology, *,
                      timeout_s: float | None = None) -> RankGroups:
    """Create and warm up (once per EP membership, G and timeout) this rank's groups.

    Collective: yes (every EP rank, at construction). Host sync: yes (the warm-ups).
    """
    global_ranks = tuple(dist.get_process_group_ranks(ep_group) if ep_group is not None
                         else range(dist.get_world_size()))
    topo.check_world_size(len(global_ranks))
    key = (global_ranks, topo.gpus_per_node, topo.rail_of_gpu, timeout_s)
    if key in _CACHE:
        return _CACHE[key]
    ep_rank = global_ranks.index(dist.get_rank())
    node, local, node_ranks, rail_ranks = _members(topo, ep_rank)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    backend = dist.get_backend(ep_group)
    handles = []
    for members in (range(len(global_ranks)), node_ranks, rail_ranks):
        handles.append(dist.new_group([global_ranks[e] for e in members], timeout=timeout,
                                      use_local_synchronization=True))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    for handle in handles:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=handle)  # creates the communicator now, collectively
    groups = rank_groups(topo, ep_rank, ep_handle=handles[0], node_handle=handles[1], rail_handle=handles[2],
                         global_ranks=global_ranks)
    _CACHE[key] = groups
    return groups


def survey_unresponsive(groups: RankGroups, call: int, stage: str, group: GroupRef,
                        *, grace_s: float = 2.0) -> list[int]:
    """EP ranks of ``group`` that did not report reaching ``stage`` of call ``call``.

    Every rank that fails a step writes ``railwave/<call>/<stage>/<group>/<rank>`` into the
    default store and waits up to ``grace_s`` for its group's other members to do the same:
    a peer that never reached the step (stalled, dead) does not report. Only runs after a
    failure; returns [] when the job has no reachable store.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - naming peers is best effort
        return []
    prefix = f"railwave/{call}/{stage}/{group.kind}{group.index}"
    try:
        store.set(f"{prefix}/{groups.ep_rank}", "1")
    except Exception:  # noqa: BLE001
        return []
    missing = [r for r in group.ranks if r != groups.ep_rank]
    deadline = time.monotonic() + grace_s
    while missing and time.monotonic() < deadline:
        try:
            missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
        except Exception:  # noqa: BLE001
            return []
        if missing:
            time.sleep(0.05)
    return missing
