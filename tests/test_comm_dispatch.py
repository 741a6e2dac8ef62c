"""``comm.dispatch``: which algorithm each collective runs, per backend / device and call."""

from __future__ import annotations

import torch

from embshard_dist.comm import dispatch
from embshard_dist.comm.algorithms.all_gather import (
    all_gather_as_all_to_all,
    all_gather_by_backend,
)
from embshard_dist.comm.algorithms.pooled_all_to_all import (
    backward_keeping_own_rows,
    backward_through_backend,
    forward_keeping_own_rows,
    forward_through_backend,
)
from embshard_dist.comm.algorithms.reduce_scatter import (
    reduce_scatter_as_all_to_all,
    reduce_scatter_by_backend,
)
from embshard_dist.comm.algorithms.row_sums import (
    sum_rows_by_index_add,
    sum_rows_by_sparse_product,
)
from embshard_dist.comm.codecs import CastCommCodec
from embshard_types.comm_codec import NoOpQuantizedCommCodec


def test_all_gather_is_an_all_to_all_for_cpu_tensors_of_several_ranks() -> None:
    cpu = torch.zeros(3)
    assert dispatch.all_gather(cpu, 2, 0) is all_gather_as_all_to_all
    assert dispatch.all_gather(cpu, 3, 1) is all_gather_as_all_to_all
    assert dispatch.all_gather(cpu, 1, 0) is all_gather_by_backend
    assert dispatch.all_gather(cpu, 2, -1) is all_gather_by_backend  # not a member
    assert dispatch.all_gather(torch.zeros(3, device="meta"), 2, 0) is all_gather_by_backend


def test_reduce_scatter_uses_the_backend_only_off_gloo_for_even_uncoded_blocks() -> None:
    fp16 = CastCommCodec(torch.float16)
    assert dispatch.reduce_scatter("nccl", [4, 4], None) is reduce_scatter_by_backend
    assert dispatch.reduce_scatter("nccl", [4, 4], NoOpQuantizedCommCodec()) is (
        reduce_scatter_by_backend
    )
    assert dispatch.reduce_scatter("nccl", [4, 3], None) is reduce_scatter_as_all_to_all
    assert dispatch.reduce_scatter("nccl", [4, 4], fp16) is reduce_scatter_as_all_to_all
    assert dispatch.reduce_scatter("gloo", [4, 4], None) is reduce_scatter_as_all_to_all
    assert dispatch.reduce_scatter("cpu:gloo,cuda:nccl", [4, 4], None) is (
        reduce_scatter_as_all_to_all
    )


def test_pooled_all_to_all_keeps_own_rows_on_the_first_and_last_rank() -> None:
    for world, rank in ((2, 0), (2, 1), (3, 0), (3, 2)):
        chosen = dispatch.pooled_all_to_all(world, rank)
        assert chosen.forward is forward_keeping_own_rows, (world, rank)
        assert chosen.backward is backward_keeping_own_rows, (world, rank)
    for world, rank in ((1, 0), (3, 1), (4, 2)):
        chosen = dispatch.pooled_all_to_all(world, rank)
        assert chosen.forward is forward_through_backend, (world, rank)
        assert chosen.backward is backward_through_backend, (world, rank)


def test_row_sums_use_the_sparse_product_for_cpu_float32_only() -> None:
    rows = torch.tensor([2, 0, 2])
    assert dispatch.row_sum(rows, torch.zeros(3, 4)) is sum_rows_by_sparse_product
    assert dispatch.row_sum(rows, torch.zeros(3, 4, dtype=torch.float64)) is sum_rows_by_index_add
    assert dispatch.row_sum(rows[:0], torch.zeros(0, 4)) is sum_rows_by_index_add


def test_row_sum_variants_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 7, (50,), generator=gen)
    grads = torch.randn(50, 5, generator=gen)
    sparse = sum_rows_by_sparse_product(rows, grads, None, None)
    added = sum_rows_by_index_add(rows, grads, None, None)
    assert torch.equal(sparse[0], added[0])
    assert torch.allclose(sparse[1], added[1], rtol=0, atol=1e-6)
