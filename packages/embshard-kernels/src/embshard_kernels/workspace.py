"""Buffers reused from one step to the next by the kernels and collectives that fill large
tensors every step.

A fresh tensor above glibc's largest mmap threshold (32 MiB) is mapped anew on every
allocation, and each of its 4 KiB pages faults on first touch: on the machines embshard is
measured on that costs about as much as writing the tensor three times. A :class:`Workspace`
keeps one flat buffer per name and hands out views of it, growing by a quarter when a request
outgrows it.

Guarantee: a view stays valid until the next :meth:`Workspace.take` of the same name; callers
hand results that live in a workspace only to code that consumes them before the next step.
A :class:`BufferPool` lends flat buffers to one call at a time (calls that overlap get
different buffers) and takes them back when the call is done with them.
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
        """An uninitialised ``shape`` tensor viewing buffer ``name``.

        Args:
            name: the buffer.
            shape: the view's shape.
            dtype: its dtype (a buffer of another dtype or device is replaced).
            device: its device.
        """
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
