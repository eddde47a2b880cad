"""Rail-optimized cluster topology: nodes, GPUs, rails (NIC ports) and failed rails.

Letters: N nodes, G GPUs per node, R rails per node.

GPU ``l`` of every node sends and receives scale-out traffic on rail ``rail_of_gpu[l]`` (its NIC
port), which hangs off that rail's leaf switch; traffic between GPU (s, l) and GPU (d, l) crosses
one switch. A *failed* rail (node, rail) can neither send nor receive, so a record may leave node s
on GPU l only if rail ``rail_of_gpu[l]`` is healthy on both s and the destination node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_railwave import presets

__all__ = [
    "RailTopology",
    "load_topology",
    "resolve_cluster_file",
    "read_yaml",
    "CLUSTER_PRESET_DIR",
]

CLUSTER_PRESET_DIR = presets.packaged_dir("clusters")
"""Cluster presets (``h800_4x8``, ...), package data (megatron_railwave/configs/clusters): a
cluster given by name is looked up here, in a source checkout and an installed wheel alike."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RailTopology:
    """A cluster of ``num_nodes`` x ``gpus_per_node`` GPUs with one NIC port (rail) per GPU."""

    num_nodes: int
    """N: number of nodes."""
    gpus_per_node: int
    """G: GPUs per node (local ranks 0..G-1)."""
    rail_of_gpu: tuple[int, ...] = ()
    """Rail (NIC port) index of each local GPU, length G; default one rail per GPU (identity)."""
    num_rails: int = 0
    """R: rails per node; default ``max(rail_of_gpu) + 1``."""
    rail_gbps: float = 400.0
    """Line rate of one NIC port in Gbit/s."""
    adapter_of_rail: tuple[int, ...] = ()
    """Physical adapter of each rail (H20: two ports share one adapter); default one per rail."""
    adapter_gbps: float = 0.0
    """Capacity of one adapter in Gbit/s (0 = no adapter limit beyond the ports)."""
    nvlink_gBps: float = 155.0
    """Per-GPU NVLink bandwidth in GB/s (intra-node relay and delivery)."""
    failed_rails: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    """Failed (node, rail) ports: they carry no traffic in either direction."""
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {self.num_nodes!r}")
        if not isinstance(self.gpus_per_node, int) or not 1 <= self.gpus_per_node <= 8:
            # Records carry a bit mask of target GPUs of one node (M = 2**G masks): G <= 8.
            raise ValueError(
                f"gpus_per_node must be an integer in 1..8, got {self.gpus_per_node!r}"
            )
        rails = self.rail_of_gpu or tuple(range(self.gpus_per_node))
        object.__setattr__(self, "rail_of_gpu", tuple(int(r) for r in rails))
        if len(self.rail_of_gpu) != self.gpus_per_node:
            raise ValueError(
                f"rail_of_gpu has {len(self.rail_of_gpu)} entries but gpus_per_node is "
                f"{self.gpus_per_node}; give one rail index per local GPU"
            )
        num_rails = self.num_rails or max(self.rail_of_gpu) + 1
        object.__setattr__(self, "num_rails", int(num_rails))
        for gpu, rail in enumerate(self.rail_of_gpu):
            if not 0 <= rail < self.num_rails:
                raise ValueError(
                    f"rail_of_gpu[{gpu}] = {rail} is out of range: rails are "
                    f"0..{self.num_rails - 1}"
                )
        adapters = self.adapter_of_rail or tuple(range(self.num_rails))
        object.__setattr__(self, "adapter_of_rail", tuple(int(a) for a in adapters))
        if len(self.adapter_of_rail) != self.num_rails:
            raise ValueError(
                f"adapter_of_rail has {len(self.adapter_of_rail)} entries, expected one per rail "
                f"({self.num_rails})"
            )
        if self.rail_gbps <= 0 or self.nvlink_gBps <= 0:
            raise ValueError(
                f"bandwidths must be positive: rail_gbps={self.rail_gbps}, "
                f"nvlink_gBps={self.nvlink_gBps}"
            )
        failed = frozenset((int(n), int(r)) for n, r in self.failed_rails)
        object.__setattr__(self, "failed_rails", failed)
        for node, rail in failed:
            if not 0 <= node < self.num_nodes:
                raise ValueError(
                    f"failed rail ({node}, {rail}): node {node} is out of range "
                    f"0..{self.num_nodes - 1}"
                )
            if not 0 <= rail < self.num_rails:
                raise ValueError(
                    f"failed rail ({node}, {rail}): rail {rail} is out of range "
                    f"0..{self.num_rails - 1}"
                )
        for node in range(self.num_nodes):
            if all(not self.rail_healthy(node, r) for r in set(self.rail_of_gpu)):
                raise ValueError(
                    f"every rail of node {node} is failed: node {node} cannot reach the network; "
                    "remove the node from the job or mark fewer rails failed"
                )
        if self.num_nodes > 1:
            for s in range(self.num_nodes):
                for d in range(self.num_nodes):
                    if s != d and not any(self.pair_gpu_eligible(s, d)):
                        raise ValueError(
                            f"nodes {s} and {d} share no healthy rail (failed: "
                            f"{sorted(self.failed_rails)}); a record from {s} to {d} has no path"
                        )

    # ------------------------------------------------------------------ derived sizes
    @property
    def world_size(self) -> int:
        """W = N * G."""
        return self.num_nodes * self.gpus_per_node

    @property
    def rail_bytes_per_s(self) -> float:
        return self.rail_gbps * 1e9 / 8

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gBps * 1e9

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus_per_node + local

    # ------------------------------------------------------------------ health
    def rail_healthy(self, node: int, rail: int) -> bool:
        return (node, rail) not in self.failed_rails

    def gpu_rail_healthy(self, node: int, gpu: int) -> bool:
        return self.rail_healthy(node, self.rail_of_gpu[gpu])

    def pair_gpu_eligible(self, src_node: int, dst_node: int) -> list[bool]:
        """Local GPUs l whose rail is healthy on both ends of (src_node -> dst_node)."""
        return [
            self.gpu_rail_healthy(src_node, l) and self.gpu_rail_healthy(dst_node, l)
            for l in range(self.gpus_per_node)
        ]

    def with_failed_rails(
        self, failed: set[tuple[int, int]] | frozenset[tuple[int, int]]
    ) -> RailTopology:
        """A copy with ``failed`` added to the failed rails."""
        return _replace(self, failed_rails=self.failed_rails | frozenset(failed))

    def with_nodes(self, num_nodes: int) -> RailTopology:
        """The same node design with another node count (failed rails must still fit)."""
        return _replace(
            self,
            num_nodes=num_nodes,
            failed_rails=frozenset(f for f in self.failed_rails if f[0] < num_nodes),
        )

    def check_world_size(self, world_size: int) -> None:
        """Raise if the expert-parallel world does not match nodes x GPUs."""
        if world_size != self.world_size:
            raise ValueError(
                f"topology {self.name!r} has {self.num_nodes} nodes x {self.gpus_per_node} GPUs = "
                f"{self.world_size} ranks, but the expert-parallel group has {world_size} ranks; "
                "set gpus_per_node (or LOCAL_WORLD_SIZE) and num_nodes so that their product is "
                "the EP size"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "rail_of_gpu": list(self.rail_of_gpu),
            "num_rails": self.num_rails,
            "rail_gbps": self.rail_gbps,
            "adapter_of_rail": list(self.adapter_of_rail),
            "adapter_gbps": self.adapter_gbps,
            "nvlink_gBps": self.nvlink_gBps,
            "failed_rails": sorted([list(f) for f in self.failed_rails]),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "topology") -> RailTopology:
        """Build from a mapping (the YAML schema); errors name the offending key."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{source}: expected a mapping of topology keys, got {type(data).__name__}"
            )
        known = {f for f in cls.__dataclass_fields__}  # type: ignore[attr-defined]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {unknown}; allowed keys are {sorted(known)}"
            )
        for key in ("num_nodes", "gpus_per_node"):
            if key not in data:
                raise ValueError(f"{source}: missing required key {key!r}")
            if not isinstance(data[key], int) or isinstance(data[key], bool):
                raise ValueError(f"{source}: key {key!r} must be an integer, got {data[key]!r}")
        kwargs = dict(data)
        for key in ("rail_of_gpu", "adapter_of_rail"):
            if key in kwargs:
                if not isinstance(kwargs[key], list) or not all(
                    isinstance(v, int) for v in kwargs[key]
                ):
                    raise ValueError(
                        f"{source}: key {key!r} must be a list of integers, got {kwargs[key]!r}"
                    )
                kwargs[key] = tuple(kwargs[key])
        for key in ("rail_gbps", "adapter_gbps", "nvlink_gBps"):
            if key in kwargs and (
                not isinstance(kwargs[key], (int, float)) or isinstance(kwargs[key], bool)
            ):
                raise ValueError(f"{source}: key {key!r} must be a number, got {kwargs[key]!r}")
        if "failed_rails" in kwargs:
            fr = kwargs["failed_rails"] or []
            if not isinstance(fr, list) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p)
                for p in fr
            ):
                raise ValueError(
                    f"{source}: key 'failed_rails' must be a list of [node, rail] pairs, got {fr!r}"
                )
            kwargs["failed_rails"] = frozenset((int(n), int(r)) for n, r in fr)
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def _replace(topo: RailTopology, **changes: Any) -> RailTopology:
    data = {f: getattr(topo, f) for f in topo.__dataclass_fields__}  # type: ignore[attr-defined]
    data.update(changes)
    return RailTopology(**data)


def resolve_cluster_file(cluster: str | Path) -> Path:
    """The YAML file of ``cluster``: an existing file, else the preset of that name
    (``presets.resolve``).

    Raises:
        ValueError: neither a file nor a preset (the message lists the presets), or a directory.
    """
    return presets.resolve(cluster, "clusters", "cluster")


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML document in ``path`` (None for an empty file): the one reader of the runtime's
    files (cluster, railwave config).

    Raises:
        FileNotFoundError: no such file (the caller says what a missing file means).
        ValueError: not valid YAML; names ``what`` (e.g. "cluster file"), the path and the parser's
            message.
    """
    text = Path(path).read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None


def load_topology(path: str | Path, **overrides: Any) -> RailTopology:
    """Read a cluster YAML file or preset (see ``resolve_cluster_file``); ``overrides`` replace
    keys."""
    path = resolve_cluster_file(path)
    data = read_yaml(path, "cluster file")
    if isinstance(data, dict) and "topology" in data:
        data = data["topology"]
    if isinstance(data, dict):
        data = {**data, **overrides}
    return RailTopology.from_dict(data, source=f"cluster file {str(path)!r}")
