"""Moving a training batch to the pipeline's device.

A batch is whatever the data loader yields: an object with ``to(device, non_blocking=...)``
(TorchRec's ``Pipelineable``: a TorchRec ``Batch``, a ``KeyedJaggedTensor``), a tensor, a
dataclass (embshard's ``data.synthetic.Batch``), a mapping, a list or a tuple of those. The copy
is what the model receives, and the sharded modules' inputs are read from that same copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

__all__ = ["Pipelineable", "move_batch"]

T = TypeVar("T")


@runtime_checkable
class Pipelineable(Protocol):
    """A batch that moves itself to a device and records its tensors on a stream."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Any: ...

    def record_stream(self, stream: torch.Stream) -> None: ...


def move_batch(batch: T, device: torch.device, non_blocking: bool = False) -> T:
    """``batch`` with every tensor it holds on ``device`` (structure and other values kept).

    Tensors already there stay the same objects; objects with a ``to`` method move themselves.
    """
    moved: T = _move(batch, device, non_blocking)
    return moved


def _move(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if callable(getattr(obj, "to", None)) and not isinstance(obj, type):
        return obj.to(device, non_blocking=non_blocking)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved = {
            f.name: _move(getattr(obj, f.name), device, non_blocking)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **moved)
    if isinstance(obj, Mapping):
        return type(obj)({k: _move(v, device, non_blocking) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_move(v, device, non_blocking) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_move(v, device, non_blocking) for v in obj)
    return obj
