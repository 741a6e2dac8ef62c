"""Quantized comm codecs: the protocol, the no-op codec, and the forward/backward pair."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from embshard_types.comm_codec import (
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
)
from embshard_types.vocab import CommOp


@dataclass
class _Ctx:
    scale: float = 1.0


class HalfCodec:
    """A real (lossy) codec: sends fp16, with a context carrying a scale."""

    def encode(self, input_tensor: torch.Tensor, ctx: _Ctx | None = None) -> torch.Tensor:
        scale = ctx.scale if ctx else 1.0
        return (input_tensor * scale).to(torch.float16)

    def decode(self, input_grad: torch.Tensor, ctx: _Ctx | None = None) -> torch.Tensor:
        scale = ctx.scale if ctx else 1.0
        return input_grad.to(torch.float32) / scale

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float16

    def calc_quantized_size(self, input_len: int, ctx: _Ctx | None = None) -> int:
        return input_len

    def create_context(self) -> _Ctx | None:
        return _Ctx(scale=4.0)

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: _Ctx
    ) -> tuple[int, int]:
        return sum(dim_per_rank), 0


def test_noop_codec_is_the_identity() -> None:
    codec: NoOpQuantizedCommCodec[None] = NoOpQuantizedCommCodec()
    x = torch.randn(3, 4)
    ctx = codec.create_context()
    assert ctx is None
    assert codec.encode(x, ctx) is x
    assert codec.decode(x, ctx) is x
    assert codec.quantized_dtype == torch.float32
    assert codec.calc_quantized_size(12) == 12


def test_noop_codec_reports_the_configured_dtype() -> None:
    assert NoOpQuantizedCommCodec(torch.bfloat16).quantized_dtype == torch.bfloat16


def test_noop_padded_size() -> None:
    codec: NoOpQuantizedCommCodec[None] = NoOpQuantizedCommCodec()
    assert codec.padded_size(torch.zeros(7), [3, 4], 0, None) == (7, 0)
    assert codec.padded_size(torch.zeros(2, 9), [4, 5], 1, None) == (9, 0)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        codec.padded_size(torch.zeros(1, 2, 3), [6], 0, None)


def test_protocol_recognises_codecs() -> None:
    assert isinstance(NoOpQuantizedCommCodec(), QuantizedCommCodec)
    assert isinstance(HalfCodec(), QuantizedCommCodec)
    assert not isinstance(object(), QuantizedCommCodec)


def test_codec_round_trip_through_a_context() -> None:
    codec = HalfCodec()
    ctx = codec.create_context()
    x = torch.tensor([0.5, -1.25, 3.0])
    encoded = codec.encode(x, ctx)
    assert encoded.dtype == codec.quantized_dtype
    torch.testing.assert_close(codec.decode(encoded, ctx), x)


def test_codecs_default_to_noop_both_ways() -> None:
    codecs = QuantizedCommCodecs()
    assert isinstance(codecs.forward, NoOpQuantizedCommCodec)
    assert isinstance(codecs.backward, NoOpQuantizedCommCodec)
    assert codecs == QuantizedCommCodecs()


def test_codecs_hold_custom_codecs_in_a_registry() -> None:
    half = HalfCodec()
    registry = {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value: QuantizedCommCodecs(forward=half)}
    pair = registry["pooled_embeddings_all_to_all"]
    assert pair.forward is half
    assert isinstance(pair.backward, NoOpQuantizedCommCodec)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_codecs_reject_non_codecs(which: str) -> None:
    with pytest.raises(TypeError, match=f"QuantizedCommCodecs.{which}"):
        QuantizedCommCodecs(**{which: "fp16"})  # type: ignore[arg-type]
