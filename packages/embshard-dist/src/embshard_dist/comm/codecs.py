"""Quantized communication codecs in plain torch: FP16, BF16 and INT8 row-wise.

Each implements ``QuantizedCommCodec`` and is applied to every per-peer chunk on its own, so a
chunk's wire size depends only on its element count. INT8 sends FBGEMM's fused row-wise bytes
(see :class:`Int8RowwiseCommCodec`), also for a last, shorter row. Decoders return float32
(the collectives cast back); inputs must be finite. ``wire_bytes`` sizes what a collective sends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from embshard_dist.comm._codec import ChunkCodec
from embshard_types.comm_codec import QuantizedCommCodec

__all__ = [
    "DEFAULT_ROW_DIM",
    "FP16_MAX",
    "CastCommCodec",
    "Int8RowwiseCommCodec",
    "check_row_dim",
    "dequantize_rows",
    "int8_rowwise_size",
    "quantize_rows",
    "split_int8_wire",
    "wire_bytes",
]

DEFAULT_ROW_DIM = 32
"""Elements per INT8 quantization row unless told otherwise (FBGEMM's default)."""

FP16_MAX = 65504.0
"""The largest finite float16."""

SCALE_BIAS_BYTES = 8
"""float32 scale + float32 bias at the end of every INT8 row."""

_EPSILON = 1e-8


def check_row_dim(row_dim: int, where: str = "Int8RowwiseCommCodec") -> int:
    """``row_dim`` if it is a positive multiple of 4 (FBGEMM's GPU rows, padded to 4 bytes, and
    its CPU rows are then the same size), else ``ValueError`` naming ``where``."""
    if isinstance(row_dim, bool) or not isinstance(row_dim, int) or row_dim <= 0 or row_dim % 4:
        raise ValueError(
            f"{where}: row_dim must be a positive multiple of 4 (elements sharing one scale and "
            f"bias), got {row_dim!r}; use {DEFAULT_ROW_DIM} (FBGEMM's default) or the embedding dim"
        )
    return row_dim


def int8_rowwise_size(numel: int, row_dim: int) -> int:
    """Wire bytes of ``numel`` elements in the INT8 row-wise format."""
    full, tail = divmod(numel, row_dim)
    return full * (row_dim + SCALE_BIAS_BYTES) + (tail + SCALE_BIAS_BYTES if tail else 0)


def split_int8_wire(wire: Tensor, row_dim: int) -> tuple[Tensor, Tensor | None]:
    """The ``[rows, row_dim + 8]`` full rows of a flat INT8 wire and its ``[1, t + 8]`` tail row.

    Raises:
        ValueError: the length fits no element count (a truncated or foreign buffer).
    """
    width = row_dim + SCALE_BIAS_BYTES
    full, rest = divmod(wire.numel(), width)
    if 0 < rest <= SCALE_BIAS_BYTES:
        raise ValueError(
            f"INT8 row-wise wire of {wire.numel()} bytes does not hold rows of {row_dim} "
            f"elements: {rest} trailing bytes are too few for a row (encoder and decoder must "
            "use the same row_dim)"
        )
    flat = wire.reshape(-1)
    rows = flat[: full * width].reshape(full, width)
    tail = flat[full * width :].reshape(1, rest) if rest else None
    return rows, tail


def _unpadded(input_tensor: Tensor) -> tuple[int, int]:
    if input_tensor.dim() not in (1, 2):
        raise ValueError(
            f"padded_size expects a 1-D or 2-D tensor, got shape {tuple(input_tensor.shape)}"
        )
    return int(input_tensor.shape[-1]), 0


@dataclass(frozen=True)
class CastCommCodec:
    """Sends float payloads as float16 (clamped to its finite range) or bfloat16.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        loss_scale: multiply by this before the cast and divide after decoding (``None``: 1;
            keeps small gradients out of FP16's subnormal range).

    Raises:
        ValueError: another dtype, or a loss scale that is not a positive finite number.
    """

    dtype: torch.dtype = torch.float16
    loss_scale: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"CastCommCodec sends float16 or bfloat16, got {self.dtype}; use "
                "Int8RowwiseCommCodec for int8 or no codec for float32"
            )
        scale = self.loss_scale
        if scale is not None and not (isinstance(scale, int | float) and 0 < scale < float("inf")):
            raise ValueError(
                f"CastCommCodec: loss_scale must be positive and finite, got {scale!r}"
            )

    def encode(self, input_tensor: Tensor, ctx: Any = None) -> Tensor:
        x = input_tensor.reshape(-1)
        if self.loss_scale is not None:
            x = x * self.loss_scale
        if self.dtype == torch.float16:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return x.to(self.dtype)

    def decode(self, input_grad: Tensor, ctx: Any = None) -> Tensor:
        out = input_grad.reshape(-1).to(torch.float32)
        if self.loss_scale is not None:
            out = out / self.loss_scale
        return out

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self.dtype

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        return _unpadded(input_tensor)


