"""Applying a quantized communication codec to the chunks of one collective.

Each non-empty chunk (one per peer) is encoded on its own, so its wire size depends only on its
element count and both sides agree on it without exchanging sizes. Empty chunks are never
encoded and take no room on the wire.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embshard_types.comm_codec import NoOpQuantizedCommCodec, QuantizedCommCodec


def is_active(codec: QuantizedCommCodec[Any] | None) -> bool:
    """Whether ``codec`` changes the payload (``None`` and the no-op codec do not)."""
    return codec is not None and not isinstance(codec, NoOpQuantizedCommCodec)


class ChunkCodec:
    """Encodes and decodes the chunks of one direction of one collective with ``codec``
    (``None``: as they are); ``dtype`` is the decoded payload's."""

    def __init__(self, codec: QuantizedCommCodec[Any] | None, dtype: torch.dtype) -> None:
        self._codec = codec if is_active(codec) else None
        self._ctx = self._codec.create_context() if self._codec is not None else None
        self.payload_dtype = dtype

    @property
    def passthrough(self) -> bool:
        """Whether chunks travel as they are (no codec)."""
        return self._codec is None

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of what travels."""
        return self._codec.quantized_dtype if self._codec is not None else self.payload_dtype

    def wire_size(self, numel: int) -> int:
        """Number of wire elements for a chunk of ``numel`` payload elements."""
        if self._codec is None or numel == 0:
            return numel
        return int(self._codec.calc_quantized_size(numel, self._ctx))

    def encode(self, chunk: Tensor) -> Tensor:
        """The 1-D wire form of ``chunk``."""
        if self._codec is None or chunk.numel() == 0:
            return chunk.reshape(-1).to(self.wire_dtype)
        encoded = self._codec.encode(chunk.contiguous(), self._ctx).reshape(-1)
        expected = self.wire_size(chunk.numel())
        if encoded.numel() != expected or encoded.dtype != self.wire_dtype:
            raise ValueError(
                f"codec {self._codec!r} encoded {chunk.numel()} elements into "
                f"{encoded.numel()} x {encoded.dtype}, but its calc_quantized_size / "
                f"quantized_dtype promise {expected} x {self.wire_dtype}; fix the codec"
            )
        return encoded

    def decode(self, wire: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The payload chunk of ``shape`` carried by ``wire``."""
        numel = 1
        for s in shape:
            numel *= s
        if self._codec is None or numel == 0:
            return wire.reshape(shape).to(self.payload_dtype)
        decoded = self._codec.decode(wire, self._ctx)
        if decoded.numel() != numel:
            raise ValueError(
                f"codec {self._codec!r} decoded {wire.numel()} wire elements into "
                f"{decoded.numel()} elements, expected {numel} (shape {shape}); fix the codec"
            )
        return decoded.reshape(shape).to(self.payload_dtype)
