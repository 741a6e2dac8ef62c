"""FBGEMM's INT8 row-wise comms codec against a plain-torch reference of the documented format.

(embshard-dist's tests also check it byte for byte against the dist package's torch codec; this
package's tests run without embshard-dist installed.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_kernels.comm_codecs import FbgemmInt8RowwiseCommCodec, fbgemm_int8_rowwise_supported
from embshard_types.comm_codec import QuantizedCommCodec

pytestmark = pytest.mark.skipif(
    not fbgemm_int8_rowwise_supported("cpu"), reason="this FBGEMM build has no CPU quantize ops"
)


def _reference_encode(x: torch.Tensor, row_dim: int) -> torch.Tensor:
    """Rows of ``row_dim`` elements (the last may be shorter): codes, float32 scale, bias."""
    out = [torch.empty(0, dtype=torch.uint8)]
    for row in x.reshape(-1).split(row_dim) if x.numel() else ():
        low, span = row.min(), row.max() - row.min()
        codes = torch.round((row - low) * (255.0 / (span + 1e-8))).clamp(0, 255)
        scale_bias = torch.stack([span / 255.0, low]).view(torch.uint8)
        out += [codes.to(torch.uint8), scale_bias]
    return torch.cat(out)


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 200),
    row_dim=st.sampled_from([4, 8, 32]),
    magnitude=st.sampled_from([1e-2, 1.0, 1e2]),
    seed=st.integers(0, 2**16),
)
def test_matches_the_reference_format(
    numel: int, row_dim: int, magnitude: float, seed: int
) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * magnitude
    codec = FbgemmInt8RowwiseCommCodec(row_dim)
    wire = codec.encode(x)
    assert wire.dtype == codec.quantized_dtype == torch.uint8
    assert wire.numel() == codec.calc_quantized_size(numel)
    assert torch.equal(wire, _reference_encode(x, row_dim))
    out = codec.decode(wire)
    assert out.dtype == torch.float32 and out.shape == (numel,)
    for start in range(0, numel, row_dim):
        row, got = x[start : start + row_dim], out[start : start + row_dim]
        half_step = (row.max() - row.min()) / 510
        assert torch.all((got - row).abs() <= half_step + 1e-8 + 1e-6 * row.abs().max())


def test_is_a_codec_and_encodes_2d_chunks() -> None:
    codec = FbgemmInt8RowwiseCommCodec(8)
    assert isinstance(codec, QuantizedCommCodec)
    x = torch.randn(3, 12, dtype=torch.float64)
    assert torch.equal(codec.encode(x), codec.encode(x.float().reshape(-1)))
    assert codec.padded_size(x, [12, 4], 0, None) == (12, 0)


def test_rejects_bad_row_dim_and_foreign_wire() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        FbgemmInt8RowwiseCommCodec(30)
    with pytest.raises(ValueError, match="same row_dim"):
        FbgemmInt8RowwiseCommCodec(8).decode(torch.zeros(16 + 3, dtype=torch.uint8))


def test_support_probe() -> None:
    assert fbgemm_int8_rowwise_supported() and fbgemm_int8_rowwise_supported("cpu")
    if not torch.cuda.is_available():
        assert not fbgemm_int8_rowwise_supported("cuda")