def quantize_rows(rows: Tensor) -> Tensor:
    """``[n, w]`` floats -> ``[n, w + 8]`` uint8: codes, then float32 scale and bias per row."""
    rows = rows.to(torch.float32)
    low = rows.amin(dim=1, keepdim=True)
    span = rows.amax(dim=1, keepdim=True) - low
    scale = span / 255.0
    inverse = 255.0 / (span + _EPSILON)
    codes = torch.round((rows - low) * inverse).clamp_(0, 255).to(torch.uint8)
    scale_bias = torch.cat([scale, low], dim=1).contiguous().view(torch.uint8)
    return torch.cat([codes, scale_bias], dim=1)


def dequantize_rows(rows: Tensor) -> Tensor:
    """``[n, w + 8]`` uint8 rows from ``quantize_rows`` -> ``[n, w]`` float32."""
    width = rows.shape[1] - SCALE_BIAS_BYTES
    scale_bias = rows[:, width:].reshape(-1).clone().view(torch.float32).reshape(-1, 2).double()
    codes = rows[:, :width].to(torch.float64)
    # float64 makes codes * scale exact, so the sum is rounded once, as FBGEMM's fused multiply-add
    return (codes * scale_bias[:, :1] + scale_bias[:, 1:]).to(torch.float32)


@dataclass(frozen=True)
class Int8RowwiseCommCodec:
    """INT8 row-wise codec in plain torch, byte for byte FBGEMM's fused 8-bit row-wise format.

    The flattened chunk is cut into rows of ``row_dim`` elements (independent of the embedding
    width); each travels as ``row_dim`` uint8 codes, then its float32 scale and bias. A last row
    of ``t < row_dim`` elements travels as ``t + 8`` bytes, so the decoder recovers the count.
    Codes round half to even as FBGEMM's: a decoded value is within half a step of its input.

    Args:
        row_dim: elements per quantization row (a positive multiple of 4; FBGEMM's default 32).
            It belongs to the codec, so sender and receiver always agree.

    Raises:
        ValueError: ``row_dim`` is not a positive multiple of 4.
    """

    row_dim: int = DEFAULT_ROW_DIM

    def __post_init__(self) -> None:
        check_row_dim(self.row_dim)

    def encode(self, input_tensor: Tensor, ctx: Any = None) -> Tensor:
        row_dim = self.row_dim
        flat = input_tensor.reshape(-1)
        full = flat.numel() // row_dim * row_dim
        parts = [quantize_rows(flat[:full].reshape(-1, row_dim)).reshape(-1)]
        if full < flat.numel():
            parts.append(quantize_rows(flat[full:].reshape(1, -1)).reshape(-1))
        return torch.cat(parts)

    def decode(self, input_grad: Tensor, ctx: Any = None) -> Tensor:
        rows, tail = split_int8_wire(input_grad, self.row_dim)
        parts = [dequantize_rows(rows).reshape(-1)]
        if tail is not None:
            parts.append(dequantize_rows(tail).reshape(-1))
        return torch.cat(parts)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        return int8_rowwise_size(input_len, self.row_dim)

    def create_context(self) -> None:
        return None

    def padded_size(
        self,
        input_tensor: Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: Any,
    ) -> tuple[int, int]:
        return _unpadded(input_tensor)


def wire_bytes(codec: QuantizedCommCodec[Any] | None, chunk_numels: Iterable[int]) -> int:
    """Bytes a collective sends for chunks of ``chunk_numels`` elements, each coded on its own
    with ``codec`` (``None`` or the no-op codec: float32); empty chunks take no room."""
    coder = ChunkCodec(codec, torch.float32)
    item = torch.empty(0, dtype=coder.wire_dtype).element_size()
    return sum(coder.wire_size(int(n)) for n in chunk_numels) * item
