"""A stand-in for ``deep_ep`` 2.1's legacy ``Buffer`` in internode normal mode, on CPU (gloo).

Letters: P GPUs per node (DeepEP's NVLink peers), N = W / P nodes (RDMA ranks), W ranks,
T rows of one rank, K top-k slots, E experts, E_loc = E / W, H hidden, C = num_sms / 2 channels.

``fake_deep_ep(P)`` returns a module-like namespace with ``Buffer``, ``Config`` and
``EventOverlap``, for the DeepEP backend's tests without GPUs. The backend reaches it only through
the testing hooks: ``fake_deepep_api(P)`` for ``build_exchange(..., deepep_api=...)`` /
``DeepEPExchange(api=...)``, and ``use_fake_deepep()`` for a whole process (a dispatcher built
with ``backend: deepep`` then runs on the fake). No user config can select it.

Faithful to DeepEP 2.1 (``deep_ep/buffers/legacy.py``, ``csrc/legacy/*.hpp``; the names, defaults,
return arities and handle fields are compared with the real wheel by the ``deepep``-marked
conformance test):

* constructor, ``get_dispatch_layout``, ``dispatch``, ``combine``, ``internode_dispatch``,
  ``internode_combine``, ``get_dispatch_config`` / ``get_combine_config`` (the same tables),
  ``set_num_sms``: argument names, defaults and return tuples;
* ``Config``: constructor and the two buffer-size hints (the same arithmetic);
* the internode handle: 10 tensors (``INTERNODE_HANDLE_FIELDS``) with DeepEP's dtypes and shapes;
* the host-side checks of the C++ runtime, raised as ``RuntimeError``;
* receive order: source rank ascending, then the source's row order; ``recv_topk_idx`` holds
  local expert indices (-1 elsewhere) and ``recv_topk_weights`` 0 where the index is -1;
  ``num_recv_tokens_per_expert_list`` is a host list after a blocking count exchange (DeepEP's
  notify step and CPU busy-wait);
* combine arithmetic: per destination node, the rows of its ranks summed in fp32 in ascending
  local rank, cast once to the row dtype; then the node partials summed in fp32 in ascending
  node order, cast once (``ops.segment_sum`` has exactly that order); top-k weights the same in
  fp32.

Different, on purpose: P is configurable (DeepEP: 8), so 2 x 2 and 4 x 2 gloo jobs run; combine
also accepts fp32 rows (DeepEP: bf16 only; the backend's limit check rejects fp32 for the real
Buffer); data moves with gloo ``all_to_all_single``; there are no CUDA events, streams, low-latency
or intranode modes, FP8 inputs or bias. ``send_nvl_head`` has DeepEP's shape but holds -1 (the
forwarders' ring-buffer heads are not modelled); the fake's own cached dispatch and combine read
only ``is_token_in_rank``, ``recv_gbl_rank_prefix_sum`` and ``recv_src_meta``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from megatron_railwave import ops
from megatron_railwave.exchange.deepep_api import DeepEPApi, DeepEPLimits, set_deep_ep_stand_in

__all__ = [
    "fake_deep_ep",
    "fake_deepep_api",
    "use_fake_deepep",
    "INTERNODE_HANDLE_FIELDS",
    "FakeEventOverlap",
]

INTERNODE_HANDLE_FIELDS = (
    "is_token_in_rank",
    "rdma_channel_prefix_matrix",
    "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix",
    "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix",
    "recv_gbl_rank_prefix_sum",
    "recv_src_meta",
    "send_rdma_head",
    "send_nvl_head",
)
"""The internode handle tuple of ``Buffer.internode_dispatch``, in DeepEP's order."""

_INT4_BYTES = 16
_SOURCE_META_BYTES = 8  # struct SourceMeta {int src_rdma_rank, is_token_in_nvl_rank_bits;}
_TOPK_IDX_BYTES = 8  # topk_idx_t = int64
_MAX_RDMA_PEERS = 20
_MAX_LOCAL_EXPERTS = 1024
_BUFFER_ALIGNMENT = 128
_MAX_TOPK = 32
_KNOWN_NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 20)  # SWITCH_RDMA_RANKS of internode.cu
_COMBINE_DTYPES = (torch.bfloat16, torch.float32)  # DeepEP: bfloat16 only (see module docstring)


