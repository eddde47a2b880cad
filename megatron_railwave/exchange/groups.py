"""Process groups of a rail-optimized expert-parallel group.

Letters: N nodes, G GPUs per node. EP rank e sits on node e // G as local GPU e % G.

* node group n: the G ranks of node n (the NVLink domain): stage 1 relay and stage 3 delivery.
* rail group l: local GPU l of every node (rail l): stage 2, the only inter-node traffic, as with
  DeepEP and NCCL PXN.

Groups are created with ``use_local_synchronization=True``, so only the members of a group call
``new_group`` for it; ranks of other expert-parallel replicas need not take part. Every member
creates its node group first and its rail group second, so the creation order agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..topology import RailTopology

__all__ = ["RailGroups", "build_rail_groups"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RailGroups:
    """This rank's groups within one expert-parallel group.

    Attributes:
        ep_group: the expert-parallel group (EP rank = node * G + local).
        node_group: the G ranks of this rank's node; group rank = local GPU index.
        rail_group: local GPU ``local`` of every node; group rank = node index.
        ep_rank: this rank's index in ``ep_group``.
        node: this rank's node.
        local: this rank's local GPU index (= its rail group).
    """

    ep_group: dist.ProcessGroup | None
    node_group: dist.ProcessGroup | None
    rail_group: dist.ProcessGroup | None
    ep_rank: int
    node: int
    local: int


_CACHE: dict[tuple[tuple[int, ...], int], RailGroups] = {}


def build_rail_groups(ep_group: dist.ProcessGroup | None, topo: RailTopology) -> RailGroups:
    """Create (once per EP group membership and G) the node and rail groups of this rank.

    Collective: yes (group creation among the members of this rank's node and rail groups).
    """
    ep_ranks = tuple(dist.get_process_group_ranks(ep_group) if ep_group is not None
                     else range(dist.get_world_size()))
    topo.check_world_size(len(ep_ranks))
    key = (ep_ranks, topo.gpus_per_node)
    if key in _CACHE:
        return _CACHE[key]
    ep_rank = ep_ranks.index(dist.get_rank())
    g = topo.gpus_per_node
    node, local = divmod(ep_rank, g)
    node_ranks = [ep_ranks[node * g + j] for j in range(g)]
    rail_ranks = [ep_ranks[n * g + local] for n in range(topo.num_nodes)]
    node_group = dist.new_group(node_ranks, use_local_synchronization=True)
    rail_group = dist.new_group(rail_ranks, use_local_synchronization=True)
    groups = RailGroups(ep_group=ep_group, node_group=node_group, rail_group=rail_group,
                        ep_rank=ep_rank, node=node, local=local)
    _CACHE[key] = groups
    return groups
