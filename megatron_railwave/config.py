"""User configuration of the RailWave dispatcher (``RailWaveConfig``), from a dict or YAML."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_railwave import presets
from megatron_railwave.names import (
    BACKEND_NAMES,
    BackendName,
    Candidate,
    Route,
    RouteChoice,
    parse_candidate,
    parse_route,
    route_list,
)
from megatron_railwave.outputs import check_output_dir
from megatron_railwave.planner import EligiblePolicy, PlanOptions
from megatron_railwave.planner.plan import MAX_CHUNKS
from megatron_railwave.topology import RailTopology, load_topology, read_yaml, resolve_cluster_file

__all__ = ["RailWaveConfig", "OnlineSettings", "load_config"]

_REMOVED_KEYS = {
    "deepep_buffer": (
        "backend 'deepep' always runs the deep_ep wheel; the CPU fake DeepEP is a testing hook, "
        "not a user option (megatron_railwave.testing.deepep_fake: use_fake_deepep(), or "
        "build_exchange(..., deepep_api=fake_deepep_api(G))). Delete the key"
    ),
    "anchors": (
        "the offline anchors selector (and `railwave calibrate` / `validate`, which wrote and "
        "checked its files) is retired: path: auto runs the online selector, which times the "
        "paths in the job itself and reads no file (docs/selector.md, Migrating). Delete the key"
    ),
    "payload_ratio": (
        "it was the offline anchor rule's payload window, retired with the anchors selector; the "
        "online selector's neighbourhood window is online: {payload_ratio: ...}. Delete the key, "
        "or move it under online:"
    ),
    "shape_distance": (
        "it was the offline anchor rule's shape window, retired with the anchors selector; the "
        "online selector's neighbourhood window is online: {shape_distance: ...}. Delete the key, "
        "or move it under online:"
    ),
}
"""Keys a config file may still carry from an older release -> why they are gone, what replaced
them (``RailWaveConfig.from_dict`` raises with it)."""


def streamed_candidates_in_fixed_capacity(candidates: Sequence[str]) -> str:
    """The error for '+streamed' online candidates in fixed-capacity mode (the config and the
    dispatch mode raise it)."""
    return (
        f"online.candidates {list(candidates)}: fixed-capacity mode (max_tokens_per_rank) plans "
        "each path once for every call, not per candidate; set streamed: true to stream every "
        "path's relay there, or drop the +streamed candidates"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seq(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _plain(value: Any) -> Any:
    """Tuples as lists, so errors show the value as the user wrote it in YAML."""
    return [_plain(v) for v in value] if _is_seq(value) else value


def _check_sms(name: str, value: Any) -> None:
    if not _is_int(value) or value < 2 or value % 2:
        raise ValueError(
            f"{name}={value!r} must be an even integer >= 2 (DeepEP runs two SMs per channel; its "
            "default is 20)"
        )


def _field_default(config: Any, name: str) -> Any:
    """The dataclass default of ``config``'s field ``name``; None where it has none (or is not a
    dataclass)."""
    for f in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        if f.name == name:
            return None if f.default is dataclasses.MISSING else f.default
    return None


def _check_number(name: str, value: Any, *, low: float, inclusive: bool, unit: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (value == low and not inclusive):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        raise ValueError(f"{name}={value!r} must be a finite number {bound} ({unit})")


@dataclass(frozen=True, kw_only=True, slots=True)
class OnlineSettings:
    """Knobs of the online selector (``RailWaveConfig.online``; ``selector.online``); every rank
    must use the same."""

    probes: int = 2
    """Times of each candidate before exploiting (>= 1)."""
    drop_ratio: float = 1.5
    """A candidate whose times so far are all this much slower than the best median stops
    probing early, and a new neighbourhood's seed (or another layer's ratio) this much behind
    defers it to re-probes (> 1)."""
    drop_sigmas: float = 3.0
    """Once the job's own call-to-call spread is known (``selector.online.NoiseEstimate``, 16
    repeated times), the bar of ``drop_ratio`` tightens to this many standard deviations of the
    ratio of two calls (exp(drop_sigmas * sqrt(2) * sigma)), never looser than ``drop_ratio`` nor
    tighter than 1.1 (>= 0; 0: ``drop_ratio`` alone). In ``railwave online-sim`` with a
    'joint+streamed' candidate (5% noise, predicted) it took the charged total from 1.031-1.032x
    (``drop_ratio`` alone) to 1.017-1.019x the per-epoch oracle (docs/selector.md)."""
    reprobe_every: int = 25
    """Exploit calls of a neighbourhood between re-probes (>= 1)."""
    reprobe_budget: float = 0.005
    """Re-probe a candidate only when the exploit calls since its last probe, times this, reach
    its known excess over the best (median ratio - 1): re-probes cost about this share of the
    layer's time per candidate (a path 2x slower: every 200 exploit calls at 0.005; > 0)."""
    share: bool = True
    """A layer's new neighbourhood with nothing measured nearby in that layer takes its probe
    order from the nearest neighbourhood any layer of this process measured (one fabric: a path
    that is 8x slower on one layer need not be probed on each of 45 layers). False: per layer
    only."""
    window: int = 8
    """Most recent times kept per path and neighbourhood (their median decides; >= 1)."""
    payload_ratio: float = 2.0
    """Neighbourhood: payload within this ratio of its centre (>= 1) ..."""
    shape_distance: float = 0.25
    """... and both shape coordinates within this distance (>= 0)."""
    max_neighbourhoods: int = 16
    """Per layer and pass kind; the least recently used is forgotten beyond this (>= 1)."""
    max_bad: int = 3
    """Bad timings in a row that switch the layer to JOINT for the rest of the run (>= 1)."""
    candidates: tuple[str, ...] = tuple(
        str(r) for r in (Route.JOINT, Route.RAIL, Route.PERM, Route.NATIVE)
    )
    """Paths tried (NATIVE among them unless the user removes it): route names, or a route with
    its relay streamed into its rail phases ('joint+streamed', ``names.parse_candidate``; torch
    backend, normal mode). FLOW and FLOW_WAVES, the min-max routes, are allowed but not in the
    default: in ``railwave online-sim --steps 200`` they bought 0.01% of exchange time and cost
    3 s of probe planning (1.0227x the per-epoch oracle against 1.0147x without them;
    docs/selector.md). Streamed variants are not in the default either: the flow model predicts
    them 1.08-1.24x faster at token skew >= 0.5, the 4 x 4 testbed measured them 0.5-3% slower,
    and no GPU run has decided it (not yet run on hardware)."""
    capacity_sync_every: int = 4
    """Fixed-capacity mode only (``max_tokens_per_rank``): a layer's calls of one pass kind run
    in epochs of this many calls, one path per epoch; the epoch's first call is timed and the
    slowest rank's time travels on one small all-reduce, read at the next epoch's first call
    (the mode's one host wait every this many calls; docs/selector.md). >= 2: the reduce is
    posted at the epoch's second call, once the first call's timer can be read."""

    def __post_init__(self) -> None:
        for name, low in (
            ("probes", 1),
            ("reprobe_every", 1),
            ("window", 1),
            ("max_neighbourhoods", 1),
            ("max_bad", 1),
            ("capacity_sync_every", 2),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"online.{name}={value!r} must be an integer >= {low}")
        if not isinstance(self.share, bool):
            raise ValueError(f"online.share={self.share!r} must be true or false")
        for name, low, strict in (
            ("drop_ratio", 1.0, True),
            ("reprobe_budget", 0.0, True),
            ("drop_sigmas", 0.0, False),
            ("payload_ratio", 1.0, False),
            ("shape_distance", 0.0, False),
        ):
            value = getattr(self, name)
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            if not ok or value < low or (strict and value == low):
                raise ValueError(
                    f"online.{name}={value!r} must be a finite number {'>' if strict else '>='} "
                    f"{low:g}"
                )
        if self.probes > self.window:
            raise ValueError(
                f"online.probes={self.probes} exceeds online.window={self.window} (times kept per "
                f"path); "
                "raise window or lower probes"
            )
        raw = self.candidates
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)) or not raw:
            raise ValueError(
                f"online.candidates={raw!r} must be a non-empty list of paths "
                f"({route_list(extra=('<path>+streamed',))})"
            )
        try:
            paths = tuple(dict.fromkeys(str(parse_candidate(p)) for p in raw))
        except ValueError as exc:
            raise ValueError(f"online.candidates: {exc}") from None
        if str(Candidate(Route.JOINT)) not in paths:
            raise ValueError(
                f"online.candidates={list(raw)} must include joint (the fallback on bad timings)"
            )
        object.__setattr__(self, "candidates", paths)

    @classmethod
    def from_dict(cls, data: Any) -> OnlineSettings:
        if data is None:
            return cls()
        if isinstance(data, OnlineSettings):
            return data
        if not isinstance(data, dict):
            raise ValueError(
                f"online={data!r} must be a mapping of online-selector settings (or null)"
            )
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))  # type: ignore[attr-defined]
        if unknown:
            raise ValueError(
                f"online: unknown field(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )  # type: ignore[attr-defined]
        data = dict(data)
        if isinstance(data.get("candidates"), list):
            data["candidates"] = tuple(data["candidates"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            f: (list(v) if isinstance(v := getattr(self, f), tuple) else v)
            for f in self.__dataclass_fields__
        }  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True, slots=True)
class RailWaveConfig:
    """How ``RailWaveTokenDispatcher`` plans and executes every MoE layer."""

    path: RouteChoice = "auto"
    """Execution path: a fixed one, or 'auto' (chosen per layer call: ``selector``)."""
    cluster: str | None = None
    """Cluster YAML file or preset name (``h800_4x8``: ``presets``, package data under
    megatron_railwave/configs/clusters); its topology must match the EP size. In a config file a
    relative path is relative to that file."""
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
    streamed: bool = False
    """RAIL / JOINT / FLOW / FLOW_WAVES: stream the relay into the rail phases (one relay part per
    rail phase, so a rail phase waits only for its own part; ``PlanOptions.streamed``). Needs more
    than one rail phase: waves, or ``chunks`` > 1. Torch backend only."""
    fanin: int = 1
    """Wave schedule: senders per receiver per wave (1 = the paper's cyclic schedule)."""
    chunks: int = 1
    """PERM / JOINT: rail chunks per wave (each wave's records on a rail leave in this many parts,
    each delivered while the next is on the rail; 1 = whole waves, the paper's schedule). Torch
    backend only."""
    selector: Literal["online"] | None = None
    """How 'auto' decides: 'online' (each layer probes the paths and runs the fastest it measured,
    ``selector.online``), the only selector; None means the same. In fixed-capacity mode it adds
    one small all-reduce per epoch and one host wait every ``online.capacity_sync_every`` calls
    of a layer (docs/selector.md); a fixed ``path`` has neither. ('anchors', the retired offline
    rule, is refused with the migration.)"""
    online: OnlineSettings | None = None
    """The online selector's knobs (a mapping in YAML; None = the defaults)."""
    online_out: str | None = None
    """Where global rank 0 writes what the online selector learned (a small YAML report: per
    layer, pass kind and neighbourhood, the best path and the median seconds of each timed path;
    ``selector.learned``) at process exit; an existing file is never replaced by an empty report.
    No run reads it back. None = nowhere."""
    log_dir: str | None = None
    """Write one JSONL record per MoE layer per logged step here (one set of files per run)."""
    metrics: bool = True
    """Report ``railwave_*`` scalars through Megatron's MoE metrics tracker (console, TensorBoard,
    W&B). With ``metrics: false``, no ``log_dir`` and a fixed path, no descriptors or statistics
    are computed at all."""
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
    backend: BackendName = "torch"
    """Execution backend: 'torch' (torch.distributed point-to-point; any layout), 'deepep'
    (DeepEP's internode dispatch / combine: 8 GPUs per node, 2..20 nodes, bf16; not yet run on
    hardware, docs/deepep.md) or 'auto' (deepep when it imports on every rank, the job runs on
    NCCL and the layout meets DeepEP's limits; else torch)."""
    deepep_num_sms: int | None = None
    """SMs of DeepEP's normal kernels (an even number). None: Megatron's own field, as its flex
    dispatcher reads it (``moe_flex_dispatcher_num_sms``, Megatron-Core 0.19; before:
    ``moe_deepep_num_sms``), else DeepEP's default 20 (``deepep_num_sms_for``)."""
    max_tokens_per_rank: int | None = None
    """Fixed-capacity mode (like DeepEP's ``num_max_dispatch_tokens_per_rank``): every buffer of a
    layer is sized for this many tokens per rank (micro-batch x sequence / TP), so the exchange
    needs no host sync with a fixed ``path`` (``path: auto``, the online selector, adds one host
    wait, on a reduce posted ``online.capacity_sync_every`` - 1 calls earlier, every that many
    calls of a layer); a rank with more
    tokens raises. None = the normal mode (one host sync per layer, buffers sized from the
    gathered counts). Backend torch only; docs/exchange.md."""

    def __post_init__(self) -> None:
        # Every field is checked here, on every rank, before the first collective: a bad value
        # fails at install() with one line naming the field and the fix, not mid-training.
        if not isinstance(self.path, str):
            raise ValueError(f"path={self.path!r} must be a string: one of {route_list(auto=True)}")
        if self.path != "auto":
            object.__setattr__(
                self, "path", str(parse_route(self.path))
            )  # raises with the allowed names
        if self.gpus_per_node is not None and (
            not _is_int(self.gpus_per_node) or not 1 <= self.gpus_per_node <= 8
        ):
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node!r} must be an integer in 1..8 (GPUs of one "
                f"node), "
                "or null to take it from the cluster file or torchrun's LOCAL_WORLD_SIZE"
            )
        if not _is_seq(self.rail_of_gpu) or not all(
            _is_int(r) and r >= 0 for r in self.rail_of_gpu
        ):
            raise ValueError(
                f"rail_of_gpu={self.rail_of_gpu!r} must be a list of rail indices >= 0, one per "
                f"local "
                "GPU (e.g. [0, 1, 2, 3]), or [] for one rail per GPU"
            )
        if (
            self.rail_of_gpu
            and self.gpus_per_node is not None
            and len(self.rail_of_gpu) != self.gpus_per_node
        ):
            raise ValueError(
                f"rail_of_gpu has {len(self.rail_of_gpu)} entries but gpus_per_node is "
                f"{self.gpus_per_node}; give one rail index per local GPU"
            )
        object.__setattr__(self, "rail_of_gpu", tuple(int(r) for r in self.rail_of_gpu))
        _check_number(
            "rail_gbps", self.rail_gbps, low=0.0, inclusive=False, unit="Gbit/s of one NIC port"
        )
        if not _is_seq(self.failed_rails) or not all(
            _is_seq(f) and len(f) == 2 and all(_is_int(v) and v >= 0 for v in f)
            for f in self.failed_rails
        ):
            raise ValueError(
                f"failed_rails={_plain(self.failed_rails)!r} must be a list of [node, rail] pairs "
                "of integers >= 0, e.g. [[0, 3], [2, 1]]; [] when every rail is up"
            )
        object.__setattr__(
            self, "failed_rails", tuple((int(n), int(r)) for n, r in self.failed_rails)
        )
        self._check_cluster()
        try:
            object.__setattr__(self, "policy", EligiblePolicy(self.policy))
        except ValueError:
            raise ValueError(
                f"policy={self.policy!r} is not one of {[p.value for p in EligiblePolicy]}"
            ) from None
        self._check_rail_mask()
        if not _is_int(self.fanin) or self.fanin < 1:
            raise ValueError(
                f"fanin={self.fanin!r} must be an integer >= 1 (remote senders per receiver per "
                "wave; 1 = the cyclic schedule)"
            )
        if not _is_int(self.chunks) or not 1 <= self.chunks <= MAX_CHUNKS:
            raise ValueError(
                f"chunks={self.chunks!r} must be an integer in 1..{MAX_CHUNKS} (rail chunks per "
                f"wave; "
                "1 = whole waves)"
            )
        if self.selector == "anchors":
            raise ValueError(
                "selector='anchors' was removed: the offline anchors rule is retired; path: auto "
                "runs the online selector (in fixed-capacity mode too: one host wait every "
                "online.capacity_sync_every calls). Delete selector (docs/selector.md, Migrating), "
                "or set a fixed path (e.g. path: joint) for no selection and no host wait"
            )
        if self.selector not in (None, "online"):
            raise ValueError(
                f"selector={self.selector!r} must be 'online' or null (the same: the online "
                "selector decides path: auto)"
            )
        object.__setattr__(self, "online", OnlineSettings.from_dict(self.online))
        if self.selector == "online" and self.path != "auto":
            raise ValueError(
                f"selector: online chooses among paths, but path is {self.path!r}; set path: auto, "
                "or drop selector"
            )
        if self.online_out is not None:
            if (
                not isinstance(self.online_out, (str, os.PathLike))
                or Path(self.online_out).expanduser().is_dir()
            ):
                raise ValueError(
                    f"online_out={self.online_out!r} must be the path of the YAML file to write "
                    "(not a directory), or null"
                )
        for name in ("log_dir", "capture_dir"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    raise ValueError(f"{name}={value!r} must be a directory path or null")
                check_output_dir(value, name)
        if not isinstance(self.metrics, bool):
            raise ValueError(f"metrics={self.metrics!r} must be true or false")
        if self.log_mode not in ("rank", "job"):
            raise ValueError(
                f"log_mode={self.log_mode!r} must be 'rank' (one file per rank) or 'job' "
                "(one file written by global rank 0)"
            )
        for name in ("log_interval", "capture_interval"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1 (steps)")
        if self.timeout_s is not None:
            _check_number(
                "timeout_s",
                self.timeout_s,
                low=0.0,
                inclusive=False,
                unit="seconds; null = the process group's timeout",
            )
        self._check_backend()

    @property
    def streamed_candidates(self) -> tuple[str, ...]:
        """The online selector's candidates that stream their relay (``path: auto`` only)."""
        if self.path != "auto" or self.online is None:
            return ()
        return tuple(c for c in self.online.candidates if parse_candidate(c).streamed)

    def _check_backend(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend={self.backend!r} must be 'torch', 'deepep' or 'auto'")
        streamed = self.streamed_candidates
        if streamed and self.backend == "deepep":
            raise ValueError(
                f"online.candidates {list(streamed)} stream the relay into the rail phases, which "
                "runs on the torch backend only (DeepEP moves the rail and delivery stages in one "
                "call after the whole relay). Set backend: torch (or auto), or drop the "
                "+streamed candidates"
            )
        if streamed and self.max_tokens_per_rank is not None:
            raise ValueError(streamed_candidates_in_fixed_capacity(streamed))
        if self.max_tokens_per_rank is not None:
            if not _is_int(self.max_tokens_per_rank) or self.max_tokens_per_rank < 1:
                raise ValueError(
                    f"max_tokens_per_rank={self.max_tokens_per_rank!r} must be an integer >= 1 "
                    f"(the most "
                    "tokens one rank dispatches per layer: micro-batch x sequence / TP), or null "
                    "for "
                    "the normal mode"
                )
            if self.backend == "deepep":
                raise ValueError(
                    f"max_tokens_per_rank={self.max_tokens_per_rank} (fixed-capacity mode) runs "
                    f"on the "
                    "torch backend only; set backend: torch (or auto), or max_tokens_per_rank: null"
                )
        if not isinstance(self.streamed, bool):
            raise ValueError(
                f"streamed={self.streamed!r} must be true or false (stream the relay into the "
                "rail phases)"
            )
        if self.backend == "deepep" and self.streamed:
            raise ValueError(
                "streamed: true (relay streamed into the rail phases) runs on the torch backend "
                "only; DeepEP moves the rail and delivery stages in one call after the whole "
                "relay. Set backend: torch (or auto), or streamed: false"
            )
        if self.backend == "deepep" and _is_int(self.chunks) and self.chunks > 1:
            raise ValueError(
                f"chunks={self.chunks} (rail chunks per wave) runs on the torch backend only; "
                f"DeepEP "
                "dispatches whole waves. Set backend: torch (or auto), or chunks: 1"
            )
        if self.deepep_num_sms is not None:
            _check_sms("deepep_num_sms", self.deepep_num_sms)

    def deepep_num_sms_for(self, megatron_config: Any) -> int:
        """SMs of DeepEP's kernels for a layer of ``megatron_config`` (a ``TransformerConfig``).

        Megatron's flex dispatcher sizes DeepEP by ``moe_flex_dispatcher_num_sms`` (0.19; the
        deprecated ``moe_deepep_num_sms`` is routed into it) or ``moe_deepep_num_sms`` (0.15 to
        0.18): RailWave reads the same field, so one SM count serves both dispatchers. A field
        counts as set when it differs from its dataclass default.

        Returns:
            ``deepep_num_sms`` when set, else Megatron's field when set, else 20.

        Raises:
            ValueError: both set to different counts, or Megatron's count is not an even
                integer >= 2 (on every rank, at the layer's construction, before any collective).
        """
        megatron = None
        for name in ("moe_flex_dispatcher_num_sms", "moe_deepep_num_sms"):
            value = getattr(megatron_config, name, None)
            if value is not None and value != _field_default(megatron_config, name):
                megatron = (name, value)
                break
        if megatron is None:
            return self.deepep_num_sms if self.deepep_num_sms is not None else 20
        name, value = megatron
        if self.deepep_num_sms is not None and self.deepep_num_sms != value:
            raise ValueError(
                f"deepep_num_sms={self.deepep_num_sms} (railwave config) differs from Megatron's "
                f"{name}={value} (--{name.replace('_', '-')}); set one of them (deepep_num_sms: "
                "null reads Megatron's)"
            )
        _check_sms(f"Megatron's {name}", value)
        return value

    def _check_cluster(self) -> None:
        if self.cluster is None:
            return
        if not isinstance(self.cluster, (str, os.PathLike)):
            raise ValueError(
                f"cluster={self.cluster!r} must be a cluster YAML path or a preset name "
                "(e.g. h800_4x8), or null"
            )
        resolve_cluster_file(self.cluster)  # raises naming the presets
        overrides: dict[str, Any] = (
            {"failed_rails": [list(f) for f in self.failed_rails]} if self.failed_rails else {}
        )
        topo = load_topology(
            self.cluster, **overrides
        )  # the file's keys and the failed rails' ranges
        if self.gpus_per_node is not None and self.gpus_per_node != topo.gpus_per_node:
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} differs from the cluster file's "
                f"{topo.gpus_per_node}; remove gpus_per_node (the cluster file sets it)"
            )

    def _check_rail_mask(self) -> None:
        example = "[[1, 1, 0, 0], [1, 1, 0, 0]] (one row of 0/1 per node, one column per local GPU)"
        if self.policy == EligiblePolicy.MASK and not self.rail_mask:
            raise ValueError(f"policy 'mask' needs rail_mask: [N][G] of 0/1, e.g. {example}")
        if self.rail_mask and self.policy != EligiblePolicy.MASK:
            raise ValueError(
                f"rail_mask is set but policy is {str(self.policy)!r}, which ignores it; "
                "set policy: mask, or remove rail_mask"
            )
        if not self.rail_mask:
            object.__setattr__(self, "rail_mask", ())
            return
        rows = self.rail_mask
        if (
            not _is_seq(rows)
            or not all(
                _is_seq(r) and r and all(v in (0, 1) and not isinstance(v, float) for v in r)
                for r in rows
            )
            or len({len(r) for r in rows}) != 1
        ):
            raise ValueError(
                f"rail_mask={_plain(rows)!r} must be [N][G] of 0/1 with rows of equal length, "
                f"e.g. {example}"
            )
        if self.gpus_per_node is not None and len(rows[0]) != self.gpus_per_node:
            raise ValueError(
                f"rail_mask rows have {len(rows[0])} entries but gpus_per_node is "
                f"{self.gpus_per_node}; give one 0/1 per local GPU"
            )
        object.__setattr__(self, "rail_mask", tuple(tuple(int(v) for v in r) for r in rows))

    # ------------------------------------------------------------------ derived
    def fingerprint(self) -> dict[str, str]:
        """The fields every rank of one EP group must agree on, as text (field -> value).

        The dispatcher compares them across the EP group at construction
        (``exchange.placement.check_fingerprints``). A new field that changes what travels on
        the wire (e.g. a backend) belongs here.
        """
        return {
            "path": str(self.path),
            "topology": repr((self.cluster, self.gpus_per_node, self.rail_of_gpu)),
            "failed_rails": repr(sorted(self.failed_rails)),
            "policy": repr((str(self.policy), self.rail_mask)),
            "fanin": str(self.fanin),
            "chunks": str(self.chunks),
            "streamed": str(self.streamed),
            "max_tokens_per_rank": str(self.max_tokens_per_rank),
            "selector": repr(
                (self.selector_kind(), self.online.to_dict() if self.online else None)
            ),
        }

    def selector_kind(self) -> str:
        """'fixed' or 'online': what decides each layer's path (a fixed ``path``, or the online
        selector for ``path: auto``, in the normal and the fixed-capacity mode alike)."""
        return "fixed" if self.path != "auto" else "online"

    def configured_gpus_per_node(self) -> int | None:
        """G from the cluster file or ``gpus_per_node``; None when the config does not say."""
        if self.cluster:
            return load_topology(self.cluster).gpus_per_node
        return self.gpus_per_node

    def cluster_rail_of_gpu(self) -> tuple[int, ...]:
        """Rail of each physical GPU of a node, from the cluster file or ``rail_of_gpu``."""
        if self.cluster:
            return load_topology(self.cluster).rail_of_gpu
        return self.rail_of_gpu

    def topology(
        self,
        ep_size: int,
        *,
        ranks_per_node: int | None = None,
        rail_of_local: tuple[int, ...] = (),
    ) -> RailTopology:
        """The topology for an expert-parallel group of ``ep_size`` ranks.

        Args:
            ep_size: W.
            ranks_per_node: EP ranks per node found by the placement (``exchange.placement``);
                used when the config names neither a cluster file nor ``gpus_per_node``.
            rail_of_local: rail of each local GPU found by the placement (replaces the
                config's when the EP group uses other GPUs of a node than 0..G-1).
        """
        overrides: dict[str, Any] = {}
        if self.failed_rails:
            overrides["failed_rails"] = [list(f) for f in self.failed_rails]
        if self.cluster:
            topo = load_topology(self.cluster, **overrides)
            topo.check_world_size(ep_size)
            return topo
        g = self.gpus_per_node or ranks_per_node
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
            rail_of_gpu=rail_of_local or self.rail_of_gpu[:g],
            rail_gbps=self.rail_gbps,
            failed_rails=frozenset(self.failed_rails),
            name=f"{ep_size // g}x{g}",
        )

    def plan_options(self, topo: RailTopology) -> PlanOptions:
        mask = None
        if self.policy == EligiblePolicy.MASK:
            import torch

            mask = torch.tensor(self.rail_mask, dtype=torch.bool)
            if tuple(mask.shape) != (topo.num_nodes, topo.gpus_per_node):
                raise ValueError(
                    f"rail_mask is {list(mask.shape)} but the topology is {topo.num_nodes} nodes x "
                    f"{topo.gpus_per_node} GPUs; give one row per node and one 0/1 per local GPU"
                )
        return PlanOptions(
            policy=self.policy,
            rail_mask_NG=mask,
            fanin=self.fanin,
            chunks=self.chunks,
            streamed=self.streamed,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["policy"] = str(self.policy)
        out["online"] = self.online.to_dict() if self.online is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "railwave config") -> RailWaveConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        removed = sorted(set(data) & set(_REMOVED_KEYS))
        if removed:
            key = removed[0]
            raise ValueError(f"{source}: {key}={data[key]!r} was removed: {_REMOVED_KEYS[key]}")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        # YAML null for a list field means "empty" (the fields themselves validate the shapes).
        kwargs = {
            k: (() if v is None and k in ("failed_rails", "rail_mask", "rail_of_gpu") else v)
            for k, v in data.items()
        }
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def load_config(
    config: RailWaveConfig | dict[str, Any] | str | os.PathLike | None,
) -> RailWaveConfig:
    """A ``RailWaveConfig`` from itself, a dict, a YAML path or the name of a packaged example
    config (``glm45_air_h800``: ``presets``), or None (defaults).

    In a YAML file, the file it reads (``cluster``) is relative to that file's
    folder when relative (a bare name with no such file there is a preset name); the folders it
    writes (``log_dir``, ``capture_dir``, ``online_out``) stay relative to the working directory,
    as the ``--railwave-*`` flags are.

    Raises:
        ValueError: any other type, a path that is not a readable YAML file, or a bad field.
    """
    if config is None:
        return RailWaveConfig()
    if isinstance(config, RailWaveConfig):
        return config
    if isinstance(config, dict):
        return RailWaveConfig.from_dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(
            f"railwave config: got {type(config).__name__} {config!r}; give a RailWaveConfig, a "
            f"dict of its "
            "fields (e.g. {'gpus_per_node': 8, 'path': 'joint'}), the path of a YAML file, or "
            "None for the "
            "defaults"
        )
    path = Path(config)
    if path.is_dir():
        raise ValueError(
            f"railwave config {str(path)!r} is a directory; give the YAML file "
            "(e.g. megatron_railwave/configs/railwave/glm45_air_h800.yaml)"
        )
    if not path.expanduser().is_file():
        path = presets.packaged_file("railwave", config) or path
    try:
        data = read_yaml(path.expanduser(), "railwave config file")
    except FileNotFoundError:
        raise ValueError(
            f"railwave config file {str(path)!r} does not exist (packaged example configs, by "
            f"name: {', '.join(presets.packaged_names('railwave')) or 'none'})"
        ) from None
    source = f"railwave config {str(path)!r}"
    if isinstance(data, dict):
        data = _relative_to_file(data, path.expanduser().parent)
    return RailWaveConfig.from_dict(data or {}, source=source)


_INPUT_FILES = ("cluster",)
"""The fields of a config file that name files it reads: relative to the file's folder."""


def _relative_to_file(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with its relative input paths (``_INPUT_FILES``) joined to ``folder``.

    A bare name (``presets.is_bare_name``) with no file of that name in ``folder`` stays as
    written: a preset name, looked up by the field's own check.
    """
    out = dict(data)
    for key in _INPUT_FILES:
        value = out.get(key)
        if not isinstance(value, str) or not value:
            continue
        written = Path(value).expanduser()
        if written.is_absolute():
            continue
        beside = folder / written
        if presets.is_bare_name(value) and not beside.is_file():
            continue
        # Missing files are reported by the field's own check, with the path joined here.
        out[key] = str(beside)
    return out
