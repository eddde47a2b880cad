"""Routing capture during training: per-rank parts that merge into global traces.

Letters: T tokens of one rank, K top-k, E experts, W ranks.

The dispatcher owns one ``TraceRecorder`` per process and calls, once per MoE layer call,

    if recorder.should_capture(step):
        recorder.record(step, layer_number, ep_rank, routing_map)     # or top-k ids

Nothing here communicates: every rank writes its own file, ``<capture_dir>/step<step>/rank<r>.npz``
(the trace format of ``capture.trace``, kind "rank-part"), and ``merge_captures`` (or
``read_trace`` on a step directory) assembles the W parts of a step into one global trace
afterwards, on any machine that sees the directory.

Only the first call per (step, layer, rank) is kept: later micro-batches of the same step and
activation recomputation repeat the layer and are ignored. A (step, rank) part is written when
all ``layers_per_step`` layers are in, when the rank records a later step, or on
``flush``/``close``.

``record`` does not wait for the device: a CUDA routing map is copied into pinned host memory
with ``non_blocking=True`` behind a CUDA event, and converted when its part is written (the next
captured step, ``flush`` or ``close``), by which time the copy is long done. So capturing adds no
host sync to the dispatch path; the cost is one [T, E] bool device-to-host copy per captured
layer call on the copy engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from megatron_railwave.telemetry.capture.routing import topk_ids_from_routing_map
from megatron_railwave.telemetry.capture.trace import (
    TraceMeta,
    _read_archive,
    assemble_rank_parts,
    check_topology,
    write_rank_part,
    write_trace,
)
from megatron_railwave.topology import RailTopology

__all__ = ["TraceRecorder", "merge_captures", "step_dir"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Staged:
    """A routing map on its way to the host: the copy is complete once ``event`` has passed."""

    host: torch.Tensor
    event: object | None


def step_dir(capture_dir: str | Path, step: int) -> Path:
    """Directory of one captured step's rank parts."""
    return Path(capture_dir) / f"step{int(step):09d}"


