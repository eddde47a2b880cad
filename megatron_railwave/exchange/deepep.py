"""The DeepEP backend: the four paths over a stock ``deep_ep.Buffer`` (internode normal mode).

``DeepEPBackend`` is the backend (``exchange.base.ExchangeBackend``, a sibling of the torch
backend's ``TorchDistBackend``); ``DeepEPExchange`` is the exchange that drives it
(``exchange.driver.Exchange``, whose count exchange, planning, autograd functions and
asynchronous form every backend shares).

Letters: N nodes, G GPUs per node, W = N * G ranks, T tokens of this rank, E experts,
E_node = E / N, E_loc = E / W, H hidden, K = min(top-k, E_node) slots of a record row, V waves,
n_rec records of this rank, n_disp rows it dispatches, n_copy rows it receives, n_ent entries.

DeepEP always sends a row over the source GPU's own rail, then forwards it over NVLink; Python
cannot pick the rail. So the paths are composed around it, not inside it:

* Records as rows: each (token, destination node) record is one row of DeepEP's ``x``, its
  ``topk_idx`` holding only that node's experts (-1 elsewhere). Network bytes are unchanged
  (DeepEP sends a row once per node anyway); combine returns one partial per record, summed
  over the node's GPUs in ascending order in fp32 and cast once (DeepEP's NVLink-level combine),
  and the owner sums its records' partials in canonical node order (``ops.segment_sum``). The
  per-copy sum over local experts happens before combine, in ascending expert order. These are
  the torch backend's three reductions, so the four paths, and both backends, are bitwise equal.
* Every path runs the plan's relay first (``moves.relay_forward``: owner -> proxy over the node
  group, empty for NATIVE / PERM without failed rails), so a relayed record leaves on the
  proxy's rail; combine returns it to the proxy, which sends it back (``relay_backward``).
* One dispatch per wave (``plan.pair_wave_NN``): each rank dispatches the slice of its rows
  whose destination node is in that wave (the local node's records ride in wave 0); combine runs
  the waves in reverse order, one DeepEP handle per wave. NATIVE / RAIL have one wave.
* Each row carries 16 bytes of record meta (owner EP rank, token) after its payload, so the
  receiver sorts its entries by (local expert, owner, token) like the torch backend.
* Backward passes reuse the cached handles: dispatch backward is a combine (with the probs
  gradients as ``topk_weights``), combine backward a cached dispatch.

Per layer on top of the torch backend's count exchange (the one host sync): per wave of the
forward dispatch a layout kernel, DeepEP's notify step (a barrier) and its CPU wait on the
received counts, so PERM / JOINT pay V host waits per layer (V = the plan's waves). That wait
cannot be removed through the stock API: the internode dispatch refuses ``num_worst_tokens``
(DeepEP 2.1 at dd758ca, ``deep_ep/buffers/legacy.py``: "Internode dispatch does not support
``num_worst_tokens > 0``"), and a non-cached dispatch spins on the host until the received counts
arrive (``csrc/legacy/buffer.hpp``, internode dispatch). The backward passes and combine use the
cached handles: no host wait.

Row widths against DeepEP's internode kernels (same source): a dispatch row is H + 8 elements
(the payload, then the 16-byte record meta; H = 4096 bf16: 8208 B, ``hidden_int4`` = 513).
The internode dispatch asks only that a row be a multiple of 16 bytes (``EP_HOST_ASSERT((x.size(1)
* x.element_size()) % sizeof(int4) == 0)``) and that the row plus source meta and top-k fit one
warp's 16 KiB TMA buffer (``deepep_api.deepep_layout_problems`` checks both); ``hidden_int4 % 32
== 0`` is asserted only in combine's TMA reduction (``internode.cu``), whose rows here are H wide
(4096 bf16: 512). So the layout needs no padding (0 extra bytes). Not yet run on hardware.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_railwave import ops
from megatron_railwave.exchange.base import ExchangeBackend
from megatron_railwave.exchange.deepep_api import (
    DeepEPApi,
    check_deepep_layout,
    deepep_buffer_bytes,
    dispatch_row_bytes,
    record_meta_bytes,
)
from megatron_railwave.exchange.driver import Exchange
from megatron_railwave.exchange.groups import RankGroups
from megatron_railwave.exchange.layer import (
    InputError,
    LayerDemand,
    LayerHandle,
    RankContext,
)
from megatron_railwave.exchange.layout import HostCounts, select_positions
from megatron_railwave.exchange.moves import relay_backward, relay_forward
from megatron_railwave.exchange.transport import Program
from megatron_railwave.planner import PathPlan, PlanOptions
from megatron_railwave.topology import RailTopology

__all__ = [
    "DeepEPBackend",
    "DeepEPExchange",
    "DeepEPLayer",
    "DeepEPHandle",
    "destroy_deepep_buffers",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepEPLayer:
    """One layer's plan and index maps for DeepEP (rank-local).

    Attributes:
        layer: the torch backend's layer handle (schedule, rank view, owner / relay maps).
        order: [n_disp] int64, row of [local-node records | relay pool] dispatched at each
            position; positions are grouped by wave.
        inverse: [n_disp] int64, the inverse permutation of ``order``.
        wave_rows: host, rows this rank dispatches in each wave.
        num_local: host, this rank's local-node records.
    """

    layer: LayerHandle
    order: torch.Tensor
    inverse: torch.Tensor
    wave_rows: list[int]
    num_local: int

    @property
    def plan(self) -> PathPlan:
        return self.layer.plan

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.layer.tokens_per_expert

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of one row of DeepEP's dispatch input (payload and record meta)."""
        return dispatch_row_bytes(self.layer.wire.hidden, self.layer.wire.payload_dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepEPHandle:
    """What combine and the backward passes need from dispatch (rank-local).

    Attributes:
        layer: the ``DeepEPLayer``.
        wave_handles: DeepEP's handle of each wave's dispatch (passed back unchanged).
        recv_rows: host, rows received in each wave.
        topk_idx_R: [n_rec, K] int64, global experts of each record (canonical order), -1 padded.
        copy_of_entry: [n_ent] int64, received row of each entry (entries in canonical order).
        slot_of_entry: [n_ent] int64, position of each entry in the received [n_copy, K] top-k.
    """

    layer: DeepEPLayer
    wave_handles: tuple[Any, ...]
    recv_rows: tuple[int, ...]
    topk_idx_R: torch.Tensor
    copy_of_entry: torch.Tensor
    slot_of_entry: torch.Tensor

    @property
    def plan(self) -> PathPlan:
        return self.layer.plan

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.layer.tokens_per_expert


_BUFFERS: dict[tuple, tuple[Any, Any]] = {}


def _accepts_explicit_destroy(buffer_cls: Any) -> bool:
    """Whether ``buffer_cls(...)`` takes ``explicitly_destroy`` (DeepEP >= 1.2; 2.1 does)."""
    try:
        return "explicitly_destroy" in inspect.signature(buffer_cls).parameters
    except (TypeError, ValueError):  # a C-implemented class without a signature
        return False


def _shared_buffer(
    api: DeepEPApi, groups: RankGroups, num_nvl_bytes: int, num_rdma_bytes: int
) -> Any:
    """One Buffer per (implementation, EP group, sizes) in this process, shared by every MoE layer
    (as Megatron's flex dispatcher shares its one): a layer's dispatch, experts and combine finish
    before the next layer's start, and each call's handle holds its own layout tensors.

    Built with ``explicitly_destroy=True`` where the Buffer takes it: its resources are released
    by ``destroy_deepep_buffers`` (call it before ``destroy_process_group``), not by the
    destructor, which DeepEP warns may hang Python's exception handling.

    Collective: yes (the EP group), the first time only.
    """
    key = (id(api.Buffer), id(groups.ep.handle), num_nvl_bytes, num_rdma_bytes)
    if key not in _BUFFERS:  # the value keeps the group alive, so its id is not reused
        extra = {"explicitly_destroy": True} if _accepts_explicit_destroy(api.Buffer) else {}
        _BUFFERS[key] = (
            api.Buffer(groups.ep.handle, num_nvl_bytes, num_rdma_bytes, **extra),
            groups.ep.handle,
        )
    return _BUFFERS[key][0]


def destroy_deepep_buffers() -> int:
    """Release every DeepEP Buffer this process made (``buffer.destroy()`` for those built with
    ``explicitly_destroy``; the others are dropped to their destructor) and forget them. Call it
    on every rank before ``torch.distributed.destroy_process_group()``: a Buffer alive past its
    group is a known teardown hang. Returns how many were destroyed explicitly.

    Collective: DeepEP's destroy synchronizes the device and its peers' IPC handles (every rank
    calls it). Not yet run on hardware.
    """
    destroyed = 0
    for buffer, _group in list(_BUFFERS.values()):
        if getattr(buffer, "explicitly_destroy", False):
            buffer.destroy()
            destroyed += 1
    _BUFFERS.clear()
    return destroyed


class DeepEPBackend(ExchangeBackend):
    """The four paths with DeepEP's internode dispatch / combine (see module docstring).

    Args:
        topo: the cluster (W = EP size).
        groups: this rank's groups (``build_rail_groups``); DeepEP's Buffer uses ``groups.ep``.
        num_experts: E.
        topk: the router's top-k (K = min(topk, E_node) slots per record row).
        hidden_size, hidden_dtype: H and the dtype of the hidden states (the Buffer is sized for
            them; DeepEP's combine needs bfloat16).
        api: ``deepep_api.load_deep_ep()`` (the wheel), or another implementation of its API
            (tests: ``testing.deepep_fake.fake_deepep_api``).
        num_sms: SMs of DeepEP's normal kernels (even; DeepEP's default 20).
        options: planner options (the relay and the count exchange).

    Raises:
        ValueError: the layout breaks a DeepEP limit (every rank, before any communication).

    Collective: yes (the EP group, at construction: DeepEP's Buffer).
    """

    def __init__(
        self,
        topo: RailTopology,
        groups: RankGroups,
        *,
        num_experts: int,
        topk: int,
        hidden_size: int,
        hidden_dtype: torch.dtype,
        api: DeepEPApi,
        num_sms: int = 20,
        options: PlanOptions | None = None,
    ) -> None:
        check_deepep_layout(
            topo,
            api,
            hidden_size=hidden_size,
            hidden_dtype=hidden_dtype,
            topk=topk,
            num_experts=num_experts,
        )
        if not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2:
            raise ValueError(
                f"deepep_num_sms={num_sms!r} must be an even integer >= 2 (DeepEP runs two SMs per "
                "channel; its default is 20)"
            )
        self.ctx = RankContext(
            topo=topo, groups=groups, num_experts=num_experts, options=options or PlanOptions()
        )
        self.api = api
        self.hidden_size, self.hidden_dtype = hidden_size, hidden_dtype
        self.topk_slots = min(topk, self.ctx.experts_per_node)
        self.meta_cols = record_meta_bytes() // torch.empty(0, dtype=hidden_dtype).element_size()
        api.Buffer.set_num_sms(num_sms)
        self.dispatch_config = api.Buffer.get_dispatch_config(topo.world_size)
        self.combine_config = api.Buffer.get_combine_config(topo.world_size)
        self.num_nvl_bytes, self.num_rdma_bytes = deepep_buffer_bytes(
            self.dispatch_config,
            self.combine_config,
            num_ranks=topo.world_size,
            row_bytes=dispatch_row_bytes(hidden_size, hidden_dtype),
        )
        self.buffer = _shared_buffer(api, groups, self.num_nvl_bytes, self.num_rdma_bytes)

    # ------------------------------------------------------------------ preparation
    def prepare(
        self, layer: LayerDemand, plan: PathPlan, hidden: torch.Tensor, probs: torch.Tensor
    ) -> DeepEPLayer:
        """The torch backend's preparation plus the wave-ordered dispatch rows. No communication."""
        if hidden.dtype != self.hidden_dtype or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"backend 'deepep': hidden states are {hidden.dtype} [.., {hidden.shape[-1]}], the "
                f"DeepEP buffer was built for {self.hidden_dtype} [.., {self.hidden_size}]"
            )
        if probs.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"backend 'deepep': probs dtype {probs.dtype}; DeepEP carries them as float32 "
                f"top-k "
                "weights, exact for float32, bfloat16 and float16 only"
            )
        if plan.chunks != 1:
            raise ValueError(
                f"backend 'deepep': the plan has {plan.chunks} rail chunks per wave; DeepEP "
                f"dispatches "
                "whole waves. Set chunks: 1 in the RailWave config, or use backend 'torch'"
            )
        handle = self.prepare_schedule(layer, plan, hidden, probs)
        view, layout = handle.view, handle.layout
        g, s = self.ctx.topo.gpus_per_node, view.node
        num_local = view.owner_category_counts[g]
        wave_N = plan.pair_wave_NN[s].numpy()
        egress_N = np.asarray(view.egress_N, dtype=np.int64)
        egress_start_N = num_local + np.cumsum(egress_N) - egress_N  # in [local | egress rows]
        starts, counts, wave_rows = [0], [num_local], []
        for v in range(max(plan.num_waves, 1)):
            nodes = np.flatnonzero(wave_N == v)
            starts += egress_start_N[nodes].tolist()
            counts += egress_N[nodes].tolist()
            wave_rows.append(int(egress_N[nodes].sum()) + (num_local if v == 0 else 0))
        total = sum(counts)
        host = HostCounts()
        host.add("shift", np.asarray(starts) - (np.cumsum(counts) - counts))
        host.add("count", np.asarray(counts))
        dev = host.to(hidden.device)
        in_s = torch.repeat_interleave(
            dev["shift"], dev["count"], output_size=total
        ) + torch.arange(
            total, dtype=torch.int64, device=hidden.device
        )  # position in [local rows | egress rows]
        row_of_s = torch.cat(
            [
                torch.arange(num_local, dtype=torch.int64, device=hidden.device),
                layout.egress_perm + num_local,
            ]
        )  # -> row of [local rows | pool]
        order = row_of_s.index_select(0, in_s)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(total, dtype=torch.int64, device=hidden.device)
        )
        return DeepEPLayer(
            layer=handle, order=order, inverse=inverse, wave_rows=wave_rows, num_local=num_local
        )

    # ------------------------------------------------------------------ programs
    def _records_topk(
        self, routing_map: torch.Tensor, token_R: torch.Tensor, node_R: torch.Tensor
    ) -> torch.Tensor:
        """[n_rec, K] int64: each record's experts on its node, ascending, -1 padded."""
        e_node, n = self.ctx.experts_per_node, self.ctx.topo.num_nodes
        bits = routing_map.reshape(-1, e_node).index_select(0, token_R * n + node_R)
        col = torch.arange(e_node, dtype=torch.int64, device=bits.device)
        first = torch.where(bits, col, col + e_node).sort(dim=1).values[:, : self.topk_slots]
        return torch.where(first < e_node, node_R.unsqueeze(1) * e_node + first, -1)

    def _dispatch_rows(self, dl: DeepEPLayer, rows_o: torch.Tensor) -> Program:
        """Owner rows [n_rec, b] (owner order) -> this rank's dispatch rows [n_disp, b] (relay
        first)."""
        layer = dl.layer
        pool = yield from relay_forward(
            rows_o, layout=layer.layout, schedule=layer.schedule, groups=self.ctx.groups
        )
        local = rows_o[rows_o.shape[0] - dl.num_local :]
        return ops.pack_rows([torch.cat([local, pool])], [dl.order])

    def _return_rows(self, dl: DeepEPLayer, parts: list[torch.Tensor]) -> Program:
        """Rows in dispatch order -> the owners' rows [n_rec, b] uint8 in owner order (relay
        back)."""
        layer = dl.layer
        packed = ops.pack_rows(parts, [dl.inverse] * len(parts))  # [local | pool] order
        out = packed.new_empty((layer.view.num_records, packed.shape[1]))
        out[out.shape[0] - dl.num_local :].copy_(packed[: dl.num_local])
        yield from relay_backward(
            packed[dl.num_local :],
            out,
            layout=layer.layout,
            schedule=layer.schedule,
            groups=self.ctx.groups,
        )
        return out

    def _wave_slices(self, rows: list[int]) -> list[slice]:
        bounds = np.concatenate([[0], np.cumsum(rows)]).tolist()
        return [slice(bounds[v], bounds[v + 1]) for v in range(len(rows))]

    def dispatch_forward(
        self, dl: DeepEPLayer, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> Program:
        """Returns (tokens [n_ent, H], entry probs [n_ent], ``DeepEPHandle``)."""
        layer, ctx, h = dl.layer, self.ctx, self.hidden_size
        layout = layer.layout
        idx_R = self._records_topk(routing_map, layout.token_R, layout.node_R)
        order = layout.owner_order
        token_o, idx_o = layout.token_R.index_select(0, order), idx_R.index_select(0, order)
        weights_o = torch.where(idx_o >= 0, probs[token_o.unsqueeze(1), idx_o.clamp(min=0)], 0).to(
            torch.float32
        )
        meta_o = torch.zeros(
            (token_o.shape[0], record_meta_bytes() // 4), dtype=torch.int32, device=hidden.device
        )
        meta_o[:, 0], meta_o[:, 1] = ctx.groups.ep_rank, token_o.to(torch.int32)
        rows_o = ops.pack_rows([hidden, meta_o, idx_o, weights_o], [token_o, None, None, None])
        disp = yield from self._dispatch_rows(dl, rows_o)
        x, topk_idx, topk_w = ops.unpack_rows(
            disp,
            [
                (hidden.dtype, (h + self.meta_cols,)),
                (torch.int64, (self.topk_slots,)),
                (torch.float32, (self.topk_slots,)),
            ],
        )
        recv_x, recv_idx, recv_w, handles, per_expert = (
            [],
            [],
            [],
            [],
            np.zeros(ctx.experts_per_rank, np.int64),
        )
        for part in self._wave_slices(dl.wave_rows):
            per_rank, per_rdma, per_exp, in_rank, _ = self.buffer.get_dispatch_layout(
                topk_idx[part], self.ctx.num_experts
            )
            rx, ridx, rw, counts, handle, _ = self.buffer.dispatch(
                x[part],
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_exp,
                topk_idx=topk_idx[part],
                topk_weights=topk_w[part],
                config=self.dispatch_config,
            )
            recv_x.append(rx)
            recv_idx.append(ridx)
            recv_w.append(rw)
            handles.append(handle)
            per_expert += np.asarray(counts, dtype=np.int64)
        expected = layer.tokens_per_expert.numpy()
        if not np.array_equal(per_expert, expected):
            raise InputError(
                f"EP rank {ctx.groups.ep_rank}: DeepEP delivered {per_expert.tolist()} entries "
                f"per local expert, the "
                f"count exchange announced {expected.tolist()}: a token routes to more than "
                f"{self.topk_slots} experts "
                "of one node. routing_map must have at most top-k True per row"
            )
        rx, ridx, rw = torch.cat(recv_x), torch.cat(recv_idx), torch.cat(recv_w)
        meta = rx[:, h:].contiguous().view(torch.int32)
        flat = select_positions((ridx >= 0).reshape(-1), layer.num_entries)
        copy, expert = flat // self.topk_slots, ridx.reshape(-1).index_select(0, flat)
        owner = meta[:, 0].to(torch.int64).index_select(0, copy)
        token = meta[:, 1].to(torch.int64).index_select(0, copy)
        key = (expert * self.ctx.topo.world_size + owner) * max(layer.max_tokens, 1) + token
        perm = torch.sort(key).indices
        copy_of_entry, slot_of_entry = copy.index_select(0, perm), flat.index_select(0, perm)
        tokens = rx[:, :h].index_select(0, copy_of_entry)
        entry_probs = rw.reshape(-1).index_select(0, slot_of_entry).to(probs.dtype)
        handle = DeepEPHandle(
            layer=dl,
            wave_handles=tuple(handles),
            recv_rows=tuple(int(r.shape[0]) for r in recv_x),
            topk_idx_R=idx_R,
            copy_of_entry=copy_of_entry,
            slot_of_entry=slot_of_entry,
        )
        return tokens, entry_probs, handle

    def _combine_waves(
        self, handle: DeepEPHandle, x_C: torch.Tensor, w_C: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DeepEP combine per wave, in reverse wave order. Returns rows in dispatch order."""
        parts = self._wave_slices(list(handle.recv_rows))
        out_x: list[Any] = [None] * len(parts)
        out_w: list[Any] = [None] * len(parts)
        for v in reversed(range(len(parts))):
            out_x[v], out_w[v], _ = self.buffer.combine(
                x_C[parts[v]],
                handle.wave_handles[v],
                topk_weights=None if w_C is None else w_C[parts[v]],
                config=self.combine_config,
            )
        return torch.cat(out_x), (None if w_C is None else torch.cat(out_w))

    def combine_forward(self, handle: DeepEPHandle, expert_out: torch.Tensor) -> Program:
        """Returns [T, H]: expert outputs summed per received row, combined, summed per token."""
        layer = handle.layer.layer
        if expert_out.dtype != self.hidden_dtype:
            raise ValueError(
                f"combine: expert output dtype {expert_out.dtype} differs from the dispatched "
                f"hidden "
                f"dtype {self.hidden_dtype}"
            )
        y_C = ops.segment_sum(
            expert_out,
            handle.copy_of_entry,
            sum(handle.recv_rows),
            max_segment_len=self.ctx.experts_per_rank,
        )
        y_disp, _ = self._combine_waves(handle, y_C, None)
        back = yield from self._return_rows(handle.layer, [y_disp])
        (y_R,) = ops.unpack_rows(
            back,
            [(self.hidden_dtype, (self.hidden_size,))],
            row_index=layer.layout.owner_order,
            num_rows=layer.view.num_records,
        )
        return ops.segment_sum(
            y_R, layer.layout.token_R, layer.num_tokens, max_segment_len=self.ctx.topo.num_nodes
        )

    def combine_backward(self, handle: DeepEPHandle, g_out: torch.Tensor) -> Program:
        """Returns g_expert_out [n_ent, H]: g_out rows dispatched again with the cached handles."""
        layer = handle.layer.layer
        token_o = layer.layout.token_R.index_select(0, layer.layout.owner_order)
        disp = yield from self._dispatch_rows(
            handle.layer, ops.pack_rows([g_out.to(self.hidden_dtype)], [token_o])
        )
        (x,) = ops.unpack_rows(disp, [(self.hidden_dtype, (self.hidden_size,))])
        recv = [
            self.buffer.dispatch(
                x[part], handle=handle.wave_handles[v], config=self.dispatch_config
            )[0]
            for v, part in enumerate(self._wave_slices(handle.layer.wave_rows))
        ]
        return torch.cat(recv).index_select(0, handle.copy_of_entry)

    def dispatch_backward(
        self,
        handle: DeepEPHandle,
        g_tokens: torch.Tensor,
        g_probs: torch.Tensor,
        probs_dtype: torch.dtype,
    ) -> Program:
        """Returns (g_hidden [T, H], g_probs [T, E])."""
        layer, k = handle.layer.layer, self.topk_slots
        n_copy = sum(handle.recv_rows)
        g_x_C = ops.segment_sum(
            g_tokens,
            handle.copy_of_entry,
            n_copy,
            out_dtype=self.hidden_dtype,
            max_segment_len=self.ctx.experts_per_rank,
        )
        g_w_C = torch.zeros(n_copy * k, dtype=torch.float32, device=g_tokens.device)
        g_w_C.index_put_((handle.slot_of_entry,), g_probs.to(torch.float32))
        g_x_disp, g_w_disp = self._combine_waves(handle, g_x_C, g_w_C.view(n_copy, k))
        back = yield from self._return_rows(handle.layer, [g_x_disp, g_w_disp])
        g_x_R, g_w_R = ops.unpack_rows(
            back,
            [(self.hidden_dtype, (self.hidden_size,)), (torch.float32, (k,))],
            row_index=layer.layout.owner_order,
            num_rows=layer.view.num_records,
        )
        t, e = layer.num_tokens, self.ctx.num_experts
        g_hidden = ops.segment_sum(
            g_x_R,
            layer.layout.token_R,
            t,
            out_dtype=self.hidden_dtype,
            max_segment_len=self.ctx.topo.num_nodes,
        )
        idx_R = handle.topk_idx_R
        target = torch.where(idx_R >= 0, layer.layout.token_R.unsqueeze(1) * e + idx_R, t * e)
        g_probs_TE = torch.zeros(t * e + 1, dtype=probs_dtype, device=g_tokens.device)
        g_probs_TE.scatter_(0, target.reshape(-1), g_w_R.reshape(-1).to(probs_dtype))
        return g_hidden, g_probs_TE[: t * e].view(t, e)


class DeepEPExchange(Exchange):
    """Executes path plans with DeepEP's internode dispatch / combine: the ``Exchange`` driving
    a ``DeepEPBackend``.

    Args:
        topo, groups, backend_args: ``DeepEPBackend``'s (``num_experts``, ``topk``,
            ``hidden_size``, ``hidden_dtype``, ``api``, ``num_sms``, ``options``).
        timeout_s: bound of every wait of the relay and the count exchange (DeepEP's own calls
            have DeepEP's timeouts, the fake's the EP group's).

    ``dispatch`` / ``combine`` give the torch backend's outputs (same entry order); unlike it,
    ``dispatch`` has one host sync per wave (DeepEP's CPU wait on the received counts). No
    fixed-capacity mode. Raises and communicates at construction as ``DeepEPBackend``.
    """

    def __init__(
        self,
        topo: RailTopology,
        groups: RankGroups,
        *,
        timeout_s: float | None = None,
        **backend_args: Any,
    ) -> None:
        super().__init__(DeepEPBackend(topo, groups, **backend_args), timeout_s=timeout_s)
