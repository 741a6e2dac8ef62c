"""Quantized communication codecs: how a collective's payload is compressed on the wire.

A codec encodes a tensor before a collective and decodes what arrives; ``QuantizedCommCodecs``
pairs the forward and backward codecs (no-op by default) and rejects non-codecs with a
``TypeError``. ``NoOpQuantizedCommCodec`` returns its input unchanged (the same object).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

__all__ = [
    "NoOpQuantizedCommCodec",
    "QCommCodecsRegistry",
    "QuantizationContext",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
]

QuantizationContext = TypeVar("QuantizationContext")


@runtime_checkable
class QuantizedCommCodec(Protocol[QuantizationContext]):
    """Encodes tensors for a collective and decodes the received ones.

    ``decode(collective(encode(x)))`` ≈ ``collective(x)``; a context from ``create_context``
    carries per-call parameters (scales, padding) from ``encode`` to ``decode``.
    """

    def encode(
        self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Compress ``input_tensor`` for sending."""
        ...

    def decode(
        self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Decompress a received tensor (``ctx`` as passed to the matching ``encode``)."""
        ...

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The dtype of ``encode``'s output."""
        ...

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        """Length of the encoded tensor for an input of ``input_len`` elements."""
        ...

    def create_context(self) -> QuantizationContext | None:
        """A fresh context for one encode/decode pair, or ``None`` if the codec needs none."""
        ...

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: QuantizationContext,
    ) -> tuple[int, int]:
        """``(padded_dim_sum, padding_size)`` of ``input_tensor`` (1-D or ``[batch, dim_sum]``).

        Args:
            dim_per_rank: the embedding width each rank sends.
        """
        ...


class NoOpQuantizedCommCodec(Generic[QuantizationContext]):
    """The identity codec: sends tensors as they are and reports ``dtype`` as quantized."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self._dtype = dtype

    def encode(
        self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        return input_tensor

    def decode(
        self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        return input_grad

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        return input_len

    def create_context(self) -> QuantizationContext | None:
        return None

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: list[int],
        my_rank: int,
        qcomm_ctx: QuantizationContext,
    ) -> tuple[int, int]:
        if input_tensor.dim() not in (1, 2):
            raise ValueError(
                f"padded_size expects a 1-D or 2-D tensor, got shape {tuple(input_tensor.shape)}"
            )
        dim_sum = input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]
        return int(dim_sum), 0

    def __repr__(self) -> str:
        return f"NoOpQuantizedCommCodec(dtype={self._dtype})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoOpQuantizedCommCodec) and other._dtype == self._dtype

    def __hash__(self) -> int:
        return hash((NoOpQuantizedCommCodec, self._dtype))


def _check_codec(codec: Any, which: str) -> None:
    if not isinstance(codec, QuantizedCommCodec):
        raise TypeError(
            f"QuantizedCommCodecs.{which} must implement QuantizedCommCodec (encode, decode, "
            f"quantized_dtype, calc_quantized_size, create_context, padded_size); got {codec!r}"
        )


@dataclass(frozen=True)
class QuantizedCommCodecs:
    """The codecs of one collective: ``forward`` for its payload, ``backward`` for gradients."""

    forward: QuantizedCommCodec[Any] = field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec[Any] = field(default_factory=NoOpQuantizedCommCodec)

    def __post_init__(self) -> None:
        _check_codec(self.forward, "forward")
        _check_codec(self.backward, "backward")


QCommCodecsRegistry = dict[str, QuantizedCommCodecs]
"""Codecs per collective, keyed by a ``CommOp`` value (e.g. ``"pooled_embeddings_all_to_all"``)."""
