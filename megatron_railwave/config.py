"""User configuration of the RailWave dispatcher (``RailWaveConfig``), from a dict or YAML."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any, Literal

import yaml

from .planner import EligiblePolicy, PlanOptions, parse_path
from .topology import RailTopology, load_topology

__all__ = ["RailWaveConfig", "load_config"]

PathName = Literal["auto", "native", "rail", "perm", "joint"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RailWaveConfig:
    """How ``RailWaveTokenDispatcher`` plans and executes every MoE layer."""

    path: PathName = "auto"
    """Execution path: a fixed one, or 'auto' (the calibrated selector; JOINT without anchors)."""
    cluster: str | None = None
    """Cluster YAML (configs/clusters/*.yaml); its topology must match the EP size."""
    gpus_per_node: int | None = None
    """G; default: the cluster file, else torchrun's LOCAL_WORLD_SIZE."""
    rail_of_gpu: tuple[int, ...] = ()
    """Rail of each local GPU; default one rail per GPU."""
    rail_gbps: float = 400.0
    """NIC port rate (used by descriptors and tools only)."""
    failed_rails: tuple[tuple[int, int], ...] = ()
    """(node, rail) ports that must not carry traffic."""
    policy: EligiblePolicy = EligiblePolicy.ALL
    """RailBalance eligible-rail policy: all, active or mask."""
    rail_mask: tuple[tuple[int, ...], ...] = ()
    """[N][G] 0/1 allowed GPUs for policy 'mask'."""
    fanin: int = 1
    """Wave schedule: senders per receiver per wave (1 = the paper's cyclic schedule)."""
    anchors: str | None = None
    """Selector anchors YAML (``railwave calibrate``); None = always JOINT for 'auto'."""
    payload_ratio: float = 1.25
    """Selector: reuse an anchor only within this payload ratio."""
    shape_distance: float = 0.02
    """Selector: ... and within this distance on both shape coordinates."""
    log_dir: str | None = None
    """Write one JSONL record per MoE layer per logged step here."""
    log_interval: int = 1
    """Log every this many steps (a step = one forward of layer 1)."""
    log_mode: Literal["rank", "job"] = "rank"
    """JSONL layout: 'rank' = one file per rank, 'job' = one file written by global rank 0."""
    timeout_s: float | None = None
    """Per-transfer completion limit: a stuck rail raises an error naming it (None: the
    process group's timeout)."""
    capture_dir: str | None = None
    """Record routing traces for replay here."""
    capture_interval: int = 100
    """... every this many steps."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Unrecognised keys are rejected; this is reserved for tools."""

    def __post_init__(self) -> None:
        if self.path != "auto":
            parse_path(self.path)  # raises with the allowed names
            object.__setattr__(self, "path", str(parse_path(self.path)))
        try:
            object.__setattr__(self, "policy", EligiblePolicy(self.policy))
        except ValueError:
            raise ValueError(
                f"policy={self.policy!r} is not one of {[p.value for p in EligiblePolicy]}"
            ) from None
        if self.fanin < 1:
            raise ValueError(f"fanin must be >= 1, got {self.fanin}")
        if self.payload_ratio < 1 or self.shape_distance < 0:
            raise ValueError(
                f"payload_ratio must be >= 1 and shape_distance >= 0, got {self.payload_ratio}, "
                f"{self.shape_distance}"
            )
        if self.log_mode not in ("rank", "job"):
            raise ValueError(f"log_mode must be 'rank' or 'job', got {self.log_mode!r}")
        if self.log_interval < 1 or self.capture_interval < 1:
            raise ValueError("log_interval and capture_interval must be >= 1")
        object.__setattr__(self, "failed_rails", tuple(tuple(map(int, f)) for f in self.failed_rails))
        object.__setattr__(self, "rail_of_gpu", tuple(int(r) for r in self.rail_of_gpu))

    # ------------------------------------------------------------------ derived
    def topology(self, ep_size: int) -> RailTopology:
        """The topology for an expert-parallel group of ``ep_size`` ranks."""
        overrides: dict[str, Any] = {}
        if self.failed_rails:
            overrides["failed_rails"] = [list(f) for f in self.failed_rails]
        if self.cluster:
            topo = load_topology(self.cluster, **overrides)
            topo.check_world_size(ep_size)
            return topo
        g = self.gpus_per_node
        if g is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ValueError(
                    "RailWave needs the GPUs per node: set gpus_per_node (or cluster) in the "
                    "railwave config, or launch with torchrun (LOCAL_WORLD_SIZE)"
                )
            g = int(env)
        # An EP group smaller than a node lives inside one node (NVLink only).
        g = min(g, ep_size)
        if ep_size % g:
            raise ValueError(
                f"EP size {ep_size} is not a multiple of gpus_per_node={g}; an EP group must span "
                "whole nodes"
            )
        return RailTopology(
            num_nodes=ep_size // g,
            gpus_per_node=g,
            rail_of_gpu=self.rail_of_gpu,
            rail_gbps=self.rail_gbps,
            failed_rails=frozenset(self.failed_rails),
            name=f"{ep_size // g}x{g}",
        )

    def plan_options(self, topo: RailTopology) -> PlanOptions:
        mask = None
        if self.policy == EligiblePolicy.MASK:
            import torch

            if not self.rail_mask:
                raise ValueError("policy 'mask' needs rail_mask: [N][G] of 0/1")
            mask = torch.tensor(self.rail_mask, dtype=torch.bool)
        return PlanOptions(policy=self.policy, rail_mask_NG=mask, fanin=self.fanin)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["policy"] = str(self.policy)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "railwave config") -> RailWaveConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        kwargs = dict(data)
        for key in ("failed_rails", "rail_mask"):
            if key in kwargs:
                kwargs[key] = tuple(tuple(v) for v in kwargs[key] or ())
        if "rail_of_gpu" in kwargs:
            kwargs["rail_of_gpu"] = tuple(kwargs["rail_of_gpu"] or ())
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def load_config(config: RailWaveConfig | dict[str, Any] | str | os.PathLike | None) -> RailWaveConfig:
    """A ``RailWaveConfig`` from itself, a dict, a YAML path, or None (defaults)."""
    if config is None:
        return RailWaveConfig()
    if isinstance(config, RailWaveConfig):
        return config
    if isinstance(config, dict):
        return RailWaveConfig.from_dict(config)
    path = FsPath(config)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"railwave config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"railwave config file {str(path)!r} is not valid YAML: {exc}") from None
    return RailWaveConfig.from_dict(data or {}, source=f"railwave config {str(path)!r}")
