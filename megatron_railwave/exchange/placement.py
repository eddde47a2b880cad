"""Where every EP rank really sits: facts gathered once, the rank map built from them and checked.

Letters: W EP ranks, N nodes, G EP ranks per node, E experts, E_loc = E / W, T tokens.

The planner and the schedule number ranks node by node: *railwave rank* ``node * G + local``.
Launchers do not promise that order (torchrun numbers node by node; Ray, SLURM's cyclic
distribution or a remapped ``CUDA_VISIBLE_DEVICES`` need not), so at construction every EP rank
sends its facts (global rank, host, launcher local rank, physical GPU, a fingerprint of its
RailWave configuration) in ONE all-gather over the EP group, and every rank builds the same
``Placement`` from them:

* nodes are the hosts, in order of their first EP rank; within a node the EP ranks are ordered by
  physical GPU (the launcher's local rank on CPU), which fixes their rails;
* every node must hold the same number G of EP ranks, on distinct GPUs, and local GPU l must sit
  on the same rail on every node (a rail group never crosses rails); a layout that breaks this
  raises one ``PlacementError`` on every rank, naming the layout and the fix;
* CPU emulation (gloo on one machine): a host whose EP ranks are all on CPU and number a multiple
  k > 1 of the configured G is split into k emulated nodes of G ranks, by launcher local rank.
* several launcher agents on one host (``torchrun --nnodes 2`` on localhost, a common way to try
  multi-node): local ranks (and, on CPU, devices) repeat on one host name. When they repeat and
  every rank of the host reports torchrun's node rank (``GROUP_RANK``), the host is split by node
  rank first, so that each agent's ranks form their own node(s).

Megatron places expert x on EP rank x // E_loc. When the railwave order differs from the EP order
(``Placement.identity`` is False), the routing map and probs columns are permuted into railwave
order on the device (``to_railwave_columns``, an ``index_select``: no host sync, and autograd
scatters the probs gradient back through the same permutation). The process groups
(``exchange.groups``) map railwave ranks to global ranks. Nothing else changes numbering.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RankFacts",
    "Placement",
    "PlacementError",
    "ConfigMismatchError",
    "local_facts",
    "gather_rank_facts",
    "check_fingerprints",
    "place_ranks",
    "identity_placement",
]

_HOST_CHARS = 48
"""Characters of the host name that travel for messages (the full name travels as a hash)."""
HOST_ENV = "RAILWAVE_HOST"
"""Overrides the host name a rank reports (containers whose host names do not identify the
machine; emulating nodes on one machine)."""


class PlacementError(ValueError):
    """The EP group's layout is one the planner cannot serve (raised on every rank)."""


class ConfigMismatchError(ValueError):
    """Ranks of one EP group run different RailWave configurations (raised on every rank)."""


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFacts:
    """What one EP rank reports about itself.

    Attributes:
        ep_rank: its rank in the EP group (Megatron's numbering).
        global_rank: its rank in the job.
        host: its host name (``RAILWAVE_HOST`` overrides; only the first 48 characters travel).
        host_id: a 63-bit hash of the full host name (what nodes are grouped by).
        local_rank: the launcher's ``LOCAL_RANK`` (-1 when unset).
        gpu: physical GPU index (``CUDA_VISIBLE_DEVICES`` resolved), -1 on CPU.
        fingerprint: one 63-bit hash per configuration field (``fields`` order).
        group_rank: the launcher's node rank (torchrun's ``GROUP_RANK``; -1 when unset).
    """

    ep_rank: int
    global_rank: int
    host: str
    host_id: int
    local_rank: int
    gpu: int
    fingerprint: tuple[int, ...]
    group_rank: int = -1

    @property
    def device_index(self) -> int:
        """The index that orders a node's ranks: the physical GPU, else the local rank."""
        return self.gpu if self.gpu >= 0 else self.local_rank


def _physical_gpu(device: torch.device) -> int:
    """Physical index of ``device`` (a CUDA device), resolving ``CUDA_VISIBLE_DEVICES``."""
    if device.type != "cuda":
        return -1
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index  # unset, or UUIDs: the ordinal is the best fact available