class TraceRecorder:
    """Buffers one rank's routing of a captured step and writes it as a rank part.

    Args:
        capture_dir: output directory (created).
        interval_steps: capture every ``interval_steps``-th step, counting from ``start_step``.
        topo: the cluster of the expert-parallel group (its layout is stored in every part).
        meta: model details (``topology`` and ``step`` are filled in per part).
        start_step: first captured step.
        layers_per_step: MoE layers per step on this rank; when given, a part is written as soon
            as all of them are recorded instead of at the next captured step or ``flush``.
    """

    def __init__(
        self,
        capture_dir: str | Path,
        interval_steps: int,
        topo: RailTopology,
        meta: TraceMeta,
        *,
        start_step: int = 0,
        layers_per_step: int | None = None,
    ) -> None:
        if not isinstance(interval_steps, int) or interval_steps < 1:
            raise ValueError(f"interval_steps must be a positive integer, got {interval_steps!r}")
        if layers_per_step is not None and layers_per_step < 1:
            raise ValueError(f"layers_per_step must be positive or None, got {layers_per_step!r}")
        check_topology(meta.topology, topo, source="TraceRecorder meta")
        self.capture_dir = Path(capture_dir)
        self.interval_steps = interval_steps
        self.start_step = int(start_step)
        self.layers_per_step = layers_per_step
        self.meta = dataclasses.replace(
            meta, topology=topo, extra={**meta.extra, "capture_interval_steps": interval_steps}
        )
        # (step, rank) -> {layer: [T, K] int16, or a routing map still being copied}
        self._pending: dict[tuple[int, int], dict[int, np.ndarray | _Staged]] = {}
        self._written: set[tuple[int, int]] = set()
        self.capture_dir.mkdir(parents=True, exist_ok=True)

    def should_capture(self, step: int) -> bool:
        """Whether ``step`` is a capture step (cheap; call it before building anything)."""
        return step >= self.start_step and (step - self.start_step) % self.interval_steps == 0

    def record(self, step: int, layer: int, rank: int, routing: torch.Tensor | np.ndarray) -> bool:
        """Keep one layer's routing of one rank.

        Args:
            step: training step (ignored unless ``should_capture(step)``).
            layer: the model's layer number.
            rank: expert-parallel rank, 0..W-1.
            routing: [T, E] bool routing map, or [T, K] integer top-k expert ids (-1 = none);
                CPU or GPU. Host sync: no (an asynchronous copy; checked and converted when the
                part is written, see the module docstring).

        Returns:
            True when recorded; False for a step that is not captured or a repeated
            (step, layer, rank) (a later micro-batch or a recomputation).
        """
        if not self.should_capture(step):
            return False
        world = self.meta.topology.world_size
        if not 0 <= rank < world:
            raise ValueError(
                f"rank {rank} is out of range 0..{world - 1} of the recorder's topology"
            )
        key = (int(step), int(rank))
        if key in self._written or layer in self._pending.get(key, {}):
            return False
        for old in [k for k in self._pending if k[1] == key[1] and k[0] < key[0]]:
            self._write(old)
        self._pending.setdefault(key, {})[int(layer)] = self._stage(routing, layer)
        if self.layers_per_step is not None and len(self._pending[key]) >= self.layers_per_step:
            self._write(key)
        return True

    def _stage(self, routing: torch.Tensor | np.ndarray, layer: int) -> np.ndarray | _Staged:
        """Arrays now; a tensor starts its copy to the host (pinned, non-blocking for CUDA)."""
        if not isinstance(routing, torch.Tensor):
            return self._ids(routing, layer)
        e, k = self.meta.num_experts, self.meta.topk
        want = e if routing.dtype == torch.bool else k
        if routing.dim() != 2 or routing.shape[1] != want:  # shape only: no device data read
            return self._ids(routing.detach().to("cpu"), layer)  # raises the shape error
        src = routing.detach()
        host = torch.empty(tuple(src.shape), dtype=src.dtype, pin_memory=src.is_cuda)
        host.copy_(src, non_blocking=src.is_cuda)
        event = None
        if src.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return _Staged(host=host, event=event)

    def _ids(self, routing: torch.Tensor | np.ndarray, layer: int) -> np.ndarray:
        if isinstance(routing, torch.Tensor):
            routing = routing.detach().to("cpu").numpy()  # host sync
        routing = np.asarray(routing)
        e, k = self.meta.num_experts, self.meta.topk
        if routing.dtype == bool:
            if routing.ndim != 2 or routing.shape[1] != e:
                raise ValueError(
                    f"layer {layer}: routing map has shape {list(routing.shape)}, expected [T, "
                    f"E={e}]"
                )
            return topk_ids_from_routing_map(routing, k)
        if (
            routing.ndim != 2
            or routing.shape[1] != k
            or not np.issubdtype(routing.dtype, np.integer)
        ):
            raise ValueError(
                f"layer {layer}: top-k ids must be a [T, K={k}] integer array, got shape "
                f"{list(routing.shape)} dtype {routing.dtype}"
            )
        if routing.size and (routing.min() < -1 or routing.max() >= e):
            raise ValueError(f"layer {layer}: expert ids must lie in -1..{e - 1}")
        # Ascending ids with -1 last: the order within a token carries no routing meaning, and
        # this form compresses best.
        ids = np.sort(np.where(routing < 0, e, routing), axis=1)
        return np.where(ids == e, -1, ids).astype(np.int16)

    def _write(self, key: tuple[int, int]) -> Path:
        step, rank = key
        path = step_dir(self.capture_dir, step) / f"rank{rank:05d}.npz"
        layers = self._pending.pop(key)
        for layer, value in layers.items():
            if isinstance(value, _Staged):
                if value.event is not None:
                    value.event.synchronize()  # off the dispatch path: the part is being written
                layers[layer] = self._ids(value.host.numpy(), layer)
        write_rank_part(path, rank, layers, dataclasses.replace(self.meta, step=step))
        self._written.add(key)
        return path

    def flush(self) -> list[Path]:
        """Write every buffered part; returns the files written."""
        return [self._write(key) for key in sorted(self._pending)]

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_captures(
    capture_dir: str | Path,
    *,
    out_dir: str | Path | None = None,
    skip_incomplete: bool = False,
) -> list[Path]:
    """Assemble every captured step into a global trace file.

    Args:
        capture_dir: the recorder's directory (``step*/rank*.npz``).
        out_dir: where to write ``trace_step<step>.npz`` (default ``capture_dir``).
        skip_incomplete: skip steps that lack some rank's part instead of raising.

    Returns:
        The trace paths, in step order.
    """
    capture_dir = Path(capture_dir)
    out = Path(out_dir) if out_dir is not None else capture_dir
    paths = []
    for sdir in sorted(p for p in capture_dir.glob("step*") if p.is_dir()):
        parts = sorted(sdir.glob("rank*.npz"))
        if not parts:
            continue
        _, meta, _ = _read_archive(parts[0])
        if len(parts) < meta.topology.world_size and skip_incomplete:
            continue
        trace = assemble_rank_parts(parts)
        paths.append(write_trace(out / f"trace_{sdir.name}.npz", list(trace.layers), trace.meta))
    return paths
