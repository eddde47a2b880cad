"""Count host syncs on the CPU: every operation that would make a GPU wait for the device.

On a GPU, ``torch.cuda.set_sync_debug_mode`` flags synchronising calls. On the CPU nothing
synchronises, so ``SyncAudit`` (a ``TorchFunctionMode``) tracks which tensors hold *device
data* (derived from the tensors you mark, or created with an explicit ``device=``) and counts
the operations that would read such data back to the host on a GPU:

    .item()  .tolist()  .cpu()  .numpy()  .to('cpu')  int() / float() / bool() / index of a tensor
    nonzero / argwhere / where(cond)  masked_select  unique  bincount  equal
    repeat_interleave without output_size  boolean-mask indexing (get and set)

The result of a counted operation is host data (not tracked): planning on the gathered counts
after the one device-to-host copy of a layer is host work and costs nothing here. Only Python
calls are seen: run the code under test directly, not inside ``torch.autograd.backward``
(the autograd engine runs backward functions outside the mode).
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SyncAudit", "SyncEvent"]

_T = torch.Tensor
_ALWAYS = {
    _T.item,
    _T.tolist,
    _T.numpy,
    _T.cpu,
    _T.__bool__,
    _T.__int__,
    _T.__float__,
    _T.__index__,
    torch.nonzero,
    _T.nonzero,
    torch.argwhere,
    _T.argwhere,
    torch.masked_select,
    _T.masked_select,
    torch.unique,
    _T.unique,
    torch.unique_consecutive,
    _T.unique_consecutive,
    torch.bincount,
    _T.bincount,
    torch.equal,
    _T.equal,
}


@dataclass(frozen=True, slots=True)
class SyncEvent:
    name: str
    where: str


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


@dataclass
class SyncAudit(TorchFunctionMode):
    """``with SyncAudit() as audit: audit.mark(x, ...); run(); audit.count``."""

    events: list[SyncEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}

    @property
    def count(self) -> int:
        return len(self.events)

    def mark(self, *tensors: torch.Tensor) -> None:
        """Treat ``tensors`` (and everything derived from them) as device data."""
        for t in _tensors(list(tensors)):
            self._taint(t)

    def _taint(self, t: torch.Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _r, k=key: self._refs.pop(k, None))

    def _tainted(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def _is_sync(self, func: Any, args: tuple, kwargs: dict, tainted: bool) -> bool:
        if func in _ALWAYS:
            return tainted
        if func in (_T.to,):
            dev = kwargs.get(
                "device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
            )
            return tainted and dev is not None and torch.device(dev).type == "cpu"
        if func in (torch.where, _T.where) and len(args) + len(kwargs) == 1:
            return tainted
        if func in (torch.repeat_interleave, _T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return (
                tainted and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
            )
        if func in (_T.__getitem__, _T.__setitem__):
            key = args[1] if len(args) > 1 else None
            keys = key if isinstance(key, tuple) else (key,)
            masks = [k for k in keys if isinstance(k, torch.Tensor) and k.dtype == torch.bool]
            return bool(masks) and tainted
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        tainted = any(self._tainted(t) for t in inputs)
        if self._is_sync(func, args, kwargs, tainted):
            frame = next(
                (
                    f
                    for f in reversed(traceback.extract_stack()[:-1])
                    if "/torch/" not in f.filename
                ),
                traceback.extract_stack()[0],
            )
            self.events.append(
                SyncEvent(
                    name=getattr(func, "__name__", str(func)),
                    where=f"{frame.filename}:{frame.lineno}",
                )
            )
            out = func(*args, **kwargs)
            for t in _tensors(out):  # host data now (on the CPU .cpu() may return its input itself)
                self._refs.pop(id(t), None)
            return out
        out = func(*args, **kwargs)
        if tainted or "device" in kwargs:
            for t in _tensors(out):
                self._taint(t)
        return out