def local_facts(
    *, ep_rank: int, global_rank: int, device: torch.device, fingerprint: Sequence[int]
) -> RankFacts:
    """This process's facts (no communication)."""
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    return RankFacts(
        ep_rank=ep_rank,
        global_rank=global_rank,
        host=host[:_HOST_CHARS],
        host_id=_hash63(host),
        local_rank=int(os.environ.get("LOCAL_RANK", -1)),
        gpu=_physical_gpu(device),
        fingerprint=tuple(fingerprint),
        group_rank=int(os.environ.get("GROUP_RANK", -1)),
    )


def fingerprint_hashes(fields: Mapping[str, str]) -> tuple[int, ...]:
    """One hash per configuration field, in ``fields`` order."""
    return tuple(_hash63(f"{name}={value}") for name, value in fields.items())


def _encode(facts: RankFacts) -> torch.Tensor:
    host = list(facts.host.encode()[:_HOST_CHARS])
    row = [
        facts.global_rank,
        facts.local_rank,
        facts.gpu,
        facts.host_id,
        facts.group_rank,
        len(host),
    ]
    row += host + [0] * (_HOST_CHARS - len(host)) + list(facts.fingerprint)
    return torch.tensor(row, dtype=torch.int64)


def _decode(ep_rank: int, row: list[int]) -> RankFacts:
    n = row[5]
    host = bytes(row[6 : 6 + n]).decode(errors="replace")
    return RankFacts(
        ep_rank=ep_rank,
        global_rank=row[0],
        local_rank=row[1],
        gpu=row[2],
        host_id=row[3],
        host=host,
        group_rank=row[4],
        fingerprint=tuple(row[6 + _HOST_CHARS :]),
    )


