"""Versioned routing traces: per-layer top-k expert ids of every rank, compact on disk.

Letters: W ranks (N nodes x G GPUs), T tokens of one rank, K top-k, E experts.

On disk a trace is an ``.npz`` (zip, deflate) archive:
    header            uint8 bytes of a JSON object: {"format": "railwave-trace", "version": 1,
                      "kind": "trace" | "rank-part", "meta": {...}, "layers": [...],
                      "encoding": {entry: "delta" | "raw"}, "rank": r (parts only)}
    layer_<id>        one array per layer: [W, T, K] (trace) or [T, K] (rank part)
Ids are int16 in memory, -1 = empty slot. On disk a layer whose rows are ascending with the -1
slots last (what the recorder and the generators produce) is stored as row-wise deltas in uint8
(uint16 when E > 255), which deflates to about the entropy of a top-k set; any other layer is
stored raw (uint8 with 255 for -1 when E <= 255, else int16). Both decode bit-exactly.

A capture writes one *rank part* per (step, rank) (see ``capture.recorder``); ``read_trace`` of a
step directory assembles the parts, and ``merge_captures`` writes the assembled traces.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_railwave.telemetry.capture.routing import (
    NO_EXPERT,
    demand_from_topk_ids,
    routing_map_from_topk_ids,
)
from megatron_railwave.topology import RailTopology
from megatron_railwave.traffic import DemandCounts, dtype_bytes

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceFormatError",
    "TraceMeta",
    "LayerTrace",
    "Trace",
    "write_trace",
    "read_trace",
    "check_topology",
]

TRACE_FORMAT = "railwave-trace"
TRACE_VERSION = 1
_LAYOUT_KEYS = ("num_nodes", "gpus_per_node")


class TraceFormatError(ValueError):
    """A file is not a readable railwave trace (malformed, wrong version, wrong kind)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceMeta:
    """What a trace was recorded from; global (the same for every rank and layer)."""

    model: str
    """Model name, e.g. 'GLM-4.5-Air'."""
    topology: RailTopology
    """The cluster the routing was recorded on (W = N * G ranks, experts contiguous)."""
    num_experts: int
    """E, routed experts per MoE layer."""
    topk: int
    """K, experts per token (the id arrays' last dimension)."""
    hidden_size: int
    """H, hidden size: a record carries H elements of ``dtype``."""
    dtype: str = "bf16"
    """Dispatch element type name ('bf16', 'fp8', ...; see ``traffic.dtype_bytes``)."""
    step: int = -1
    """Training step of the capture; -1 for synthetic traces."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free JSON-serialisable details (generator seed and knobs, capture settings)."""

    def __post_init__(self) -> None:
        world = self.topology.world_size
        if self.num_experts < 1 or self.num_experts % world:
            raise ValueError(
                f"meta.num_experts={self.num_experts} must be a positive multiple of the "
                f"world size {world} (experts are placed contiguously, E / W per rank)"
            )
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"meta.topk={self.topk} must be in 1..num_experts={self.num_experts}")
        if self.hidden_size < 1:
            raise ValueError(f"meta.hidden_size={self.hidden_size} must be positive")
        dtype_bytes(self.dtype)  # raises ValueError naming the allowed dtype names

    @property
    def record_bytes(self) -> int:
        """Payload bytes of one record (H x element size)."""
        return self.hidden_size * dtype_bytes(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "topology": self.topology.to_dict(),
            "num_experts": self.num_experts,
            "topk": self.topk,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "step": self.step,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceMeta:
        kwargs = dict(data)
        kwargs["topology"] = RailTopology.from_dict(data["topology"], source="trace topology")
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LayerTrace:
    """Routing of one MoE layer on every rank.

    Attributes:
        layer: the model's layer number (as the dispatcher reports it).
        topk_ids_WTK: [W, T, K] int16 numpy, global; expert ids per token of every source rank,
            -1 = empty slot (a padding token or fewer than K experts). Converted from torch or
            other integer dtypes on construction.
    """

    layer: int
    topk_ids_WTK: np.ndarray

    def __post_init__(self) -> None:
        ids = self.topk_ids_WTK
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().to("cpu").numpy()  # host sync when on a GPU
        ids = np.asarray(ids)
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"layer {self.layer}: topk_ids_WTK must be a [W, T, K] integer array, got "
                f"shape {ids.shape} dtype {ids.dtype}"
            )
        if ids.size and (ids.min() < NO_EXPERT or ids.max() > np.iinfo(np.int16).max):
            raise ValueError(f"layer {self.layer}: expert ids must lie in -1..32767")
        object.__setattr__(self, "topk_ids_WTK", np.ascontiguousarray(ids, dtype=np.int16))
        object.__setattr__(self, "layer", int(self.layer))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Trace:
    """A global routing trace: metadata and one ``LayerTrace`` per recorded layer."""

    meta: TraceMeta
    layers: tuple[LayerTrace, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        world, seen = self.meta.topology.world_size, set()
        for lt in self.layers:
            shape = lt.topk_ids_WTK.shape
            if shape[0] != world or shape[2] != self.meta.topk:
                raise ValueError(
                    f"layer {lt.layer}: ids have shape {list(shape)}, expected [W={world}, T, "
                    f"K={self.meta.topk}] for the trace's topology and topk"
                )
            if lt.topk_ids_WTK.size and int(lt.topk_ids_WTK.max()) >= self.meta.num_experts:
                raise ValueError(
                    f"layer {lt.layer}: expert id {int(lt.topk_ids_WTK.max())} >= num_experts="
                    f"{self.meta.num_experts}"
                )
            if lt.layer in seen:
                raise ValueError(f"layer {lt.layer} appears twice in the trace")
            seen.add(lt.layer)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(lt.layer for lt in self.layers)

    def layer(self, layer: int) -> LayerTrace:
        for lt in self.layers:
            if lt.layer == layer:
                return lt
        raise ValueError(
            f"layer {layer} is not in the trace; recorded layers: {list(self.layer_ids)}"
        )

    def demand(self, layer: int) -> DemandCounts:
        """Global ``DemandCounts`` of one layer (by layer number)."""
        return demand_from_topk_ids(
            self.layer(layer).topk_ids_WTK, self.meta.topology, self.meta.num_experts
        )

    def routing_maps(self, layer: int) -> list[torch.Tensor]:
        """One [T, E] bool CPU routing map per rank (for the exchange)."""
        return [
            routing_map_from_topk_ids(ids_TK, self.meta.num_experts)
            for ids_TK in self.layer(layer).topk_ids_WTK
        ]


# ---------------------------------------------------------------------------------- encoding
def _encode(ids: np.ndarray, num_experts: int) -> tuple[str, np.ndarray]:
    valid = ids >= 0
    prev = np.concatenate([np.full(ids.shape[:-1] + (1,), NO_EXPERT, ids.dtype), ids[..., :-1]], -1)
    prev_valid = np.concatenate([np.ones(ids.shape[:-1] + (1,), bool), valid[..., :-1]], -1)
    # Delta form needs ascending valid ids followed only by -1 slots.
    if bool(np.all(~valid | (prev_valid & (ids > prev)))):
        delta = np.where(valid, ids.astype(np.int32) - prev, 0)
        return "delta", delta.astype(np.uint8 if num_experts <= 255 else np.uint16)
    if num_experts <= 255:
        return "raw", np.where(valid, ids, 255).astype(np.uint8)
    return "raw", ids


def _decode(encoding: str, data: np.ndarray, source: str) -> np.ndarray:
    if encoding == "delta":
        ids = (np.cumsum(data.astype(np.int32), axis=-1) - 1).astype(np.int16)
        ids[data == 0] = NO_EXPERT
        return ids
    if encoding == "raw":
        ids = data.astype(np.int16)
        if data.dtype == np.uint8:
            ids[data == 255] = NO_EXPERT
        return ids
    raise TraceFormatError(
        f"{source}: unknown layer encoding {encoding!r}; expected 'delta' or 'raw'"
    )


def _write_archive(
    path: Path, header: dict[str, Any], arrays: dict[str, np.ndarray], num_experts: int
) -> None:
    entries, encoding = {}, {}
    for name, ids in arrays.items():
        encoding[name], entries[name] = _encode(ids, num_experts)
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **header, "encoding": encoding}
    entries["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **entries)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_archive(path: Path) -> tuple[dict[str, Any], TraceMeta, dict[int, np.ndarray]]:
    source = f"trace file {str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{source} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            entries = {name: data[name] for name in data.files}
    except Exception as exc:  # np.load raises several types for non-archives
        raise TraceFormatError(
            f"{source} is not a railwave trace (not an .npz archive: {exc})"
        ) from None
    if "header" not in entries:
        raise TraceFormatError(f"{source} has no 'header' entry: not a railwave trace")
    try:
        header = json.loads(entries["header"].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise TraceFormatError(f"{source}: the header is not a JSON object (file damaged?)")
    if header.get("format") != TRACE_FORMAT:
        raise TraceFormatError(
            f"{source}: format is {header.get('format')!r}, expected {TRACE_FORMAT!r}"
        )
    if header.get("version") != TRACE_VERSION:
        raise TraceFormatError(
            f"{source}: trace format version {header.get('version')!r}, but this megatron_railwave "
            f"reads version {TRACE_VERSION}; re-record the trace or use the package version that "
            f"wrote it"
        )
    try:
        meta = TraceMeta.from_dict(header["meta"])
        layer_ids = [int(v) for v in header["layers"]]
        encodings = dict(header["encoding"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFormatError(
            f"{source}: malformed header ({type(exc).__name__}: {exc})"
        ) from None
    layers: dict[int, np.ndarray] = {}
    for layer in layer_ids:
        name = f"layer_{layer}"
        if name not in entries or name not in encodings:
            raise TraceFormatError(
                f"{source}: header lists layer {layer} but entry {name!r} is missing"
            )
        layers[layer] = _decode(encodings[name], entries[name], source)
    return header, meta, layers


# ---------------------------------------------------------------------------------- public I/O
def check_topology(
    recorded: RailTopology, expected: RailTopology, *, source: str, strict: bool = False
) -> None:
    """Raise ``ValueError`` naming both topologies when a trace does not fit ``expected``.

    Routing depends only on the layout (nodes x GPUs, hence expert placement), so by default
    only ``num_nodes`` and ``gpus_per_node`` must match; ``strict`` compares every key but the name.
    """
    a, b = recorded.to_dict(), expected.to_dict()
    keys = [k for k in a if k != "name"] if strict else list(_LAYOUT_KEYS)
    diff = [f"{k}: {a[k]!r} vs {b[k]!r}" for k in keys if a[k] != b[k]]
    if diff:
        raise ValueError(
            f"{source} was recorded on topology {a['name']!r} ({a['num_nodes']} nodes x "
            f"{a['gpus_per_node']} GPUs, {a}) but the expected topology is {b['name']!r} "
            f"({b['num_nodes']} nodes x {b['gpus_per_node']} GPUs, {b}); differing: "
            f"{'; '.join(diff)}. "
            "Replay it on a cluster of the recorded shape or record a new trace"
        )


def write_trace(path: str | Path, layers: list[LayerTrace], meta: TraceMeta) -> Path:
    """Write a global trace (atomically) and return its path.

    Args:
        path: the file to write (any suffix; '.npz' is customary).
        layers: one ``LayerTrace`` per layer, [W, T, K] ids each.
        meta: model, topology, experts, top-k, hidden size, dtype, step.
    """
    trace = Trace(meta=meta, layers=tuple(layers))  # validates shapes and ids
    path = Path(path)
    _write_archive(
        path,
        {"kind": "trace", "meta": meta.to_dict(), "layers": list(trace.layer_ids)},
        {f"layer_{lt.layer}": lt.topk_ids_WTK for lt in trace.layers},
        meta.num_experts,
    )
    return path


def write_rank_part(
    path: str | Path, rank: int, layers: dict[int, np.ndarray], meta: TraceMeta
) -> None:
    """Write one rank's capture of one step: ``layers`` maps layer number -> [T, K] int16 ids."""
    _write_archive(
        Path(path),
        {"kind": "rank-part", "rank": int(rank), "meta": meta.to_dict(), "layers": sorted(layers)},
        {f"layer_{k}": v for k, v in layers.items()},
        meta.num_experts,
    )


def read_trace(
    path: str | Path, expect_topology: RailTopology | None = None, *, strict_topology: bool = False
) -> Trace:
    """Read a trace file, or assemble a capture step directory of rank parts.

    Args:
        path: a trace file, a step directory of rank parts, or a capture directory holding
            exactly one step directory.
        expect_topology: raise if the trace was recorded on another layout (see ``check_topology``).
        strict_topology: compare every topology key, not only the layout.

    Raises:
        TraceFormatError: not a trace, damaged, wrong format version.
        ValueError: topology mismatch; missing or inconsistent rank parts.
    """
    path = Path(path)
    if path.is_dir():
        trace = _read_capture_dir(path)
    else:
        header, meta, layers = _read_archive(path)
        if header.get("kind") != "trace":
            raise TraceFormatError(
                f"trace file {str(path)!r} is a {header.get('kind')!r} file, not a trace; read its "
                "directory with read_trace or assemble it with merge_captures"
            )
        trace = Trace(
            meta=meta, layers=tuple(LayerTrace(layer=k, topk_ids_WTK=v) for k, v in layers.items())
        )
    if expect_topology is not None:
        check_topology(
            trace.meta.topology,
            expect_topology,
            source=f"trace {str(path)!r}",
            strict=strict_topology,
        )
    return trace


def _read_capture_dir(path: Path) -> Trace:
    parts = sorted(path.glob("rank*.npz"))
    if not parts:
        steps = sorted(p for p in path.iterdir() if p.is_dir() and any(p.glob("rank*.npz")))
        if len(steps) != 1:
            raise ValueError(
                f"capture directory {str(path)!r} holds {len(steps)} step directories "
                f"({[p.name for p in steps][:8]}); pass one of them, or call merge_captures"
            )
        return _read_capture_dir(steps[0])
    return assemble_rank_parts(parts)


def assemble_rank_parts(parts: list[Path]) -> Trace:
    """The global trace of one step from every rank's part (ranks padded to the longest T)."""
    metas, by_rank = [], {}
    for part in parts:
        header, meta, layers = _read_archive(Path(part))
        if header.get("kind") != "rank-part":
            raise TraceFormatError(
                f"{str(part)!r} is a {header.get('kind')!r} file, not a rank part"
            )
        rank = int(header["rank"])
        if rank in by_rank:
            raise ValueError(f"rank {rank} has two capture parts in {str(Path(part).parent)!r}")
        for layer, ids in layers.items():
            if ids.ndim != 2 or ids.shape[1] != meta.topk:
                raise TraceFormatError(
                    f"{str(part)!r}: layer {layer} has shape {list(ids.shape)}, expected [T, "
                    f"K={meta.topk}]"
                )
        metas.append(meta.to_dict())
        by_rank[rank] = layers
    meta = TraceMeta.from_dict(metas[0])
    where = str(Path(parts[0]).parent)
    for other in metas[1:]:
        if other != metas[0]:
            raise ValueError(
                f"capture parts in {where!r} disagree on metadata: {metas[0]} vs {other}"
            )
    world = meta.topology.world_size
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        raise ValueError(
            f"capture {where!r} lacks the parts of ranks {missing} (have {len(by_rank)} of "
            f"{world}); "
            "wait for every rank to flush, or skip incomplete steps"
        )
    layer_ids = sorted(by_rank[0])
    for rank, layers in by_rank.items():
        if sorted(layers) != layer_ids:
            raise ValueError(
                f"capture {where!r}: rank {rank} recorded layers {sorted(layers)}, rank 0 recorded "
                f"{layer_ids}; every rank must record the same layers"
            )
    out = []
    for layer in layer_ids:
        per_rank = [by_rank[r][layer] for r in range(world)]
        num_tokens = max(a.shape[0] for a in per_rank)
        ids = np.full((world, num_tokens, meta.topk), NO_EXPERT, dtype=np.int16)
        for r, a in enumerate(per_rank):
            ids[r, : a.shape[0]] = a
        out.append(LayerTrace(layer=layer, topk_ids_WTK=ids))
    return Trace(meta=meta, layers=tuple(out))
