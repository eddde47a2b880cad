"""Which execution backend runs a layer: the torch.distributed one or DeepEP; one construction
point.

``build_exchange`` is what the dispatcher calls. ``backend``:

* 'torch': ``TorchDistExchange`` (point-to-point phases of the ``ExecutionSchedule``; any layout).
* 'deepep': ``DeepEPExchange`` over ``deep_ep.Buffer`` (the wheel; tests pass another
  implementation as ``deepep_api``, or set one for the process with
  ``deepep_api.set_deep_ep_stand_in``). A mode only the torch backend runs (fixed capacity, rail
  chunks), a placement DeepEP cannot serve and a layout DeepEP cannot run raise ``ValueError`` on
  every rank before any communication; a rank where DeepEP does not import makes every rank raise
  ``ImportError``.
* 'auto': 'deepep' when the job runs on GPUs (NCCL), ``deep_ep`` imports on every EP rank and the
  layout meets DeepEP's limits; else 'torch'. With ``max_tokens_per_rank`` (fixed-capacity mode,
  which only the torch backend runs) 'auto' is 'torch' and 'deepep' raises ``ValueError``. The
  choice is agreed on the EP group (one small all-gather), so every rank takes the same backend.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_railwave.exchange.capacity import check_capacity, check_padding
from megatron_railwave.exchange.deepep import DeepEPExchange
from megatron_railwave.exchange.deepep_api import (
    REAL_LIMITS,
    DeepEPApi,
    check_deepep_layout,
    deep_ep_for_backend,
    deep_ep_importable,
    deepep_layout_problems,
    load_deep_ep,
)
from megatron_railwave.exchange.driver import Exchange
from megatron_railwave.exchange.groups import RankGroups
from megatron_railwave.exchange.torch_dist import TorchDistExchange
from megatron_railwave.names import BackendName
from megatron_railwave.planner import PlanOptions
from megatron_railwave.topology import RailTopology

__all__ = ["build_exchange", "deepep_rank_order_problem"]

_LOG = logging.getLogger("megatron_railwave.exchange")
_LOGGED: set[str] = set()
"""'auto' decisions already logged in this process (one per layer otherwise)."""


def _ranks_failing(groups: RankGroups, ok: bool) -> list[int]:
    """EP ranks for which ``ok`` is False (collective on the EP group; one all-gather)."""
    handle = groups.ep.handle
    if handle is None or not dist.is_initialized():
        return [] if ok else [groups.ep_rank]
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(handle) == "nccl"
        else "cpu"
    )
    flags = torch.zeros(len(groups.ep.ranks), dtype=torch.int32, device=device)
    dist.all_gather_into_tensor(
        flags, torch.tensor([int(ok)], dtype=torch.int32, device=device), group=handle
    )
    return [r for r, f in enumerate(flags.tolist()) if not f]


def deepep_rank_order_problem(groups: RankGroups) -> str:
    """Why DeepEP cannot serve this placement ('' when it can). DeepEP's Buffer numbers ranks in
    its group's order (torch orders a group by global rank) and puts expert x on rank x // E_loc
    and rank r on node r // G, while the exchange numbers experts and ranks in railwave order
    (``exchange.placement``). When the two orders differ, tokens would go to the wrong ranks and
    nodes; remapping the expert ids would not fix the node grouping, so such placements are
    refused. Pure: the same answer on every rank (the placement is global)."""
    order = groups.ep.group_ranks
    if order is None or tuple(order) == tuple(range(len(order))):
        return ""
    return (
        f"the EP group's rank order is not node by node (railwave rank -> global rank "
        f"{groups.placement.global_rank_of_railwave}; {groups.placement.describe()}), while "
        f"DeepEP's Buffer "
        "assumes group rank r sits on node r // G and owns experts r * E_loc .."
    )


def build_exchange(
    topo: RailTopology,
    groups: RankGroups,
    *,
    backend: BackendName,
    num_experts: int,
    topk: int,
    hidden_size: int,
    hidden_dtype: torch.dtype,
    deepep_api: DeepEPApi | None = None,
    deepep_num_sms: int = 20,
    options: PlanOptions | None = None,
    timeout_s: float | None = None,
    max_tokens_per_rank: int | None = None,
    streamed_candidates: bool = False,
) -> Exchange:
    """The exchange of one MoE layer's EP group (see module docstring).

    ``streamed_candidates``: some layer calls may plan a streamed relay (``Exchange.plan``'s
    ``streamed``: the online selector's '+streamed' candidates), which DeepEP cannot run: 'auto'
    takes the torch backend, 'deepep' is refused.

    ``deepep_api``: for backend 'deepep', the ``deep_ep`` implementation to run on (a testing
    hook: ``testing.deepep_fake.fake_deepep_api``); None = ``deepep_api.deep_ep_for_backend``
    (the wheel, or the process's stand-in). 'auto' ignores it.

    Collective: yes (the EP group: the backend agreement for 'deepep' / 'auto', DeepEP's Buffer).

    Raises:
        ValueError: 'deepep' with fixed capacity, rail chunks or a streamed relay, or a
            placement or layout DeepEP cannot run; an unknown backend; a bad
            ``max_tokens_per_rank`` (every rank, no communication). Fixed capacity that pads
            far beyond a full batch warns once (``capacity.check_padding``).
        ImportError: 'deepep' and ``deep_ep`` does not import on some rank (every rank raises).
    """
    if max_tokens_per_rank is not None:
        check_padding(
            capacity=check_capacity(max_tokens_per_rank),
            num_experts=num_experts,
            world_size=topo.world_size,
            topk=topk,
            hidden_size=hidden_size,
            element_bytes=torch.empty(0, dtype=hidden_dtype).element_size(),
        )
    common = dict(num_experts=num_experts, options=options, timeout_s=timeout_s)
    torch_only = _torch_only_mode(options, max_tokens_per_rank, streamed_candidates)
    if backend == "torch" or (backend == "auto" and torch_only):
        return TorchDistExchange(topo, groups, max_tokens_per_rank=max_tokens_per_rank, **common)
    shape = dict(
        hidden_size=hidden_size, hidden_dtype=hidden_dtype, topk=topk, num_experts=num_experts
    )
    if backend == "deepep":
        if torch_only:
            raise ValueError(torch_only)
        api = _deepep_on_every_rank(topo, groups, deepep_api, shape)
    elif backend == "auto":
        api = _deepep_if_auto_agrees(topo, groups, shape)
    else:
        raise ValueError(f"backend={backend!r} must be 'torch', 'deepep' or 'auto'")
    if api is None:
        return TorchDistExchange(topo, groups, **common)
    return DeepEPExchange(
        topo,
        groups,
        topk=topk,
        hidden_size=hidden_size,
        hidden_dtype=hidden_dtype,
        api=api,
        num_sms=deepep_num_sms,
        **common,
    )


def _torch_only_mode(
    options: PlanOptions | None, max_tokens_per_rank: int | None, streamed_candidates: bool = False
) -> str:
    """Why this layer's mode runs on the torch backend only ('' when DeepEP could run it), as the
    error of backend 'deepep'; 'auto' takes the torch backend for it without asking DeepEP."""
    if max_tokens_per_rank is not None:
        return (
            f"max_tokens_per_rank={max_tokens_per_rank} (fixed-capacity mode) runs on the torch "
            "backend only; set backend: torch (or auto), or max_tokens_per_rank: null for DeepEP"
        )
    if options is not None and options.chunks != 1:
        return (
            f"chunks={options.chunks} (rail chunks per wave) runs on the torch backend only; "
            "DeepEP dispatches whole waves. Set backend: torch (or auto), or chunks: 1 for DeepEP"
        )
    if streamed_candidates:
        return (
            "the online selector's '+streamed' candidates stream the relay into the rail phases, "
            "which runs on the torch backend only; set backend: torch (or auto), or drop them"
        )
    if options is not None and options.streamed:
        return (
            "streamed=True (relay streamed into the rail phases) runs on the torch backend only; "
            "DeepEP moves the rail and delivery stages in one call after the whole relay. Set "
            "backend: torch (or auto), or streamed: false for DeepEP"
        )
    return ""


def _deepep_on_every_rank(
    topo: RailTopology, groups: RankGroups, deepep_api: DeepEPApi | None, shape: dict
) -> DeepEPApi:
    """Backend 'deepep': the ``deep_ep`` to run on, once every EP rank has loaded it.

    Collective: yes (the EP group; one all-gather, after the host-local checks).

    Raises:
        ValueError: the placement or the layout is not DeepEP's (every rank, no communication).
        ImportError: ``deep_ep`` does not import on some rank (every rank raises).
    """
    order_problem = deepep_rank_order_problem(groups)
    if order_problem:
        raise ValueError(
            f"backend 'deepep': {order_problem}; launch ranks node by node (torchrun's order), or "
            "set backend: torch (or auto), which serves any placement"
        )
    api = error = None
    try:
        api = deepep_api if deepep_api is not None else deep_ep_for_backend(topo.gpus_per_node)
    except ImportError as exc:
        error = exc
    if api is not None:  # limits are the same on every rank: raise before any communication
        check_deepep_layout(topo, api, **shape)
    failing = _ranks_failing(groups, api is not None)
    if error is not None:
        raise error
    if failing:
        raise ImportError(
            f"backend 'deepep': DeepEP does not import on EP rank(s) {failing} (see their "
            "errors); install it on every node, or set backend: torch"
        )
    return api


def _deepep_if_auto_agrees(topo: RailTopology, groups: RankGroups, shape: dict) -> DeepEPApi | None:
    """Backend 'auto': the real ``deep_ep`` when every EP rank can run it, else None (torch).
    Logs the choice and its reason once per process (EP rank 0). The fake is for tests and is
    never picked by itself.

    Collective: yes on NCCL (the EP group; one all-gather), none on a CPU job.
    """
    on_nccl = groups.ep.handle is not None and dist.get_backend(groups.ep.handle) == "nccl"
    reason = _why_not_deepep(topo, groups, on_nccl, shape)
    failing = _ranks_failing(groups, not reason) if on_nccl else [groups.ep_rank]
    if failing and not reason:
        reason = f"DeepEP is not usable on EP rank(s) {failing}"
    chosen = "torch" if reason else "deepep"
    message = f"railwave backend 'auto' -> {chosen}" + (f" ({reason})" if reason else "")
    if groups.ep_rank == 0 and message not in _LOGGED:
        _LOGGED.add(message)
        _LOG.info(message)
    return None if reason else load_deep_ep()


def _why_not_deepep(topo: RailTopology, groups: RankGroups, on_nccl: bool, shape: dict) -> str:
    """Why this rank cannot run the real DeepEP ('' when it can), checked in this order: the EP
    group's process-group backend, the placement, the import, the layout. Host-local."""
    if not on_nccl:
        return "the EP group is not on NCCL (CPU job)"
    order_problem = deepep_rank_order_problem(groups)
    if order_problem:
        return order_problem
    importable, why = deep_ep_importable()
    if not importable:
        return f"deep_ep does not import ({why})"
    return "; ".join(deepep_layout_problems(topo, REAL_LIMITS, **shape))
