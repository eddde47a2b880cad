"""Process groups of a rail-optimized expert-parallel group, created once, collectively.

Letters: N nodes, G GPUs per node. Ranks here are *railwave ranks* r = node * G + local
(``exchange.placement``: built from the facts every EP rank reported; equal to the EP ranks when
the launcher numbers ranks node by node).

* EP (count) group: every EP rank; the per-layer count exchange. Our own copy of the EP group,
  so that it carries RailWave's ``timeout_s`` (Megatron's EP group keeps its own timeout).
* node group n: the G ranks of node n (the NVLink domain): stage 1 relay and stage 3 delivery.
* rail group l: local GPU l of every node (rail l): stage 2, the only inter-node traffic, as with
  DeepEP and NCCL PXN.

``build_rail_groups`` runs at dispatcher construction, before any data moves: every EP rank
creates its count group, then its node group, then its rail group (``new_group`` with
``use_local_synchronization=True``: only members take part, in the same order everywhere), and
warms each up with one tiny all-reduce, so NCCL communicators exist before the first layer and no
later point-to-point batch is the first call of its group. Each group gets ``timeout_s``: on
NCCL that timeout (the watchdog's) is what bounds every wait of the exchange, whose waits are
stream waits (``transport.TorchDistTransport._wait_work``).

A default group bound to a device (``init_process_group(device_id=...)``, as Megatron does
on recent versions) makes torch create every new NCCL group by ``ncclCommSplit`` of the world
communicator: a collective of *all* world ranks, non-members included, which
``use_local_synchronization=True`` never gets (only members call ``new_group``; ranks without
a RailWave layer never call it at all): the job would hang. ``_unbound_default_group`` lifts the
binding for the duration of our ``new_group`` calls, so that the groups' communicators are
created among their members only (``ncclCommInitRank`` at the warm-up), and restores it.
``new_group`` numbers members by global rank; each ``GroupRef`` keeps the torch group rank of
its members (``group_ranks``) where that differs from the railwave order.

When a step fails, ``survey_unresponsive`` names the peers that never reached it: the ranks that
did write a key into the job's store and wait briefly for the others.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave.exchange.placement import Placement, identity_placement
from megatron_railwave.exchange.transport import GroupRef
from megatron_railwave.topology import RailTopology

__all__ = [
    "RankGroups",
    "build_rail_groups",
    "rank_groups",
    "virtual_rank_groups",
    "survey_unresponsive",
    "report_failure",
    "reported_failures",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """This rank's groups within one expert-parallel group.

    Attributes:
        ep: the count group (all EP ranks; member index = railwave rank).
        node: the G ranks of this rank's node; member index = local GPU index.
        rail: local GPU ``local`` of every node; member index = node index (index = local GPU).
        railwave_rank: this rank's railwave rank (node * G + local), how the exchange numbers it.
        node_index: this rank's node.
        local: this rank's local GPU index (= its rail group).
        placement: the EP rank <-> railwave rank map (identity in the virtual cluster).
    """

    ep: GroupRef
    node: GroupRef
    rail: GroupRef
    railwave_rank: int
    node_index: int
    local: int
    placement: Placement

    @property
    def ep_rank(self) -> int:
        """This rank's Megatron EP rank."""
        return self.placement.ep_rank_of_railwave[self.railwave_rank]

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global rank of each railwave rank."""
        return self.placement.global_rank_of_railwave

    def ep_ranks(self, railwave_ranks: list[int]) -> list[int]:
        """Megatron EP ranks of railwave ranks (for messages)."""
        return sorted(self.placement.ep_rank_of_railwave[r] for r in railwave_ranks)


def _members(topo: RailTopology, rank: int) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    g = topo.gpus_per_node
    node, local = divmod(rank, g)
    return (
        node,
        local,
        tuple(node * g + j for j in range(g)),
        tuple(n * g + local for n in range(topo.num_nodes)),
    )


def _node_label(node: int) -> str:
    return f"node {node} (NVLink)"


def _rail_label(topo: RailTopology, local: int) -> str:
    return f"rail {topo.rail_of_gpu[local]} (GPU {local} of every node)"


def rank_groups(
    topo: RailTopology,
    railwave_rank: int,
    *,
    ep_handle: Any = None,
    node_handle: Any = None,
    rail_handle: Any = None,
    placement: Placement | None = None,
    group_ranks: tuple[tuple[int, ...] | None, ...] = (None, None, None),
) -> RankGroups:
    """``RankGroups`` of ``railwave_rank`` around existing process groups (None: the virtual
    cluster).

    The handles must be the EP group, this rank's node group and its rail group, as
    ``build_rail_groups`` creates them; ``group_ranks`` gives each one's torch group rank per
    member where it differs from the member order.
    """
    node, local, node_ranks, rail_ranks = _members(topo, railwave_rank)
    world = tuple(range(topo.world_size))
    placement = placement or identity_placement(topo.world_size, topo.gpus_per_node)
    return RankGroups(
        ep=GroupRef(kind="ep", index=0, ranks=world, handle=ep_handle, group_ranks=group_ranks[0]),
        node=GroupRef(
            kind="node",
            index=node,
            ranks=node_ranks,
            handle=node_handle,
            label=_node_label(node),
            group_ranks=group_ranks[1],
        ),
        rail=GroupRef(
            kind="rail",
            index=local,
            ranks=rail_ranks,
            handle=rail_handle,
            label=_rail_label(topo, local),
            group_ranks=group_ranks[2],
        ),
        railwave_rank=railwave_rank,
        node_index=node,
        local=local,
        placement=placement,
    )


def virtual_rank_groups(topo: RailTopology, rank: int) -> RankGroups:
    """Groups of ``rank`` for the in-process virtual cluster (no process groups)."""
    return rank_groups(topo, rank)


_CACHE: dict[tuple, RankGroups] = {}


@contextlib.contextmanager
def _unbound_default_group() -> Iterator[None]:
    """The default group without its bound device while the body runs (see module docstring):
    ``new_group`` then creates member-only communicators, not a split of the world's."""
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def build_rail_groups(
    ep_group: dist.ProcessGroup | None,
    topo: RailTopology,
    *,
    timeout_s: float | None = None,
    placement: Placement | None = None,
) -> RankGroups:
    """Create and warm up (once per EP membership, placement, G and timeout) this rank's groups.

    Args:
        ep_group: the EP process group (None: the default group).
        topo: the EP group's topology (W = EP size).
        timeout_s: the groups' timeout (None: the default).
        placement: EP rank -> railwave rank (``exchange.placement.place_ranks``); None: EP rank e
            on node e // G as local GPU e % G.

    Collective: yes (every EP rank, at construction). Host sync: yes (the warm-ups).
    """
    global_of_ep = tuple(
        dist.get_process_group_ranks(ep_group)
        if ep_group is not None
        else range(dist.get_world_size())
    )
    topo.check_world_size(len(global_of_ep))
    if placement is None:
        placement = identity_placement(len(global_of_ep), topo.gpus_per_node)
    if placement.global_rank_of_ep != global_of_ep or placement.gpus_per_node != topo.gpus_per_node:
        raise ValueError(
            f"internal: the placement ({placement.gpus_per_node} per node, global ranks "
            f"{placement.global_rank_of_ep}) does not describe this EP group {global_of_ep} "
            f"({topo.gpus_per_node} per node)"
        )
    key = (
        global_of_ep,
        placement.railwave_rank_of_ep,
        topo.gpus_per_node,
        topo.rail_of_gpu,
        timeout_s,
    )
    if key in _CACHE:
        return _CACHE[key]
    global_of_rw = placement.global_rank_of_railwave
    me = global_of_rw.index(dist.get_rank())
    node, local, node_ranks, rail_ranks = _members(topo, me)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    backend = dist.get_backend(ep_group)
    handles, orders = [], []
    with _unbound_default_group():
        for members in (range(len(global_of_rw)), node_ranks, rail_ranks):
            ranks = [global_of_rw[r] for r in members]
            handle = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
            in_group = list(
                dist.get_process_group_ranks(handle)
            )  # torch's member order (by global rank)
            order = tuple(in_group.index(r) for r in ranks)
            handles.append(handle)
            orders.append(None if order == tuple(range(len(order))) else order)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    for handle in handles:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=handle)  # creates the communicator now, collectively
    groups = rank_groups(
        topo,
        me,
        ep_handle=handles[0],
        node_handle=handles[1],
        rail_handle=handles[2],
        placement=placement,
        group_ranks=tuple(orders),
    )
    _CACHE[key] = groups
    return groups


