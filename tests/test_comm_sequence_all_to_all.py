"""SequenceEmbeddingsAllToAll on real gloo ranks against a single-process reference.

Every rank builds every rank's payload from a seed, so each can compute what it must receive
(and what gradient must come back) on its own. With FP16 / BF16 codecs from
``embshard_dist.comm.codecs`` the reference applies the codec's round trip to each per-peer
chunk, so the comparison stays exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks

from embshard_dist.comm.codecs import CastCommCodec, Int8RowwiseCommCodec
from embshard_dist.comm.sequence_all_to_all import SequenceEmbeddingsAllToAll
from embshard_types.comm_codec import QuantizedCommCodecs

# counts[s][r]: entries rank s sends to rank r
COUNTS = {
    2: [[3, 0], [2, 5]],
    3: [[1, 0, 4], [0, 0, 0], [2, 3, 1]],
}


def _payload(seed: int, rows: int, trailing: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, *trailing), generator=g)


def roundtrip(codec: object, chunk: torch.Tensor) -> torch.Tensor:
    """What a receiver sees of ``chunk`` sent alone through ``codec``."""
    if codec is None or chunk.numel() == 0:
        return chunk
    encoded = codec.encode(chunk)  # type: ignore[attr-defined]
    return codec.decode(encoded).reshape(chunk.shape)  # type: ignore[attr-defined]


def _case(codec_names: tuple[str, str] | None, trailing: tuple[int, ...]) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = COUNTS[world]
    make = {
        "fp16": lambda: CastCommCodec(torch.float16),
        "bf16": lambda: CastCommCodec(torch.bfloat16),
        "int8": lambda: Int8RowwiseCommCodec(row_dim=4),
    }
    codecs = (
        None
        if codec_names is None
        else QuantizedCommCodecs(forward=make[codec_names[0]](), backward=make[codec_names[1]]())
    )
    fwd = None if codecs is None else codecs.forward
    bwd = None if codecs is None else codecs.backward
    inputs = [_payload(100 + s, sum(counts[s]), trailing) for s in range(world)]
    grads = [_payload(200 + r, sum(c[r] for c in counts), trailing) for r in range(world)]

    x = inputs[rank].clone().requires_grad_()
    a2a = SequenceEmbeddingsAllToAll(None, codecs=codecs)
    received_from = [c[rank] for c in counts]
    out = a2a(x, counts[rank], received_from).wait()

    expected = torch.cat(
        [roundtrip(fwd, inputs[s].split(counts[s])[rank]) for s in range(world)], dim=0
    )
    assert out.shape == expected.shape
    assert torch.equal(out, expected), (out, expected)

    out.backward(grads[rank])
    back = [roundtrip(bwd, grads[r].split([c[r] for c in counts])[rank]) for r in range(world)]
    assert x.grad is not None
    assert torch.equal(x.grad, torch.cat(back, dim=0))
    return list(out.shape)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("codec_names", "trailing"),
    [
        (None, (4,)),
        (("fp16", "bf16"), (4,)),  # rows of an [ids, dim] tensor
        (("fp16", "fp16"), ()),  # a flat payload (rows of mixed widths)
        (("int8", "fp16"), (6,)),
    ],
    ids=["plain", "fp16_bf16_rows", "fp16_flat", "int8_rows"],
)
def test_sequence_all_to_all_matches_reference(
    world_size: int, codec_names: tuple[str, str] | None, trailing: tuple[int, ...]
) -> None:
    shapes = run_on_ranks(world_size, _case, codec_names, trailing)
    counts = COUNTS[world_size]
    assert shapes == [[sum(c[r] for c in counts), *trailing] for r in range(world_size)]


def _fp16_error_case() -> float:
    """FP16 on the wire: the forward differs from FP32 comms by at most FP16 rounding."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _payload(300 + rank, 4 * world, (8,))
    plain = SequenceEmbeddingsAllToAll(None)(x, [4] * world, [4] * world).wait()
    codecs = QuantizedCommCodecs(forward=CastCommCodec(torch.float16))
    coded = SequenceEmbeddingsAllToAll(None, codecs=codecs)(x, [4] * world, [4] * world).wait()
    error = float(((coded - plain).abs() / plain.abs().clamp(min=1e-3)).max())
    assert error <= 2.0**-11, error  # FP16 keeps 11 significant bits
    return error


def test_sequence_all_to_all_fp16_error_is_bounded() -> None:
    errors = run_on_ranks(2, _fp16_error_case)
    assert all(e > 0 for e in errors)  # the codec did round


def _bad_splits_case() -> str:
    world = dist.get_world_size()
    a2a = SequenceEmbeddingsAllToAll(None)
    try:
        a2a(torch.zeros(3, 4), [1] * world, [1] * world)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequence_all_to_all_rejects_bad_splits_before_communicating() -> None:
    messages = run_on_ranks(2, _bad_splits_case)
    assert all("input_splits [1, 1] add up to 2" in m for m in messages), messages
