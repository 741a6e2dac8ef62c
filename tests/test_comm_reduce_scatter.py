"""PooledEmbeddingsReduceScatter on real gloo ranks against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fp16_codecs import Fp16Codec, ScaledFp16Codec, roundtrip
from _mp import run_on_ranks, test_device

from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_dist.strategies.layout import boundaries
from embshard_types.comm_codec import QuantizedCommCodecs

DIM = 5


def _input(rank: int, batches: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + rank)
    return torch.randn(sum(batches), DIM, generator=g)


def _grad(rank: int, batches: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(4000 + rank)
    return torch.randn(batches[rank], DIM, generator=g)


def _reduce_scatter_case(batches: list[int], with_codecs: bool, pass_splits: bool) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    codecs = (
        QuantizedCommCodecs(forward=ScaledFp16Codec(), backward=Fp16Codec())
        if with_codecs
        else None
    )
    fwd = codecs.forward if codecs else None
    bwd = codecs.backward if codecs else None
    inputs = [_input(s, batches) for s in range(world)]
    grads = [_grad(r, batches) for r in range(world)]
    rows = boundaries(batches)

    device = test_device()
    x = inputs[rank].to(device, copy=True).requires_grad_()
    rs = PooledEmbeddingsReduceScatter(None, codecs=codecs)
    out = rs(x, batches if pass_splits else None).wait()
    got = out.detach().cpu()
    assert torch.equal(x.detach().cpu(), inputs[rank])  # a kept own block is read, not written

    mine = slice(rows[rank], rows[rank + 1])
    expected = roundtrip(fwd, inputs[0][mine])
    for s in range(1, world):  # rank order
        expected += roundtrip(fwd, inputs[s][mine])
    assert out.shape == (batches[rank], DIM)
    backend_sums = len(set(batches)) == 1 and not with_codecs
    if backend_sums:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # all-to-all, then a sum in rank order: exact
        assert torch.equal(got, expected), (got, expected)

    out.backward(grads[rank].to(device))
    padded = max(batches)
    gathered = []
    for r in range(world):
        g = torch.cat([grads[r], torch.zeros(padded - batches[r], DIM)])
        gathered.append(roundtrip(bwd, g)[: batches[r]])
    assert x.grad is not None
    assert torch.equal(x.grad.cpu(), torch.cat(gathered)), (x.grad, torch.cat(gathered))
    return True


@pytest.mark.parametrize("with_codecs", [False, True], ids=["plain", "codecs"])
@pytest.mark.parametrize(
    ("batches", "pass_splits"),
    [
        ([3, 3], False),  # even: reduce_scatter_single
        ([3, 3, 3], True),
        ([4, 1], True),  # uneven: all-to-all + sum in rank order
        ([2, 0, 3], True),  # a rank with an empty batch
        ([0, 4], True),  # the first rank keeps an empty block of its own
    ],
)
def test_reduce_scatter_matches_reference(
    batches: list[int], with_codecs: bool, pass_splits: bool
) -> None:
    assert run_on_ranks(len(batches), _reduce_scatter_case, batches, with_codecs, pass_splits) == [
        True
    ] * len(batches)


def _bad_splits_case() -> str:
    rs = PooledEmbeddingsReduceScatter(None)
    try:
        rs(torch.zeros(4, 2, device=test_device()), [1, 2])
    except ValueError as e:
        return str(e)
    return "no error"


def test_reduce_scatter_rejects_splits_that_do_not_fit() -> None:
    messages = run_on_ranks(2, _bad_splits_case)
    assert all("adding up to the 4 rows" in m for m in messages), messages