def survey_unresponsive(
    groups: RankGroups, call: int, stage: str, group: GroupRef, *, grace_s: float = 2.0
) -> list[int]:
    """Railwave ranks of ``group`` that did not report reaching ``stage`` of call ``call``.

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
        store.set(f"{prefix}/{groups.railwave_rank}", "1")
    except Exception:  # noqa: BLE001
        return []
    missing = [r for r in group.ranks if r != groups.railwave_rank]
    deadline = time.monotonic() + grace_s
    while missing and time.monotonic() < deadline:
        try:
            missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
        except Exception:  # noqa: BLE001
            return []
        if missing:
            time.sleep(0.05)
    return missing


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - reports are best effort
        return None


def report_failure(groups: RankGroups, call: int, message: str) -> None:
    """Leave ``message`` in the job's store for call ``call`` before this rank raises without
    communicating (fixed-capacity mode's local checks), so that its peers, which then time out
    waiting for it, can say why (``reported_failures``). Best effort; host only."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"railwave/{call}/failed/{groups.railwave_rank}", message)
    except Exception:  # noqa: BLE001
        pass


def reported_failures(groups: RankGroups, call: int) -> dict[int, str]:
    """{railwave rank: message} of the EP ranks that reported a failure of call ``call``
    (``report_failure``); read only after a step of this rank failed. No waiting."""
    store = _store()
    if store is None:
        return {}
    out = {}
    for r in groups.ep.ranks:
        key = f"railwave/{call}/failed/{r}"
        try:
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return out
    return out