def gather_rank_facts(ep_group: Any, fields: Mapping[str, str]) -> list[RankFacts]:
    """Every EP rank's facts, in EP-rank order (one all-gather of fixed-size int64 rows).

    Args:
        ep_group: the EP process group (None: the default group).
        fields: this rank's configuration fingerprint, field name -> value text.

    Collective: yes (every EP rank, once at construction). Host sync: yes (construction only).
    """
    ranks = (
        dist.get_process_group_ranks(ep_group)
        if ep_group is not None
        else list(range(dist.get_world_size()))
    )
    backend = dist.get_backend(ep_group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    me = ranks.index(dist.get_rank())
    own = local_facts(
        ep_rank=me,
        global_rank=dist.get_rank(),
        device=device,
        fingerprint=fingerprint_hashes(fields),
    )
    send = _encode(own).to(device)
    recv = torch.empty(len(ranks) * send.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(recv, send, group=ep_group)
    rows = recv.view(len(ranks), -1).cpu().tolist()
    return [_decode(e, row) for e, row in enumerate(rows)]


def check_fingerprints(facts: Sequence[RankFacts], fields: Mapping[str, str]) -> None:
    """Raise ``ConfigMismatchError`` (same text on every rank) when EP ranks disagree on a field.

    Args:
        facts: every EP rank's facts (``gather_rank_facts``).
        fields: this rank's field values (named in the message as "this rank's value").
    """
    names = list(fields)
    problems = []
    for i, name in enumerate(names):
        groups: dict[int, list[int]] = {}
        for f in facts:
            groups.setdefault(f.fingerprint[i] if i < len(f.fingerprint) else -1, []).append(
                f.ep_rank
            )
        if len(groups) > 1:
            parts = " vs ".join(f"EP ranks {ranks}" for ranks in sorted(groups.values()))
            problems.append(f"'{name}' differs ({parts})")
    if problems:
        raise ConfigMismatchError(
            "RailWave configuration differs between ranks of one EP group: "
            + "; ".join(problems)
            + ". Every EP rank must run the same RailWave config (this rank: "
            + ", ".join(f"{n}={fields[n]}" for n in names)
            + "); pass the same --railwave-config / flags "
            "to every rank."
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """The EP-rank -> (node, local GPU) map of one EP group (identical on every rank).

    Attributes:
        gpus_per_node: G, EP ranks per node.
        railwave_rank_of_ep: [W] railwave rank (node * G + local) of each EP rank.
        ep_rank_of_railwave: [W] the inverse.
        global_rank_of_ep: [W] global rank of each EP rank.
        rail_of_local: [G] rail of local GPU l (the same on every node); () = one rail per GPU.
        node_hosts: [N] host name of each node (emulated nodes: "host#k").
        emulated: True when nodes were emulated on one machine (CPU ranks).
    """

    gpus_per_node: int
    railwave_rank_of_ep: tuple[int, ...]
    ep_rank_of_railwave: tuple[int, ...]
    global_rank_of_ep: tuple[int, ...]
    rail_of_local: tuple[int, ...] = ()
    node_hosts: tuple[str, ...] = ()
    emulated: bool = False

    @property
    def world_size(self) -> int:
        return len(self.railwave_rank_of_ep)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    @property
    def identity(self) -> bool:
        """True when railwave ranks equal EP ranks (torchrun's node-by-node order)."""
        return self.railwave_rank_of_ep == tuple(range(self.world_size))

    @property
    def global_rank_of_railwave(self) -> tuple[int, ...]:
        return tuple(self.global_rank_of_ep[e] for e in self.ep_rank_of_railwave)

    def expert_columns(self, experts_per_rank: int) -> torch.Tensor:
        """[E] int64: Megatron column of each railwave-ordered expert column (CPU)."""
        rank = torch.tensor(self.ep_rank_of_railwave, dtype=torch.int64).repeat_interleave(
            experts_per_rank
        )
        return rank * experts_per_rank + torch.arange(experts_per_rank, dtype=torch.int64).repeat(
            self.world_size
        )

    def describe(self) -> str:
        """One line: every node's EP ranks in local-GPU order."""
        g = self.gpus_per_node
        nodes = []
        for n in range(self.num_nodes):
            eps = [self.ep_rank_of_railwave[n * g + j] for j in range(g)]
            host = self.node_hosts[n] if n < len(self.node_hosts) else f"node {n}"
            nodes.append(f"{host}: EP {eps}")
        return "; ".join(nodes)


def identity_placement(world_size: int, gpus_per_node: int) -> Placement:
    """EP rank e on node e // G as local GPU e % G (the virtual cluster, the CPU benchmarks)."""
    order = tuple(range(world_size))
    return Placement(
        gpus_per_node=gpus_per_node,
        railwave_rank_of_ep=order,
        ep_rank_of_railwave=order,
        global_rank_of_ep=order,
    )


_FIX = (
    "launch the same number of EP ranks on every node with contiguous EP groups "
    "(expert_tensor_parallel_size 1, EP size a multiple of the GPUs per node, or an EP group "
    "inside "
    "one node), or set gpus_per_node to the EP ranks per node"
)


def _nodes(
    facts: Sequence[RankFacts], gpus_per_node: int | None
) -> tuple[list[list[RankFacts]], list[str], bool]:
    """EP ranks per node (each in device order), node names, and whether nodes were emulated."""
    hosts: dict[int, list[RankFacts]] = {}
    for f in facts:  # hosts in order of their first EP rank
        hosts.setdefault(f.host_id, []).append(f)
    agents: list[tuple[str, list[RankFacts]]] = []
    for members in hosts.values():
        agents += _split_by_agent(members)
    nodes, names, emulated = [], [], False
    for host, members in agents:
        members = sorted(members, key=lambda f: (f.device_index, f.ep_rank))
        k, rest = divmod(len(members), gpus_per_node) if gpus_per_node else (1, 0)
        if k > 1 and rest == 0 and all(f.gpu < 0 for f in members):
            # CPU emulation: G consecutive local ranks of this machine form one node.
            emulated = True
            for i in range(k):
                nodes.append(members[i * gpus_per_node : (i + 1) * gpus_per_node])
                names.append(f"{host}#{i}")
        else:
            nodes.append(members)
            names.append(host)
    return nodes, names, emulated


def _split_by_agent(members: list[RankFacts]) -> list[tuple[str, list[RankFacts]]]:
    """One host's EP ranks as (name, ranks) per launcher agent: split by torchrun's node rank
    (``GROUP_RANK``) when device indices repeat on the host and every rank reports a node rank
    (several agents on one host); else the host as it is."""
    host = members[0].host
    devices = [f.device_index for f in members]
    repeats = len(set(devices)) != len(devices)
    if not repeats or any(f.group_rank < 0 for f in members):
        return [(host, members)]
    agents: dict[int, list[RankFacts]] = {}
    for f in members:  # agents in order of their first EP rank
        agents.setdefault(f.group_rank, []).append(f)
    if len(agents) == 1:
        return [(host, members)]
    return [(f"{host}/node{rank}", ranks) for rank, ranks in agents.items()]


def place_ranks(
    facts: Sequence[RankFacts], *, gpus_per_node: int | None = None, rail_of_gpu: Sequence[int] = ()
) -> Placement:
    """Build and check the placement from every EP rank's facts (pure; same on every rank).

    Args:
        facts: every EP rank's facts, in EP-rank order.
        gpus_per_node: G the configuration expects (cluster file or ``gpus_per_node``, at most W);
            None: the EP ranks per host.
        rail_of_gpu: rail of each physical GPU of a node (the cluster file's), () = GPU l on rail l.

    Raises:
        PlacementError: uneven EP ranks per node, two EP ranks on one GPU or one rail, or local
            GPU l on different rails on different nodes (message names the layout and the fix).
    """
    w = len(facts)
    nodes, names, emulated = _nodes(facts, gpus_per_node)
    g = gpus_per_node or len(nodes[0])
    layout = "; ".join(
        f"{name}: EP ranks {[f.ep_rank for f in members]}" for name, members in zip(names, nodes)
    )
    if any(len(members) != g for members in nodes):
        raise PlacementError(
            f"RailWave cannot serve this EP layout: {w} EP ranks over {len(nodes)} node(s) "
            f"({layout}); every node "
            f"must hold the same number of EP ranks (G = {g}). Fix: {_FIX}."
        )
    rails_per_node = []
    for name, members in zip(names, nodes):
        devices = [f.device_index for f in members]
        known = all(d >= 0 for d in devices)  # CPU ranks without LOCAL_RANK: ordered by EP rank
        if known and len(set(devices)) != len(devices):
            dup = sorted({d for d in devices if devices.count(d) > 1})
            raise PlacementError(
                f"RailWave cannot serve this EP layout: EP ranks "
                f"{[f.ep_rank for f in members if f.device_index in dup]} on {name} report the "
                f"same GPU {dup} "
                "(check LOCAL_RANK / CUDA_VISIBLE_DEVICES of the launcher)"
            )
        if emulated or not known:
            rails = list(range(g))
        else:
            if rail_of_gpu and any(d < 0 or d >= len(rail_of_gpu) for d in devices):
                raise PlacementError(
                    f"RailWave cannot serve this EP layout: {name} reports GPUs {devices} but the "
                    f"cluster file "
                    f"describes GPUs 0..{len(rail_of_gpu) - 1}; fix the cluster file or the "
                    f"launcher's GPU binding"
                )
            rails = [rail_of_gpu[d] for d in devices] if rail_of_gpu else devices
            if len(set(rails)) != len(rails) and len(set(rail_of_gpu)) == len(rail_of_gpu):
                raise PlacementError(
                    f"RailWave cannot serve this EP layout: two EP ranks of {name} share a rail "
                    f"({rails}); "
                    "each EP rank of a node needs its own NIC"
                )
        rails_per_node.append(rails)
    for name, rails in zip(names[1:], rails_per_node[1:]):
        if rails != rails_per_node[0]:
            raise PlacementError(
                f"RailWave cannot serve this EP layout ({layout}): local GPUs of {names[0]} sit "
                f"on rails "
                f"{rails_per_node[0]} but those of {name} on rails {rails}, so a rail group would "
                f"cross rails. "
                f"Give every node the same GPUs of the EP group. Fix: {_FIX}."
            )
    railwave_of_ep = [0] * w
    for n, members in enumerate(nodes):
        for local, f in enumerate(members):
            railwave_of_ep[f.ep_rank] = n * g + local
    ep_of_railwave = [0] * w
    for e, r in enumerate(railwave_of_ep):
        ep_of_railwave[r] = e
    base = rails_per_node[0]
    rails = () if base == list(range(g)) else tuple(base)
    return Placement(
        gpus_per_node=g,
        railwave_rank_of_ep=tuple(railwave_of_ep),
        ep_rank_of_railwave=tuple(ep_of_railwave),
        global_rank_of_ep=tuple(f.global_rank for f in facts),
        rail_of_local=rails,
        node_hosts=tuple(names),
        emulated=emulated,
    )