def _check(condition: bool, what: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT``: a failed host check of the runtime."""
    if not condition:
        raise RuntimeError(f"fake deep_ep: failed check: {what}")


class FakeEventOverlap:
    """``deep_ep.EventOverlap`` without CUDA: the fake finishes every call before returning."""

    def __init__(
        self, event: Any = None, extra_tensors: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        _check(self.event is not None, "self.event is not None (only async calls return an event)")


class _FakeConfig:
    """``deep_ep.Config``: chunk sizes of the normal kernels and the buffer-size hints."""

    nvl_peers = 8

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        _check(num_sms >= 0, "num_sms >= 0")
        _check(
            0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
            "0 < nvl chunked send tokens < nvl chunked recv tokens",
        )
        _check(
            num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
            "rdma chunked send / recv tokens > 0",
        )
        send = num_max_rdma_chunked_send_tokens
        recv = (
            -(-num_max_rdma_chunked_recv_tokens // send) * send
        )  # DeepEP rounds it up to the send chunk
        _check(
            send < recv and send <= recv // 2,
            "rdma chunked send tokens <= rdma chunked recv tokens / 2",
        )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        p = self.nvl_peers
        _check(num_ranks < p or num_ranks % p == 0, "num_ranks < NVL peers or a multiple of them")
        _check(num_ranks <= p or self.num_sms % 2 == 0, "num_sms is even")
        rdma, nvl, channels = max(num_ranks // p, 1), min(num_ranks, p), self.num_sms // 2
        per_token = hidden_bytes + _SOURCE_META_BYTES + 128 * (_TOPK_IDX_BYTES + 4) + 128 * 4
        total = channels * nvl * (2 * rdma + 3) * 4
        total += channels * nvl * self.num_max_nvl_chunked_recv_tokens * per_token
        return -(-total // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        p = self.nvl_peers
        if num_ranks <= p:
            return 0
        _check(
            num_ranks % p == 0 and self.num_sms % 2 == 0,
            "num_ranks a multiple of the NVL peers, even num_sms",
        )
        rdma, channels = num_ranks // p, self.num_sms // 2
        per_token = (
            hidden_bytes + _SOURCE_META_BYTES + 128 * (_TOPK_IDX_BYTES + 4) + 128 * 4 + _INT4_BYTES
        )
        total = channels * rdma * (p * 2 + 2) * 2 * 4
        total += channels * rdma * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        return -(-total // 128) * 128


# DeepEP's recommended (num_sms, nvl send, nvl recv, rdma send, rdma recv) per EP size.
_DISPATCH_TABLE = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_TABLE = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def _channel_of_row(num_rows: int, channels: int) -> torch.Tensor:
    """[T] channel of each row: DeepEP splits a rank's rows into C contiguous ranges."""
    per = -(-num_rows // channels) if num_rows else 1
    return torch.arange(num_rows, dtype=torch.int64) // per


def _counts_from_prefix(prefix_W: torch.Tensor) -> torch.Tensor:
    """[W] int64 counts from DeepEP's inclusive prefix sums."""
    return torch.diff(prefix_W.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))


def _pairs(in_rank_TW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(row [n], rank [n], rows per rank [W]) of every (row, destination rank), rank-major."""
    rank_n, row_n = torch.nonzero(in_rank_TW.t(), as_tuple=True)
    return row_n, rank_n, in_rank_TW.sum(dim=0).tolist()


class _FakeBuffer:
    """``deep_ep.Buffer`` (legacy, internode normal mode) over torch.distributed on CPU.

    Args (as DeepEP's):
        group: the EP process group (group rank r sits on node r // P as local GPU r % P).
        num_nvl_bytes, num_rdma_bytes: buffer sizes (checked as DeepEP checks them; the fake
            allocates nothing).
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
        explicitly_destroy, enable_shrink, comm: DeepEP's; low-latency mode and ``comm`` are
            not modelled.

    Collective: yes (the group, at construction: DeepEP exchanges device ids and IPC handles).
    """

    num_sms: int = 20
    nvl_peers = 8
    Config: type = _FakeConfig

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            raise NotImplementedError(
                "fake deep_ep: an mpi4py communicator is not modelled; pass a process group"
            )
        if low_latency_mode:
            raise NotImplementedError("fake deep_ep: low-latency mode is not modelled")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        p, w = self.nvl_peers, self.group_size
        _check(
            num_nvl_bytes % _BUFFER_ALIGNMENT == 0 and num_rdma_bytes % _BUFFER_ALIGNMENT == 0,
            "buffer sizes are multiples of 128 bytes",
        )
        _check(w <= p * _MAX_RDMA_PEERS, f"num_ranks <= {p} x {_MAX_RDMA_PEERS}")
        _check(w < p or w % p == 0, f"num_ranks < {p} or a multiple of {p}")
        _check(num_rdma_bytes == 0 or w > p, f"num_ranks > {p} when num_rdma_bytes > 0")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = (
            False,
            explicitly_destroy,
            enable_shrink,
        )
        self.num_rdma_ranks, self.rdma_rank, self.nvl_rank = (
            max(1, w // p),
            self.rank // p,
            self.rank % p,
        )
        seen: list[Any] = [None] * w
        dist.all_gather_object(seen, (p, num_nvl_bytes, num_rdma_bytes), group=group)
        _check(
            len(set(seen)) == 1, f"every rank passes the same peers and buffer sizes (got {seen})"
        )
        self.runtime: Any = self

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.runtime = None

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        cls.num_sms = new_num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> _FakeConfig:
        """DeepEP's recommended config for the same node count with 8 GPUs per node."""
        key = num_ranks * 8 // cls.nvl_peers if num_ranks > cls.nvl_peers else num_ranks
        assert key in _DISPATCH_TABLE, f"Unsupported number of EP ranks: {num_ranks}"
        return cls.Config(cls.num_sms, *_DISPATCH_TABLE[key])

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> _FakeConfig:
        """DeepEP's recommended config for the same node count with 8 GPUs per node."""
        key = num_ranks * 8 // cls.nvl_peers if num_ranks > cls.nvl_peers else num_ranks
        assert key in _COMBINE_TABLE, f"Unsupported number of EP ranks: {num_ranks}"
        return cls.Config(cls.num_sms, *_COMBINE_TABLE[key])

    # ------------------------------------------------------------------ layout (local)
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns (num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank [N] int32 (None on one
        node), num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool, event)."""
        _check(
            topk_idx.dim() == 2 and topk_idx.is_contiguous() and num_experts > 0,
            "topk_idx [T, K] contiguous",
        )
        _check(topk_idx.dtype == torch.int64, "topk_idx dtype is deep_ep.topk_idx_t (int64)")
        _check(
            previous_event is None and not async_finish and not allocate_on_comm_stream,
            "the fake has no streams: previous_event=None, async_finish=False",
        )
        w = self.group_size
        t = topk_idx.shape[0]
        valid = topk_idx >= 0
        rank_TK = torch.where(valid, topk_idx // (num_experts // w), w)
        in_rank = (
            torch.zeros(t, w + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :w].contiguous()
        )
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        per_rdma = None
        if self.num_rdma_ranks > 1:
            per_rdma = (
                in_rank.view(t, self.num_rdma_ranks, self.nvl_peers)
                .any(dim=2)
                .sum(dim=0)
                .to(torch.int32)
            )
        return in_rank.sum(dim=0).to(torch.int32), per_rdma, per_expert, in_rank, FakeEventOverlap()

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event); with a cached ``handle``: (recv_x, None, None, None, None, event).

        Collective: yes (the group). Host sync: yes (the received counts), unless cached.
        """
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.num_rdma_ranks == 1:
            raise NotImplementedError("fake deep_ep: intranode mode (one node) is not modelled")
        assert num_worst_tokens == 0, "Internode dispatch does not support `num_worst_tokens > 0`"
        return self.internode_dispatch(
            x,
            handle,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def internode_dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        assert config is not None
        if isinstance(x, tuple):
            raise NotImplementedError("fake deep_ep: FP8 inputs (x, x_scales) are not modelled")
        _check(
            previous_event is None and not async_finish and not allocate_on_comm_stream,
            "the fake has no streams: previous_event=None, async_finish=False",
        )
        _check(config.num_sms % 2 == 0, "config.num_sms is even")
        _check(x.dim() == 2 and x.is_contiguous(), "x is [T, H] contiguous")
        _check(x.shape[1] * x.element_size() % _INT4_BYTES == 0, "x row bytes are a multiple of 16")
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            fields = dict(zip(INTERNODE_HANDLE_FIELDS, handle, strict=True))
            recv_counts = _counts_from_prefix(fields["recv_gbl_rank_prefix_sum"])
            row_n, _, send_counts = _pairs(fields["is_token_in_rank"])
            recv = self._exchange(x.index_select(0, row_n), send_counts, recv_counts.tolist())
            return recv, None, None, None, None, FakeEventOverlap()
        return self._dispatch_with_layout(
            x,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            config,
        )

    def _dispatch_with_layout(
        self, x, per_rank, per_rdma, in_rank, per_expert, topk_idx, topk_weights, alignment, config
    ):
        assert per_rank is not None and in_rank is not None and per_expert is not None
        w, p, n = self.group_size, self.nvl_peers, self.num_rdma_ranks
        for name, tensor in (
            ("num_tokens_per_rank", per_rank),
            ("num_tokens_per_rdma_rank", per_rdma),
            ("num_tokens_per_expert", per_expert),
        ):
            _check(
                tensor is not None and tensor.dtype == torch.int32 and tensor.dim() == 1,
                f"{name} is int32 [.]",
            )
        _check(
            per_rank.shape[0] == w and per_rdma.shape[0] == n and per_expert.shape[0] % w == 0,
            "layout tensors of sizes [W], [N], [E]",
        )
        e_loc = per_expert.shape[0] // w
        _check(e_loc <= _MAX_LOCAL_EXPERTS, f"num_experts / num_ranks <= {_MAX_LOCAL_EXPERTS}")
        t, channels = x.shape[0], config.num_sms // 2
        _check(
            in_rank.dtype == torch.bool and tuple(in_rank.shape) == (t, w),
            "is_token_in_rank is bool [T, W]",
        )
        _check(
            (topk_idx is None) == (topk_weights is None),
            "topk_idx and topk_weights both given or both None",
        )
        k = 0
        if topk_idx is not None:
            k = topk_idx.shape[1]
            _check(
                topk_idx.dim() == 2
                and topk_weights.dim() == 2
                and topk_idx.is_contiguous()
                and topk_weights.is_contiguous(),
                "topk_idx, topk_weights [T, K] contiguous",
            )
            _check(
                topk_idx.shape[0] == t and tuple(topk_weights.shape) == (t, k),
                "topk tensors of [T, K]",
            )
            _check(topk_weights.dtype == torch.float32, "topk_weights dtype float32")
            _check(k <= _MAX_TOPK, f"num_topk <= {_MAX_TOPK} (a device assert in DeepEP)")
        # Notify: what every rank will receive (DeepEP's notify kernel), then the CPU waits for it.
        in_node = in_rank.view(t, n, p).any(dim=2)
        channel_T = _channel_of_row(t, channels)
        row_n, rank_n, send_counts = _pairs(in_rank)
        node_row, node_n, _ = _pairs(in_node)
        gbl_channel_WC = torch.zeros(w, channels, dtype=torch.int64).index_put_(
            (rank_n, channel_T[row_n]), torch.ones_like(rank_n), accumulate=True
        )
        rdma_channel_NC = torch.zeros(n, channels, dtype=torch.int64).index_put_(
            (node_n, channel_T[node_row]), torch.ones_like(node_n), accumulate=True
        )
        same_rail = (torch.arange(w) % p == self.nvl_rank).unsqueeze(1)
        counts = torch.cat(
            [
                per_rank.to(torch.int64).unsqueeze(1),
                per_expert.to(torch.int64).view(w, e_loc),
                gbl_channel_WC,
                rdma_channel_NC.repeat_interleave(p, dim=0) * same_rail,
            ],
            dim=1,
        )
        arrived = torch.empty_like(counts)
        dist.all_to_all_single(arrived, counts, group=self.group)
        host = arrived.tolist()  # DeepEP's CPU busy-wait on the received counts
        recv_per_rank = [row[0] for row in host]
        per_expert_list = [sum(row[1 + e] for row in host) for e in range(e_loc)]
        per_expert_list = [-(-c // alignment) * alignment for c in per_expert_list]
        # Data: every row once per destination rank, with its top-k and its source meta.
        bits = (in_rank.view(t, n, p).to(torch.int64) << torch.arange(p)).sum(
            dim=2
        )  # [T, N] NVL bits
        meta_n2 = torch.stack(
            [torch.full_like(row_n, self.rdma_rank), bits[row_n, rank_n // p]], dim=1
        )
        parts = [x.index_select(0, row_n), meta_n2.to(torch.int32)]
        if k:
            parts += [topk_idx.index_select(0, row_n), topk_weights.index_select(0, row_n)]
        recv = self._exchange(ops.pack_rows(parts, [None] * len(parts)), send_counts, recv_per_rank)
        specs = [(x.dtype, tuple(x.shape[1:])), (torch.int32, (2,))]
        if k:
            specs += [(torch.int64, (k,)), (torch.float32, (k,))]
        unpacked = ops.unpack_rows(recv, specs)
        recv_x, recv_meta = unpacked[0], unpacked[1]
        recv_idx = recv_w = None
        if k:
            begin = self.rank * e_loc
            local = (unpacked[2] >= begin) & (unpacked[2] < begin + e_loc)
            recv_idx = torch.where(local, unpacked[2] - begin, -1)
            recv_w = torch.where(local, unpacked[3], 0.0)
        from_rail = torch.tensor(
            [row[1 + e_loc + channels :] for row in host], dtype=torch.int64
        )  # [W, C]
        send_rdma_head = torch.where(in_node, torch.cumsum(in_node.to(torch.int64), 0) - 1, -1).to(
            torch.int32
        )
        handle = (
            in_rank,
            torch.cumsum(rdma_channel_NC, 1).to(torch.int32),
            torch.cumsum(gbl_channel_WC, 1).to(torch.int32),
            torch.cumsum(from_rail.view(n, p, channels).sum(dim=1), 1).to(torch.int32),
            torch.cumsum(from_rail.sum(dim=1).view(n, p).sum(dim=1), 0).to(torch.int32),
            torch.tensor([row[1 + e_loc : 1 + e_loc + channels] for row in host], dtype=torch.int64)
            .cumsum(1)
            .to(torch.int32),
            torch.cumsum(torch.tensor(recv_per_rank, dtype=torch.int64), 0).to(torch.int32),
            recv_meta.contiguous().view(torch.uint8).view(-1, _SOURCE_META_BYTES),
            send_rdma_head,
            torch.full((int(from_rail.sum()), p), -1, dtype=torch.int32),
        )
        return recv_x, recv_idx, recv_w, per_expert_list, handle, FakeEventOverlap()

    def _exchange(
        self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """All-to-all of whole rows (any dtype, any row shape)."""
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        width = torch.Size(rows.shape[1:]).numel() * rows.element_size()
        send = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width)
        recv = out.view(torch.uint8).reshape(out.shape[0], width)
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
        )
        return out

    # ------------------------------------------------------------------ combine
    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns (combined_x [T, H], combined_topk_weights [T, K] or None, event).

        Collective: yes (the group). Host sync: no (the counts come from the handle).
        """
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.num_rdma_ranks == 1:
            raise NotImplementedError("fake deep_ep: intranode mode (one node) is not modelled")
        return self.internode_combine(
            x,
            handle,
            topk_weights,
            bias,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def internode_combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        assert config is not None
        if bias is not None:
            raise NotImplementedError("fake deep_ep: combine bias is not modelled")
        _check(
            previous_event is None and not async_finish and not allocate_on_comm_stream,
            "the fake has no streams: previous_event=None, async_finish=False",
        )
        fields = dict(zip(INTERNODE_HANDLE_FIELDS, handle, strict=True))
        in_rank, src_meta = fields["is_token_in_rank"], fields["recv_src_meta"]
        p, n = self.nvl_peers, self.num_rdma_ranks
        _check(x.dim() == 2 and x.is_contiguous(), "x is [n, H] contiguous")
        _check(
            x.dtype in _COMBINE_DTYPES, f"x dtype {x.dtype} in {_COMBINE_DTYPES} (DeepEP: bfloat16)"
        )
        _check(
            x.shape[1] * x.element_size() % (32 * _INT4_BYTES) == 0,
            "x row bytes a multiple of 512 (hidden_int4 % 32 == 0: a device assert of the TMA "
            "combine)",
        )
        _check(x.shape[0] == src_meta.shape[0], "x has one row per received row of the dispatch")
        _check(
            src_meta.dtype == torch.uint8 and src_meta.shape[1] == _SOURCE_META_BYTES,
            "src_meta [n, 8] uint8",
        )
        _check(
            config.num_sms % 2 == 0 and config.num_max_nvl_chunked_recv_tokens % n == 0,
            "even num_sms; nvl chunked recv tokens a multiple of the RDMA ranks",
        )
        k = 0
        if topk_weights is not None:
            _check(
                topk_weights.dim() == 2
                and topk_weights.is_contiguous()
                and topk_weights.dtype == torch.float32
                and topk_weights.shape[0] == x.shape[0],
                "topk_weights float32 [n, K] contiguous",
            )
            k = topk_weights.shape[1]
        recv_counts = _counts_from_prefix(fields["recv_gbl_rank_prefix_sum"]).tolist()
        row_n, rank_n, send_counts = _pairs(in_rank)
        parts = [x] + ([topk_weights] if k else [])
        back = self._exchange(ops.pack_rows(parts, [None] * len(parts)), recv_counts, send_counts)
        specs = [(x.dtype, tuple(x.shape[1:]))] + ([(torch.float32, (k,))] if k else [])
        back_parts = ops.unpack_rows(back, specs)
        t = in_rank.shape[0]
        # Node level: the node's ranks ascending (rows are rank-major), fp32, cast once.
        node_segment = row_n * n + rank_n // p
        in_node = in_rank.view(t, n, p).any(dim=2).reshape(-1)
        present = torch.nonzero(in_node).flatten()
        out = []
        for part in back_parts:
            node_sum = ops.segment_sum(
                part, node_segment, t * n, out_dtype=part.dtype, max_segment_len=p
            )
            # RDMA level: the nodes ascending, fp32, cast once.
            out.append(
                ops.segment_sum(
                    node_sum.index_select(0, present),
                    present // n,
                    t,
                    out_dtype=part.dtype,
                    max_segment_len=n,
                )
            )
        return out[0], (out[1] if k else None), FakeEventOverlap()


@functools.cache
def fake_deep_ep(gpus_per_node: int) -> SimpleNamespace:
    """A ``deep_ep``-like namespace (``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t``)
    whose Buffer has ``gpus_per_node`` NVLink peers (DeepEP: 8)."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be an integer >= 1")
    config = type("Config", (_FakeConfig,), {"nvl_peers": gpus_per_node, "__module__": __name__})
    buffer = type(
        "Buffer",
        (_FakeBuffer,),
        {"nvl_peers": gpus_per_node, "Config": config, "num_sms": 20, "__module__": __name__},
    )
    return SimpleNamespace(
        Buffer=buffer,
        Config=config,
        EventOverlap=FakeEventOverlap,
        topk_idx_t=torch.int64,
        __version__="2.1.0+railwave-fake",
        combine_dtypes=_COMBINE_DTYPES,
        known_node_counts=_KNOWN_NODE_COUNTS,
    )


def fake_deepep_api(gpus_per_node: int) -> DeepEPApi:
    """The fake as the DeepEP backend's ``DeepEPApi`` (kind 'fake'), with ``gpus_per_node``
    NVLink peers and the fake's limits: pass it as ``build_exchange(..., deepep_api=...)`` or
    ``DeepEPExchange(..., api=...)``."""
    ns = fake_deep_ep(gpus_per_node)
    limits = DeepEPLimits(
        nvl_peers=gpus_per_node,
        node_counts=ns.known_node_counts,
        combine_dtypes=ns.combine_dtypes,
    )
    return DeepEPApi(
        kind="fake",
        Buffer=ns.Buffer,
        Config=ns.Config,
        EventOverlap=ns.EventOverlap,
        limits=limits,
    )


@contextlib.contextmanager
def use_fake_deepep() -> Iterator[None]:
    """Inside the block, backend 'deepep' runs on the fake in this process (every exchange built
    without an explicit ``deepep_api``, e.g. by the dispatcher); the previous stand-in comes back
    after it. Backend 'auto' still only ever picks the real DeepEP."""
    previous = set_deep_ep_stand_in(fake_deepep_api)
    try:
        yield
    finally:
        set_deep_ep_stand_in(previous)
