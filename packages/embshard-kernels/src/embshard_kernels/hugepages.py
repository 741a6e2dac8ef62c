"""Large embedding buffers on transparent huge pages, where the OS offers them on request.

:func:`zeros` / :func:`empty` allocate a CPU tensor and ask for huge pages
(``madvise(MADV_HUGEPAGE)``) before its first touch: on Linux, for buffers of at least
:data:`MIN_BYTES`, unless ``EMBSHARD_HUGEPAGES=0``. The advice changes speed, never values; its
failures are ignored.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "empty", "zeros"]

MIN_BYTES = 32 * 2**20
"""Smaller buffers are allocated as they are (few TLB misses to save)."""

_MADV_HUGEPAGE = 14
_HUGE = 2 * 2**20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` when huge pages can be asked for here, else ``None``."""
    if not sys.platform.startswith("linux") or os.environ.get("EMBSHARD_HUGEPAGES") == "0":
        return None
    try:
        with open(_THP_MODE) as f:
            mode = f.read()
        if "[never]" in mode:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        advise = libc.madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def _advise_huge(t: Tensor) -> None:
    """Ask for huge pages over the 2 MiB-aligned part of ``t``'s memory (best effort)."""
    advise = _madvise()
    if advise is None:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // _HUGE) * _HUGE
    last = end // _HUGE * _HUGE
    if last > first:
        advise(first, last - first, _MADV_HUGEPAGE)


def empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
) -> Tensor:
    """An uninitialised tensor; on the CPU, a large one on huge pages where possible (its pages
    then fault in 2 MiB at a time: a fresh output of tens of MB costs a few faults, not
    thousands)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.device.type == "cpu" and out.numel() * dtype.itemsize >= MIN_BYTES:
        _advise_huge(out)
    return out


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """A flat zero-filled tensor; on the CPU, a large one on huge pages where possible."""
    return empty((numel,), dtype, device).zero_()
