"""INT8 row-wise quantized communication codec on FBGEMM's quantize ops.

``FbgemmInt8RowwiseCommCodec`` writes byte for byte the wire format of embshard-dist's
``Int8RowwiseCommCodec``: rows of ``row_dim`` uint8 codes then float32 scale and bias, a shorter
last row for any element count. ``fbgemm_int8_rowwise_supported(device)`` says where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from embshard_kernels import _fbgemm  # noqa: F401  (loads FBGEMM's ops, or explains why not)

__all__ = ["FbgemmInt8RowwiseCommCodec", "fbgemm_int8_rowwise_supported"]

_SCALE_BIAS_BYTES = 8


def _quantize(rows: Tensor) -> Tensor:
    return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows)


def _dequantize(rows: Tensor) -> Tensor:
    return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(rows)


@lru_cache(maxsize=8)
def _supported(device_type: str) -> bool:
    try:
        probe = torch.zeros(1, 4, device=device_type)
        _dequantize(_quantize(probe))
    except (RuntimeError, NotImplementedError, AttributeError, AssertionError):
        return False  # no such device here, or no kernel for it in this FBGEMM build
    return True


def fbgemm_int8_rowwise_supported(device: torch.device | str | None = None) -> bool:
    """Whether FBGEMM's fused 8-bit row-wise quantize ops run on ``device`` (default: CPU)."""
    return _supported(torch.device(device if device is not None else "cpu").type)


@dataclass(frozen=True)
class FbgemmInt8RowwiseCommCodec:
    """INT8 row-wise codec on FBGEMM's ops (the format is in the module docstring).

    Args:
        row_dim: elements sharing one scale and bias, a positive multiple of 4 (FBGEMM's
            default 32). It belongs to the codec, so sender and receiver always agree
            (``create_context`` returns ``None``).

    Raises:
        ValueError: ``row_dim`` is not a positive multiple of 4.
    """

    row_dim: int = 32

    def __post_init__(self) -> None:
        r = self.row_dim
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0 or r % 4:
            raise ValueError(
                "FbgemmInt8RowwiseCommCodec: row_dim must be a positive multiple of 4 (elements "
                f"sharing one scale and bias), got {r!r}; use 32 (FBGEMM's default)"
            )

    def encode(self, input_tensor: Tensor, ctx: Any = None) -> Tensor:
        flat = input_tensor.reshape(-1).to(torch.float32)
        full = flat.numel() // self.row_dim * self.row_dim
        parts = [_quantize(flat[:full].reshape(-1, self.row_dim)).reshape(-1)]
        tail = flat.numel() - full
        if tail:
            row = _quantize(flat[full:].reshape(1, tail))  # GPU pads the codes to 4 bytes
            parts += [row[0, :tail], row[0, -_SCALE_BIAS_BYTES:]]
        return torch.cat(parts)

    def decode(self, input_grad: Tensor, ctx: Any = None) -> Tensor:
        wire = input_grad.reshape(-1)
        width = self.row_dim + _SCALE_BIAS_BYTES
        full, rest = divmod(wire.numel(), width)
        if 0 < rest <= _SCALE_BIAS_BYTES:
            raise ValueError(
                f"INT8 row-wise wire of {wire.numel()} bytes does not hold rows of "
                f"{self.row_dim} elements: {rest} trailing bytes are too few for a row "
                "(encoder and decoder must use the same row_dim)"
            )
        parts = [_dequantize(wire[: full * width].reshape(full, width)).reshape(-1)]
        if rest:
            tail = rest - _SCALE_BIAS_BYTES
            pad = -tail % 4
            codes, scale_bias = wire[full * width : full * width + tail], wire[-_SCALE_BIAS_BYTES:]
            row = torch.cat([codes, codes.new_zeros(pad), scale_bias]).reshape(1, -1)
            parts.append(_dequantize(row)[0, :tail])
        return torch.cat(parts)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def calc_quantized_size(self, input_len: int, ctx: Any = None) -> int:
        full, tail = divmod(input_len, self.row_dim)
        width = self.row_dim + _SCALE_BIAS_BYTES
        return full * width + (tail + _SCALE_BIAS_BYTES if tail else 0)

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any
    ) -> tuple[int, int]:
        if input_tensor.dim() not in (1, 2):
            raise ValueError(
                f"padded_size expects a 1-D or 2-D tensor, got shape {tuple(input_tensor.shape)}"
            )
        return int(input_tensor.shape[-1]), 0
