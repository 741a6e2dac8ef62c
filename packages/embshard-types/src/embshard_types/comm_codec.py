"""Quantized communication codecs: how a collective's payload is compressed on the wire.

A codec encodes a float tensor before a collective (all-to-all, reduce-scatter) and decodes what
arrives. ``QuantizedCommCodecs`` pairs the codec of the forward pass with the one of the backward
pass; a registry maps a ``CommOp`` value to such a pair.

Guarantees: ``NoOpQuantizedCommCodec`` returns its input unchanged (the same tensor object) and
reports sizes unchanged; ``QuantizedCommCodecs`` defaults to no-op codecs both ways and rejects,
with a ``TypeError``, anything that does not look like a codec.
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

    The expected round trip is ``decode(collective(encode(x)))`` ≈ ``collective(x)``;
    ``encode(x).dtype == quantized_dtype``. A context (from ``create_context``) carries
    per-call parameters (scales, padding) from ``encode`` to ``decode``.
    """

    def encode(
        self, input_tensor: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Compress ``input_tensor`` for sending.

        Args:
            input_tensor: the float payload.
            ctx: the context of this call, from ``create_context``.
        """
        ...

    def decode(
        self, input_grad: torch.Tensor, ctx: QuantizationContext | None = None
    ) -> torch.Tensor:
        """Decompress a received tensor.

        Args:
            input_grad: the received, encoded tensor.
            ctx: the context passed to the matching ``encode``.
        """
        ...

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The dtype of ``encode``'s output."""
        ...

    def calc_quantized_size(self, input_len: int, ctx: QuantizationContext | None = None) -> int:
        """Length of the encoded tensor for an input of ``input_len`` elements.

        Args:
            input_len: number of elements of the input.
            ctx: the context of this call.
        """
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
        """``(padded_dim_sum, padding_size)`` of ``input_tensor`` before encoding.

        Args:
            input_tensor: a 1-D tensor, or a 2-D ``[batch, dim_sum]`` one.
            dim_per_rank: the embedding width each rank sends.
            my_rank: this rank.
            qcomm_ctx: the context of this call.
        """
        ...


class NoOpQuantizedCommCodec(Generic[QuantizationContext]):
    """The identity codec: sends tensors as they are.

    Args:
        dtype: the dtype it reports as ``quantized_dtype`` (the payload's own dtype).
    """

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
    """The codecs of one collective: ``forward`` for the forward pass, ``backward`` for gradients.

    Args:
        forward: the codec applied to the forward payload (default: no-op).
        backward: the codec applied to the gradients in the backward pass (default: no-op).
    """

    forward: QuantizedCommCodec[Any] = field(default_factory=NoOpQuantizedCommCodec)
    backward: QuantizedCommCodec[Any] = field(default_factory=NoOpQuantizedCommCodec)

    def __post_init__(self) -> None:
        _check_codec(self.forward, "forward")
        _check_codec(self.backward, "backward")


QCommCodecsRegistry = dict[str, QuantizedCommCodecs]
"""Codecs per collective, keyed by a ``CommOp`` value (e.g. ``"pooled_embeddings_all_to_all"``)."""
