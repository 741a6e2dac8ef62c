"""Quantized comms codecs: round-trip error bounds, wire sizes, and the codec builder's choices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_dist.comm.codecs import (
    FP16_MAX,
    CastCommCodec,
    Int8RowwiseCommCodec,
    wire_bytes,
)
from embshard_dist.comm.qcomms import (
    CommsPrecision,
    QCommsConfig,
    get_qcomm_codecs,
    get_qcomm_codecs_registry,
)
from embshard_kernels.comm_codecs import FbgemmInt8RowwiseCommCodec, fbgemm_int8_rowwise_supported
from embshard_types.comm_codec import NoOpQuantizedCommCodec, QuantizedCommCodec
from embshard_types.vocab import CommOp

A2A = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value
RS = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value


def _data(numel: int, magnitude: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * magnitude + torch.rand(1, generator=g) * magnitude


def _roundtrip(codec: QuantizedCommCodec[object], x: torch.Tensor) -> torch.Tensor:
    ctx = codec.create_context()
    wire = codec.encode(x, ctx)
    assert wire.dtype == codec.quantized_dtype
    assert wire.numel() == codec.calc_quantized_size(x.numel(), ctx)
    out = codec.decode(wire, ctx)
    assert out.dtype == torch.float32 and out.numel() == x.numel()
    return out.reshape(x.shape)


# ---- FP16 / BF16 ---------------------------------------------------------------------------

_CASE = given(
    numel=st.integers(1, 300),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=50, deadline=None)
@_CASE
def test_fp16_relative_error(numel: int, magnitude: float, seed: int) -> None:
    x = _data(numel, magnitude, seed)
    err = (_roundtrip(CastCommCodec(torch.float16), x) - x).abs()
    assert torch.all(err <= 2.0**-11 * x.abs() + 2.0**-25)  # half an ulp; subnormals: 2^-25
    # relative to the largest value, except where every value lies in fp16's subnormal range
    assert torch.all(err <= 1e-3 * x.abs().max() + 2.0**-25)


@settings(max_examples=50, deadline=None)
@_CASE
def test_bf16_relative_error(numel: int, magnitude: float, seed: int) -> None:
    x = _data(numel, magnitude, seed)
    err = (_roundtrip(CastCommCodec(torch.bfloat16), x) - x).abs()
    assert torch.all(err <= 2.0**-8 * x.abs())
    assert torch.all(err <= 1e-2 * x.abs().max())


def test_fp16_clamps_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 3.0])
    out = _roundtrip(CastCommCodec(torch.float16), x)
    assert out.tolist() == [FP16_MAX, -FP16_MAX, 3.0]


def test_loss_scale_keeps_tiny_gradients_precise() -> None:
    x = _data(200, 1e-6, seed=3)  # fp16 subnormals: ~1e-2 relative error without scaling
    plain = (_roundtrip(CastCommCodec(torch.float16), x) - x).abs().max()
    scaled = (_roundtrip(CastCommCodec(torch.float16, loss_scale=2.0**12), x) - x).abs().max()
    assert scaled <= 2.0**-11 * x.abs().max()
    assert scaled * 10 < plain


def test_cast_codec_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        CastCommCodec(torch.int8)
    with pytest.raises(ValueError, match="loss_scale"):
        CastCommCodec(torch.float16, loss_scale=0.0)


# ---- INT8 row-wise -------------------------------------------------------------------------


def _int8_bound(x: torch.Tensor, row_dim: int) -> torch.Tensor:
    """Half a quantization step of each element's row, FBGEMM's 1e-8 epsilon, float rounding."""
    bound = torch.empty_like(x)
    for start in range(0, x.numel(), row_dim):
        row = x[start : start + row_dim]
        step = (row.max() - row.min()) / 255
        bound[start : start + row_dim] = step / 2 + 1e-8 + 1e-6 * row.abs().max()
    return bound


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 300),
    row_dim=st.sampled_from([4, 8, 32, 64]),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_int8_rowwise_within_half_a_step_per_row(
    numel: int, row_dim: int, magnitude: float, seed: int
) -> None:
    x = _data(numel, magnitude, seed)
    codec = Int8RowwiseCommCodec(row_dim)
    out = _roundtrip(codec, x)
    assert torch.all((out - x).abs() <= _int8_bound(x, row_dim))
    full, tail = divmod(numel, row_dim)
    assert codec.calc_quantized_size(numel) == full * (row_dim + 8) + (tail + 8 if tail else 0)
    if fbgemm_int8_rowwise_supported("cpu"):  # FBGEMM's codec speaks the same wire format
        fbgemm = FbgemmInt8RowwiseCommCodec(row_dim)
        ours, theirs = codec.encode(x), fbgemm.encode(x)
        assert ours.shape == theirs.shape
        # Either side decodes the other's bytes; codes may differ by one step on a rounding tie.
        assert torch.equal(fbgemm.decode(ours), out.reshape(-1))
        cross = codec.decode(theirs).reshape(-1)
        assert torch.all((cross - x.reshape(-1)).abs() <= 2 * _int8_bound(x, row_dim).reshape(-1))


def test_int8_rowwise_2d_chunks_and_constant_rows() -> None:
    x = torch.cat([torch.full((2, 16), 0.37), torch.randn(3, 16)])
    codec = Int8RowwiseCommCodec(16)
    out = _roundtrip(codec, x)
    assert torch.equal(out[:2], x[:2])  # a constant row has no step: exact
    assert torch.all((out - x).abs().reshape(-1) <= _int8_bound(x.reshape(-1), 16))


def test_int8_rowwise_rejects_bad_row_dim_and_foreign_wire() -> None:
    for bad in (0, 6, -4):
        with pytest.raises(ValueError, match="multiple of 4"):
            Int8RowwiseCommCodec(bad)
    wire = Int8RowwiseCommCodec(32).encode(torch.randn(64))
    with pytest.raises(ValueError, match="same row_dim"):
        Int8RowwiseCommCodec(32).decode(wire[:-75])  # 5 bytes: no row is that short


# ---- sizes ---------------------------------------------------------------------------------


def test_wire_bytes_per_codec() -> None:
    chunks = [4 * 32, 0, 2 * 32]  # empty chunks take no room
    fp32 = wire_bytes(None, chunks)
    assert fp32 == 192 * 4
    assert wire_bytes(NoOpQuantizedCommCodec(), chunks) == fp32
    assert wire_bytes(CastCommCodec(torch.float16), chunks) * 2 == fp32
    assert wire_bytes(CastCommCodec(torch.bfloat16), chunks) * 2 == fp32
    assert wire_bytes(Int8RowwiseCommCodec(32), chunks) == 6 * 40  # (32 + 8) bytes per row
    assert wire_bytes(Int8RowwiseCommCodec(32), [33]) == 40 + 9


# ---- the builder ---------------------------------------------------------------------------


def test_get_qcomm_codecs_per_direction() -> None:
    codecs = get_qcomm_codecs("fp16", CommsPrecision.BF16)
    assert codecs.forward == CastCommCodec(torch.float16)
    assert codecs.backward == CastCommCodec(torch.bfloat16)
    plain = get_qcomm_codecs()
    assert isinstance(plain.forward, NoOpQuantizedCommCodec)
    assert isinstance(plain.backward, NoOpQuantizedCommCodec)
    scaled = get_qcomm_codecs("FP32", "fp16", backward_loss_scale=128.0)
    assert scaled.backward == CastCommCodec(torch.float16, loss_scale=128.0)


def test_int8_backends() -> None:
    torch_int8 = get_qcomm_codecs("int8", "int8", row_dim=16, int8_backend="torch")
    assert torch_int8.forward == Int8RowwiseCommCodec(16)
    auto = get_qcomm_codecs("int8", "fp32")
    expected = FbgemmInt8RowwiseCommCodec if fbgemm_int8_rowwise_supported() else None
    assert isinstance(auto.forward, expected or Int8RowwiseCommCodec)
    if not fbgemm_int8_rowwise_supported("cuda"):
        assert isinstance(get_qcomm_codecs("int8", device="cuda").forward, Int8RowwiseCommCodec)
        with pytest.raises(ValueError, match=f"forward codec of comm op '{RS}'.*'cuda'"):
            get_qcomm_codecs("int8", int8_backend="fbgemm", device="cuda", comm_op=RS)


def test_registry_per_comm_op() -> None:
    registry = get_qcomm_codecs_registry(
        {
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL: ("fp16", "bf16"),
            RS: QCommsConfig("int8", "fp16", row_dim=8),
        },
        int8_backend="torch",
    )
    assert set(registry) == {A2A, RS}
    assert registry[A2A].backward == CastCommCodec(torch.bfloat16)
    assert registry[RS].forward == Int8RowwiseCommCodec(8)
    everywhere = get_qcomm_codecs_registry(QCommsConfig("bf16", "bf16"))
    assert set(everywhere) == {op.value for op in CommOp}


def test_registry_errors_name_the_comm_op() -> None:
    with pytest.raises(ValueError, match=f"'fp8' for the backward codec of comm op '{A2A}'"):
        get_qcomm_codecs_registry({A2A: ("fp16", "fp8")})
    with pytest.raises(ValueError, match=f"forward codec of comm op '{RS}'.*loss scale"):
        get_qcomm_codecs(
            "int8", "fp32", forward_loss_scale=2.0, comm_op=CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
        )
    with pytest.raises(ValueError, match="unknown CommOp 'kjt_all_to_all'"):
        get_qcomm_codecs_registry({"kjt_all_to_all": ("fp16", "fp16")})
    with pytest.raises(TypeError, match=f"comm op '{A2A}'.*precision pair"):
        get_qcomm_codecs_registry({A2A: "fp16"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=f"of comm op '{A2A}'.*multiple of 4"):
        get_qcomm_codecs_registry({A2A: ("int8", "int8")}, row_dim=10)
    with pytest.raises(ValueError, match="int8_backend"):
        get_qcomm_codecs("int8", int8_backend="cuda")  # type: ignore[arg-type]
