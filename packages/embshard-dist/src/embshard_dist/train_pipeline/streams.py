"""The side streams of a train pipeline and how work passes from one stream to another.

On CUDA the batch copy and the input dist run on streams of their own; a stream that uses what
another produced first waits for it, and every tensor it reads is recorded on it, so the caching
allocator never hands that memory out early. Elsewhere (the CPU) there are no side streams and
every helper here does nothing, so the pipeline runs one code path on every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SideStreams", "hand_over", "on_stream", "record_stream"]


@dataclass(frozen=True)
class SideStreams:
    """The copy stream and the input-dist stream of a pipeline (both ``None`` off CUDA)."""

    copy: torch.cuda.Stream | None
    dist: torch.cuda.Stream | None

    @classmethod
    def for_device(cls, device: torch.device) -> SideStreams:
        """High-priority side streams on a CUDA ``device``; none elsewhere."""
        if device.type != "cuda":
            return cls(None, None)
        return cls(
            torch.cuda.Stream(device=device, priority=-1),
            torch.cuda.Stream(device=device, priority=-1),
        )


def on_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
    """Run the block on ``stream`` (``None``: where it runs anyway)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def hand_over(
    obj: Any, producer: torch.cuda.Stream | None, consumer: torch.cuda.Stream | None = None
) -> None:
    """Let ``consumer`` (default: the current stream) use ``obj``, produced on ``producer``.

    ``consumer`` waits for the work queued on ``producer`` so far, and ``obj``'s tensors are
    recorded on ``consumer``. Nothing happens when ``producer`` is ``None``.
    """
    if producer is None:
        return
    target = consumer if consumer is not None else torch.cuda.current_stream(producer.device)
    target.wait_stream(producer)
    record_stream(obj, target)


def record_stream(obj: Any, stream: torch.Stream) -> None:
    """Record every tensor reachable in ``obj`` as used on ``stream``.

    Reaches tensors, objects with a ``record_stream`` method (KJTs, contexts), dataclasses,
    mappings, lists and tuples; anything else holds no tensor to record.
    """
    if isinstance(obj, torch.Tensor) or callable(getattr(obj, "record_stream", None)):
        obj.record_stream(stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            record_stream(getattr(obj, field.name), stream)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            record_stream(value, stream)
    elif isinstance(obj, list | tuple):
        for value in obj:
            record_stream(value, stream)
