"""The DeepEP backend's view of ``deep_ep``: where it comes from, what it supports, how big its
Buffer is. The only module that imports ``deep_ep`` (lazily, in ``load_deep_ep``).

Another implementation of the same API (the CPU fake of ``megatron_railwave.testing``, for tests
on gloo) reaches the backend only through code: ``build_exchange(..., deepep_api=...)``, or
``set_deep_ep_stand_in`` for a whole process (what ``testing.use_fake_deepep`` does). No user
config selects it, and backend 'auto' only ever loads the wheel.

Letters: P GPUs per node (DeepEP's NVLink peers: 8), N nodes, W = N * P ranks, H hidden,
K top-k slots of a record row, E experts, E_node = E / N, E_loc = E / W.

DeepEP 2.1's limits in internode normal mode (``csrc/legacy/buffer.hpp``,
``csrc/kernels/legacy/{compiled.cuh,launch.cuh,internode.cu}``), checked by ``check_deepep_layout``
on every rank before the Buffer (the first communication) is created:

* exactly P = 8 GPUs per node (``LEGACY_NUM_MAX_NVL_PEERS``); W > 8 and a multiple of 8, i.e.
  N >= 2 (one node would be DeepEP's intranode mode, which this backend does not drive);
* N in {2, 3, 4, 6, 8, 12, 16, 18, 20}: the node counts its internode kernels are compiled for
  (``SWITCH_RDMA_RANKS``; at most ``LEGACY_NUM_MAX_RDMA_PEERS`` = 20);
* combine reduces bfloat16 rows only (``EP_HOST_ASSERT(type == CUDA_R_16BF)``), and its TMA path
  needs rows of a multiple of 512 bytes (``hidden_int4 % 32 == 0``): H a multiple of 256;
* a dispatched row (payload, source meta, K top-k indices and weights) fits one warp's 16 KiB
  TMA buffer; K <= 32; E_loc <= 1024.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_railwave.topology import RailTopology

__all__ = [
    "DeepEPApi",
    "DeepEPLimits",
    "REAL_LIMITS",
    "load_deep_ep",
    "set_deep_ep_stand_in",
    "deep_ep_for_backend",
    "deep_ep_importable",
    "check_deepep_layout",
    "deepep_layout_problems",
    "deepep_buffer_bytes",
    "record_meta_bytes",
    "dispatch_row_bytes",
    "REAL_WHEEL",
]

REAL_WHEEL = "tokenspeed-deepep"
_MAX_TOPK = 32
_MAX_LOCAL_EXPERTS = 1024
_TMA_BYTES_PER_WARP = 16384  # internode dispatch: kNumTMABytesPerWarp
_SOURCE_META_BYTES = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepEPLimits:
    """What a DeepEP implementation supports in internode normal mode.

    Attributes:
        nvl_peers: GPUs per node the Buffer needs (8 for the real one).
        node_counts: node counts its internode kernels are built for.
        combine_dtypes: dtypes its combine reduces.
    """

    nvl_peers: int
    node_counts: tuple[int, ...]
    combine_dtypes: tuple[torch.dtype, ...]


REAL_LIMITS = DeepEPLimits(
    nvl_peers=8, node_counts=(2, 3, 4, 6, 8, 12, 16, 18, 20), combine_dtypes=(torch.bfloat16,)
)
"""DeepEP 2.1 (``LEGACY_NUM_MAX_NVL_PEERS``, ``SWITCH_RDMA_RANKS``, ``internode::combine``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepEPApi:
    """The pieces of ``deep_ep`` the backend uses, and the limits of that implementation.

    Attributes:
        kind: 'real' (the wheel) or 'fake' (``testing.deepep_fake`` on gloo).
        Buffer, Config, EventOverlap: ``deep_ep``'s classes (or the fake's).
        limits: what it supports.
    """

    kind: Literal["real", "fake"]
    Buffer: Any
    Config: Any
    EventOverlap: Any
    limits: DeepEPLimits


def load_deep_ep() -> DeepEPApi:
    """``deep_ep`` 2.1, imported here from the package top level.

    Raises:
        ImportError: ``deep_ep`` does not import; names the wheel and the fallback.
    """
    try:
        from deep_ep import Buffer, Config, EventOverlap
    except Exception as exc:  # noqa: BLE001 - deep_ep's import also runs NCCL / JIT checks (asserts)
        raise ImportError(
            f"backend 'deepep' needs DeepEP 2.1 (`import deep_ep` failed: {type(exc).__name__}: "
            f"{exc}). "
            f"Install the `{REAL_WHEEL}` wheel (DeepEP 2.1 for CUDA 13, next to a CUDA torch), or "
            f"set "
            "backend: torch (backend: auto falls back to torch by itself)"
        ) from exc
    return DeepEPApi(
        kind="real", Buffer=Buffer, Config=Config, EventOverlap=EventOverlap, limits=REAL_LIMITS
    )


DeepEPStandIn = Callable[[int], DeepEPApi]
"""Makes another implementation of ``deep_ep``'s API for a job of G GPUs per node."""

_STAND_IN: DeepEPStandIn | None = None


def set_deep_ep_stand_in(stand_in: DeepEPStandIn | None) -> DeepEPStandIn | None:
    """Make backend 'deepep' use ``stand_in(G)`` instead of the wheel in this process (None: the
    wheel again); returns the previous stand-in. A testing hook (``testing.use_fake_deepep``), not
    a user option: backend 'auto' never uses it."""
    global _STAND_IN
    previous, _STAND_IN = _STAND_IN, stand_in
    return previous


def deep_ep_for_backend(gpus_per_node: int) -> DeepEPApi:
    """What backend 'deepep' runs on: the process's stand-in (``set_deep_ep_stand_in``) for G =
    ``gpus_per_node``, else the wheel (``load_deep_ep``).

    Raises:
        ImportError: no stand-in and ``deep_ep`` does not import.
    """
    if _STAND_IN is not None:
        return _STAND_IN(gpus_per_node)
    return load_deep_ep()


def deep_ep_importable() -> tuple[bool, str]:
    """(whether ``deep_ep`` imports, why not). Imports it when it can (its import has side effects:
    NCCL checks and the JIT runtime)."""
    try:
        load_deep_ep()
    except ImportError as exc:
        return False, str(exc.__cause__ or exc)
    return True, ""


def record_meta_bytes() -> int:
    """Bytes appended to each dispatched row: owner EP rank and token (int32 each), padded to 16
    (DeepEP moves rows in 16-byte units and never reads them)."""
    return 16


def dispatch_row_bytes(hidden_size: int, hidden_dtype: torch.dtype) -> int:
    """Bytes of one row of DeepEP's dispatch input ``x``: the payload and the record meta."""
    return hidden_size * torch.empty(0, dtype=hidden_dtype).element_size() + record_meta_bytes()


def deepep_layout_problems(
    topo: RailTopology,
    limits: DeepEPLimits,
    *,
    hidden_size: int,
    hidden_dtype: torch.dtype,
    topk: int,
    num_experts: int,
) -> list[str]:
    """What keeps a DeepEP with ``limits`` from running this layer layout (empty: nothing). Pure."""
    n, g, w = topo.num_nodes, topo.gpus_per_node, topo.world_size
    p = limits.nvl_peers
    problems = []
    if g != p:
        problems.append(f"{g} GPUs per node (DeepEP's internode kernels need exactly {p})")
    if n < 2:
        problems.append(
            f"an EP group of {w} ranks inside one node (DeepEP's internode mode needs more than "
            f"{p} "
            f"ranks, a multiple of {p}; its intranode mode is not driven by this backend)"
        )
    elif n not in limits.node_counts:
        problems.append(
            f"{n} nodes (DeepEP's internode kernels are built for {list(limits.node_counts)} nodes)"
        )
    elt = torch.empty(0, dtype=hidden_dtype).element_size()
    if hidden_dtype not in limits.combine_dtypes:
        problems.append(
            f"hidden dtype {hidden_dtype} (DeepEP's combine reduces {list(limits.combine_dtypes)} "
            f"only)"
        )
    if hidden_size * elt % 512:
        problems.append(
            f"hidden size {hidden_size} ({hidden_size * elt} bytes per row; DeepEP's internode "
            f"combine "
            "needs a multiple of 512 bytes, i.e. a multiple of 256 in bf16)"
        )
    e_node = num_experts // n if n else num_experts
    slots = min(topk, e_node)
    if slots > _MAX_TOPK:
        problems.append(
            f"top-k {topk} with {e_node} experts per node ({slots} slots per record; "
            f"DeepEP: <= {_MAX_TOPK})"
        )
    token_bytes = (
        -(-(dispatch_row_bytes(hidden_size, hidden_dtype) + _SOURCE_META_BYTES + 8 * slots) // 16)
        * 16
    )
    if token_bytes + 8 > _TMA_BYTES_PER_WARP:
        problems.append(
            f"{token_bytes} bytes per dispatched row (hidden {hidden_size}, {slots} top-k slots, "
            f"16 bytes "
            f"of record meta); DeepEP's internode dispatch holds at most {_TMA_BYTES_PER_WARP - 8}"
        )
    if w and num_experts % w == 0 and num_experts // w > _MAX_LOCAL_EXPERTS:
        problems.append(f"{num_experts // w} experts per rank (DeepEP: <= {_MAX_LOCAL_EXPERTS})")
    return problems


def check_deepep_layout(
    topo: RailTopology,
    api: DeepEPApi,
    *,
    hidden_size: int,
    hidden_dtype: torch.dtype,
    topk: int,
    num_experts: int,
) -> None:
    """Raise ``ValueError`` naming every DeepEP limit this layout breaks (no communication).

    Raises:
        ValueError: names each problem and the fallback (backend: torch).
    """
    problems = deepep_layout_problems(
        topo,
        api.limits,
        hidden_size=hidden_size,
        hidden_dtype=hidden_dtype,
        topk=topk,
        num_experts=num_experts,
    )
    if problems:
        kind = (
            "DeepEP"
            if api.kind == "real"
            else f"the fake DeepEP ({api.limits.nvl_peers} GPUs per node)"
        )
        raise ValueError(
            f"backend 'deepep' cannot run {topo.num_nodes} nodes x {topo.gpus_per_node} GPUs with "
            f"{kind}: " + "; ".join(problems) + ". Use backend: torch (or auto, which picks torch "
            "for such layouts)"
        )


def deepep_buffer_bytes(
    dispatch_config: Any, combine_config: Any, *, num_ranks: int, row_bytes: int
) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) of the Buffer: the larger of the two configs' hints for
    rows of ``row_bytes`` (``dispatch_row_bytes``). Sized by the Config, not by token counts:
    DeepEP streams rows through fixed per-channel ring buffers. Pure."""
    nvl = max(
        c.get_nvl_buffer_size_hint(row_bytes, num_ranks) for c in (dispatch_config, combine_config)
    )
    rdma = max(
        c.get_rdma_buffer_size_hint(row_bytes, num_ranks) for c in (dispatch_config, combine_config)
    )
    return int(nvl), int(rdma)
