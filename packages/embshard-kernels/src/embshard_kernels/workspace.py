"""Buffers reused from one step to the next by code that fills large tensors every step.

A :class:`Workspace` keeps one flat buffer per name and hands out views of it (valid until the
next ``take`` of that name), sparing the page faults of a fresh large allocation. A
:class:`BufferPool` lends buffers to one call at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


class Workspace:
    """Named reusable buffers (see the module docstring)."""

    def __init__(self) -> None:
        self._flat: dict[str, Tensor] = {}

    def take(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """An uninitialised ``shape`` tensor viewing buffer ``name`` (a buffer of another dtype
        or device is replaced)."""
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
            flat = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self._flat[name] = flat
        return flat[:numel].view(*shape)


class BufferPool:
    """Flat buffers lent out and given back (see the module docstring)."""

    def __init__(self) -> None:
        self._free: list[Tensor] = []

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer of at least ``numel`` elements, the caller's until :meth:`give_back`."""
        for i, flat in enumerate(self._free):
            if flat.numel() >= numel and flat.dtype == dtype and flat.device == device:
                return self._free.pop(i)
        return torch.empty(numel + numel // 4, dtype=dtype, device=device)

    def give_back(self, flat: Tensor) -> None:
        """Return a buffer from :meth:`lend` (keeps the two largest free buffers)."""
        self._free.append(flat)
        if len(self._free) > 2:
            self._free.sort(key=lambda t: t.numel(), reverse=True)
            del self._free[2:]
