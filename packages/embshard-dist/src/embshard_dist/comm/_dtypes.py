"""A stable integer code per dtype, so that ranks can compare dtypes inside an int64 message."""

from __future__ import annotations

import zlib

import torch

_KNOWN = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

NO_DTYPE = -1
"""The code of an absent tensor."""


def dtype_code(dtype: torch.dtype | None) -> int:
    """A non-negative code, equal on every rank for the same dtype (``-1`` for ``None``)."""
    if dtype is None:
        return NO_DTYPE
    if dtype in _KNOWN:
        return _KNOWN.index(dtype)
    return 1000 + zlib.crc32(str(dtype).encode())


def dtype_name(code: int) -> str:
    """The dtype a code stands for, for error messages."""
    if code == NO_DTYPE:
        return "none"
    if 0 <= code < len(_KNOWN):
        return str(_KNOWN[code])
    return f"dtype#{code}"
