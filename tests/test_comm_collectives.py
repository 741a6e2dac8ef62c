"""The blocking collective helpers on real gloo ranks against single-process references."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.comm.collectives import (
    all_gather_ints,
    all_gather_v,
    all_reduce,
    barrier,
    dense_row_all_reduce,
    sparse_all_gather,
    sparse_all_reduce,
    sum_rows,
)
from embshard_dist.comm.gather import start_all_gather


def _touched(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows touched on ``rank`` (repeats, and none at all on rank 1) and their gradients."""
    g = torch.Generator().manual_seed(6000 + rank)
    n = 0 if rank == 1 else 3 + 2 * rank
    rows = torch.randint(0, 6, (n,), generator=g)
    return rows, torch.randn(n, 3, generator=g)


def _check_sparse(mine: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """``sparse_all_gather`` and ``sparse_all_reduce`` of every rank's ``_touched`` rows against
    the single-process reference (exact: rank order, then each rank's own order)."""
    everyone = [_touched(r) for r in range(dist.get_world_size())]
    rows, grads = sparse_all_gather(*mine)
    assert torch.equal(rows.cpu(), torch.cat([r for r, _ in everyone]))
    assert torch.equal(grads.cpu(), torch.cat([g for _, g in everyone]))
    # zero-padded: each rank's block as it travelled, padded to the largest with row 0 and zeros
    rows, grads = sparse_all_gather(*mine, zero_padding=True)
    most = max(r.numel() for r, _ in everyone)
    for k, (r, g) in enumerate(everyone):
        block = slice(k * most, (k + 1) * most)
        pad = most - r.numel()
        assert torch.equal(rows[block].cpu(), torch.cat([r, torch.zeros(pad, dtype=r.dtype)]))
        assert torch.equal(grads[block].cpu(), torch.cat([g, torch.zeros(pad, 3)]))
    assert rows.numel() == grads.shape[0] == most * len(everyone)

    unique, summed = sparse_all_reduce(*mine)
    all_rows = torch.cat([r for r, _ in everyone]).tolist()
    all_grads = torch.cat([g for _, g in everyone])
    expected_rows = sorted(set(all_rows))
    assert unique.tolist() == expected_rows
    for i, row in enumerate(expected_rows):
        acc = torch.zeros(3)
        for j, r in enumerate(all_rows):
            if r == row:
                acc += all_grads[j]
        assert torch.equal(summed[i].cpu(), acc)
    return expected_rows, summed


def _collectives_case() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = test_device()
    barrier(timeout=10)

    t = torch.full((2,), float(rank + 1), device=device)
    assert all_reduce(t) is t
    assert t.tolist() == [world * (world + 1) / 2] * 2

    assert all_gather_ints([rank, 10 * rank]) == [[r, 10 * r] for r in range(world)]

    mine = torch.arange(rank * 2, dtype=torch.float32).reshape(rank, 2)  # rank 0: no rows
    gathered = all_gather_v(mine.to(device))
    assert [tuple(x.shape) for x in gathered] == [(r, 2) for r in range(world)]
    for r, x in enumerate(gathered):
        assert torch.equal(x.cpu(), torch.arange(r * 2, dtype=torch.float32).reshape(r, 2))

    mine_touched = [t.to(device) for t in _touched(rank)]
    expected_rows, summed = _check_sparse(mine_touched)

    # the small-block path: distinct rows in, the same rows and sums out
    distinct_rows, distinct_grads = sum_rows(*mine_touched)
    dense_rows, dense_sums = dense_row_all_reduce(distinct_rows, distinct_grads, 6)
    assert dense_rows.tolist() == expected_rows
    torch.testing.assert_close(dense_sums.cpu(), summed.cpu(), rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_reference(world: int) -> None:
    assert run_on_ranks(world, _collectives_case) == [True] * world


def _gather_case() -> bool:
    """``start_all_gather`` against the backend's all-gather: floats, ints, empty blocks, and a
    block that already sits in its slot of the output."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = test_device()
    for dtype, n in ((torch.float32, 5), (torch.int64, 3), (torch.float32, 0)):
        local = (torch.arange(n) + 100 * rank).to(dtype).to(device)
        expected = torch.empty(world * n, dtype=dtype, device=device)
        dist.all_gather_into_tensor(expected, local)
        out = torch.full((world * n,), -1, dtype=dtype, device=device)
        start_all_gather("test.gather", out, local, group=None).wait()
        assert torch.equal(out, expected)
        in_place = torch.zeros(world, n, dtype=dtype, device=device)
        in_place[rank] = local
        pending = start_all_gather("test.gather", in_place, in_place[rank], group=None)
        pending.wait()
        pending.wait()  # idempotent
        assert torch.equal(in_place.view(-1), expected)
    try:
        start_all_gather("test.gather", torch.empty(3), torch.empty(2), group=None)
    except ValueError as e:
        assert "test.gather" in str(e) and f"{world} blocks of 2" in str(e)
    else:
        raise AssertionError("a wrong output size was accepted")
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_as_all_to_all_matches_backend(world: int) -> None:
    assert run_on_ranks(world, _gather_case) == [True] * world


def _not_member_case() -> str:
    group = dist.new_group([0, 1])
    if dist.get_rank() != 2:
        return "member"
    try:
        start_all_gather("test.gather", torch.empty(4), torch.empty(2), group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def test_all_gather_refuses_a_rank_outside_the_group() -> None:
    messages = run_on_ranks(3, _not_member_case)
    assert messages[:2] == ["member", "member"]
    assert "rank 2 is not a member" in messages[2] and "test.gather" in messages[2]


def _shape_mismatch_case() -> str:
    rank = dist.get_rank()
    try:
        all_gather_v(torch.zeros(2, 3 + rank, device=test_device()))
    except ValueError as e:
        return str(e)
    return "no error"


def test_all_gather_v_reports_shape_disagreement_on_every_rank() -> None:
    messages = run_on_ranks(2, _shape_mismatch_case)
    assert all("rank 0: torch.float32 [3], rank 1: torch.float32 [4]" in m for m in messages)


def test_sum_rows_is_local_and_checks_shapes() -> None:
    rows, summed = sum_rows(torch.tensor([4, 1, 4]), torch.tensor([[1.0], [2.0], [3.0]]))
    assert rows.tolist() == [1, 4]
    assert summed.tolist() == [[2.0], [4.0]]
    with pytest.raises(ValueError, match="one 2-D gradient row per id"):
        sum_rows(torch.tensor([1, 2]), torch.zeros(3, 2))
