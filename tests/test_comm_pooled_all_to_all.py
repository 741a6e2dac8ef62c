"""PooledEmbeddingsAllToAll on real gloo ranks against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fp16_codecs import Fp16Codec, ScaledFp16Codec, roundtrip
from _mp import run_on_ranks, test_device

from embshard_dist.comm.columns import ColumnAssembly
from embshard_dist.comm.placement import PlacedAssembly
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.strategies.layout import boundaries
from embshard_types.awaitables import NoWait
from embshard_types.comm_codec import QuantizedCommCodecs


def _input(rank: int, batches: list[int], dims: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(sum(batches), dims[rank], generator=g)


def _grad(rank: int, batches: list[int], dims: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(batches[rank], sum(dims), generator=g)


def _pooled_case(batches: list[int], dims: list[int], with_codecs: bool) -> tuple[int, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    codecs = (
        QuantizedCommCodecs(forward=Fp16Codec(), backward=ScaledFp16Codec())
        if with_codecs
        else None
    )
    fwd = codecs.forward if codecs else None
    bwd = codecs.backward if codecs else None
    inputs = [_input(s, batches, dims) for s in range(world)]
    grads = [_grad(r, batches, dims) for r in range(world)]
    rows, cols = boundaries(batches), boundaries(dims)

    device = test_device()
    x = inputs[rank].to(device, copy=True).requires_grad_()
    a2a = PooledEmbeddingsAllToAll(None, dims, codecs=codecs)
    uneven = len(set(batches)) > 1
    out = a2a(x, batches if uneven else None).wait()

    mine = slice(rows[rank], rows[rank + 1])
    expected = torch.cat([roundtrip(fwd, inputs[s][mine]) for s in range(world)], dim=1)
    assert out.shape == (batches[rank], sum(dims))
    assert torch.equal(out.cpu(), expected), (out, expected)

    out.backward(grads[rank].to(device))
    my_cols = slice(cols[rank], cols[rank + 1])
    expected_grad = torch.cat([roundtrip(bwd, grads[r][:, my_cols]) for r in range(world)])
    assert x.grad is not None
    assert torch.equal(x.grad.cpu(), expected_grad), (x.grad, expected_grad)
    return tuple(out.shape)


@pytest.mark.parametrize("with_codecs", [False, True], ids=["plain", "codecs"])
@pytest.mark.parametrize(
    ("batches", "dims"),
    [
        ([2, 2], [3, 5]),
        ([3, 1], [4, 0]),  # uneven batches, a rank without tables
        ([2, 0, 3], [1, 6, 2]),  # a rank with an empty batch
        ([2, 2, 2], [0, 0, 4]),
    ],
)
def test_pooled_all_to_all_matches_reference(
    batches: list[int], dims: list[int], with_codecs: bool
) -> None:
    shapes = run_on_ranks(len(batches), _pooled_case, batches, dims, with_codecs)
    assert shapes == [(b, sum(dims)) for b in batches]


def _overlapping_case() -> bool:
    """Two all-to-alls in flight at once, waited for in reverse order, plus callbacks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = [2] * world
    first = PooledEmbeddingsAllToAll(None, dims, callbacks=[lambda t: t * 2])
    second = PooledEmbeddingsAllToAll(None, dims)
    a = torch.full((world, 2), float(rank), device=test_device())
    b = torch.full((world, 2), float(10 + rank), device=test_device())
    wa, wb = first(a), second(b)
    out_b, out_a = wb.wait().cpu(), wa.wait().cpu()
    assert torch.equal(out_a, torch.arange(world).float().repeat_interleave(2)[None] * 2)
    assert torch.equal(out_b, (10 + torch.arange(world)).float().repeat_interleave(2)[None])
    return True


def test_pooled_all_to_all_overlapping_calls() -> None:
    assert run_on_ranks(3, _overlapping_case) == [True] * 3


def _bad_input_case() -> str:
    a2a = PooledEmbeddingsAllToAll(None, [2, 3])
    try:
        a2a(torch.zeros(3, 2 if dist.get_rank() == 0 else 3, device=test_device()))
    except ValueError as e:
        return str(e)
    return "no error"


def test_pooled_all_to_all_rejects_bad_shapes_before_communicating() -> None:
    messages = run_on_ranks(2, _bad_input_case)
    assert all("do not split evenly over 2 ranks" in m for m in messages), messages


def _placed_case(with_codecs: bool, keep_columns: bool) -> bool:
    """Two all-to-alls placed into one output beside a local part (as a mixed plan's collection
    does): the same values and gradients as assembling their separate outputs, and neither
    all-to-all allocates an output of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    codecs = (
        QuantizedCommCodecs(forward=Fp16Codec(), backward=ScaledFp16Codec())
        if with_codecs
        else None
    )
    batches, dims_a, dims_b = [3] * world, [2 + r for r in range(world)], [4] * world
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(sum(batches), d[rank], generator=g) for d in (dims_a, dims_b)]
    local = torch.randn(batches[rank], 5, generator=g)
    columns_a = list(reversed(range(sum(dims_a)))) if keep_columns else None
    widths = [sum(dims_a), sum(dims_b), 5]
    order = torch.randperm(sum(widths), generator=torch.Generator().manual_seed(7)).tolist()
    grad = torch.randn(batches[rank], sum(widths), generator=g)

    def run(placed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [x.clone().requires_grad_() for x in (*xs, local)]
        a2a_a = PooledEmbeddingsAllToAll(
            None, dims_a, codecs=codecs, columns=columns_a, grad_scale=0.5
        )
        a2a_b = PooledEmbeddingsAllToAll(None, dims_b, codecs=codecs)
        pending = [a2a_a(leaves[0]), a2a_b(leaves[1]), NoWait(leaves[2] * 1.0)]
        assembly = ColumnAssembly(widths, order)
        if placed:
            out = PlacedAssembly(assembly)(pending)
            # the all-to-alls wrote into the output and gave empty tokens
            assert [p.wait().numel() for p in pending[:2]] == [0, 0]
        else:
            out = assembly([p.wait() for p in pending])
        out.backward(grad)
        return out.detach(), [leaf.grad for leaf in leaves]  # type: ignore[misc]

    out, grads = run(placed=True)
    ref, ref_grads = run(placed=False)
    return torch.equal(out, ref) and all(
        torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("with_codecs", [False, True], ids=["plain", "codecs"])
def test_placed_all_to_alls_equal_the_assembled_outputs(world: int, with_codecs: bool) -> None:
    assert run_on_ranks(world, _placed_case, with_codecs, True) == [True] * world
    assert run_on_ranks(world, _placed_case, with_codecs, False) == [True] * world
