"""Small quantized communication codecs for the collective tests.

``Fp16Codec`` sends float32 as float16 (same element count). ``ScaledFp16Codec`` prepends the
chunk's largest magnitude and sends the chunk divided by it, so its wire size differs from the
payload's (``n + 1``): it checks that collectives size their buffers with
``calc_quantized_size``. ``roundtrip(codec, x)`` is what a receiver sees of a chunk ``x``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from embshard_types.comm_codec import QuantizedCommCodec


class Fp16Codec:
    def encode(self, input_tensor: Tensor, ctx: None = None) -> Tensor:
        return input_tensor.to(torch.float16).reshape(-1)

    def decode(self, input_grad: Tensor, ctx: None = None) -> Tensor:
        return input_grad.to(torch.float32)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float16

    def calc_quantized_size(self, input_len: int, ctx: None = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: None
    ) -> tuple[int, int]:
        return int(input_tensor.shape[-1]), 0


class ScaledFp16Codec(Fp16Codec):
    def encode(self, input_tensor: Tensor, ctx: None = None) -> Tensor:
        flat = input_tensor.reshape(-1).to(torch.float32)
        scale = flat.abs().max().clamp_min(1e-30)
        return torch.cat([scale.reshape(1), flat / scale]).to(torch.float16)

    def decode(self, input_grad: Tensor, ctx: None = None) -> Tensor:
        return input_grad[1:].to(torch.float32) * input_grad[0].to(torch.float32)

    def calc_quantized_size(self, input_len: int, ctx: None = None) -> int:
        return input_len + 1


def roundtrip(codec: QuantizedCommCodec[Any] | None, x: Tensor) -> Tensor:
    """What a peer receives of chunk ``x`` sent through ``codec``."""
    if codec is None or x.numel() == 0:
        return x.clone()
    return codec.decode(codec.encode(x)).reshape(x.shape)
