"""ColumnOrder: the same values and gradients as ``index_select(1, ...)``, both block and general."""

from __future__ import annotations

import pytest
import torch

from embshard_dist.comm.columns import ColumnAssembly, ColumnOrder


@pytest.mark.parametrize(
    "columns",
    [
        [4, 5, 6, 7, 0, 1, 2, 3],  # two blocks of 4
        [2, 3, 0, 1, 6, 7, 4, 5],  # blocks of 2
        [3, 0, 2, 1, 7, 4, 6, 5],  # no block structure
        [6, 7, 0, 1, 2, 3, 4, 5],  # blocks of 2 only (widths 2 and 6 mixed)
    ],
)
@pytest.mark.parametrize("batch", [0, 5])
def test_matches_index_select_forward_and_backward(columns: list[int], batch: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 8, generator=g, requires_grad=True)
    grad = torch.randn(batch, 8, generator=g)
    order = ColumnOrder(columns)
    out = order(x)
    out.backward(grad)
    mine = x.grad
    x.grad = None
    expected = x.index_select(1, torch.tensor(columns))
    expected.backward(grad)
    assert torch.equal(out, expected)
    assert mine is not None and torch.equal(mine, x.grad)


def test_identity_is_none_and_bad_columns_are_refused() -> None:
    assert ColumnOrder.of([0, 1, 2]) is None
    assert ColumnOrder.of(None) is None
    with pytest.raises(ValueError, match="permutation"):
        ColumnOrder([0, 0, 1])
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        ColumnOrder([2, 1, 0])(torch.zeros(2, 4))


@pytest.mark.parametrize("columns", [None, [6, 7, 0, 1, 2, 3, 4, 5], [3, 0, 2, 1, 7, 4, 6, 5]])
@pytest.mark.parametrize("widths", [[8], [2, 6], [3, 0, 5]])
def test_assembly_equals_cat_then_reorder(columns: list[int] | None, widths: list[int]) -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(4, w, generator=g, requires_grad=True) for w in widths]
    grad = torch.randn(4, 8, generator=g)
    out = ColumnAssembly(widths, columns)(parts)
    out.backward(grad)
    mine = [p.grad for p in parts]
    for p in parts:
        p.grad = None
    expected = torch.cat(parts, dim=1)
    if columns is not None:
        expected = expected.index_select(1, torch.tensor(columns))
    expected.backward(grad)
    assert torch.equal(out, expected)
    for m, p in zip(mine, parts, strict=True):
        assert m is not None and p.grad is not None and torch.equal(m, p.grad)


def test_assembly_refuses_parts_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="permutation"):
        ColumnAssembly([2, 2], [0, 1, 2])
    with pytest.raises(ValueError, match="widths"):
        ColumnAssembly([2, 2])([torch.zeros(3, 2), torch.zeros(3, 3)])


def test_placed_assemblies_fill_one_output_and_split_its_gradient() -> None:
    g = torch.Generator().manual_seed(2)
    widths, columns = [2, 3], [4, 0, 3, 1, 2]
    whole = ColumnAssembly(widths, columns)
    parts = [torch.randn(4, w, generator=g) for w in widths]
    # this assembly's 5 columns go to columns 6, 1, 2, 3, 7 of an 8-wide output
    dests = [6, 1, 2, 3, 7]
    placed = whole.place(dests, 8)
    out = torch.full((4, 8), float("nan"))
    placed.assemble(parts, out=out)
    expected = whole.assemble(parts)
    assert torch.equal(out[:, dests], expected)
    assert out[:, [0, 4, 5]].isnan().all()
    grad = torch.randn(4, 8, generator=g)
    for mine, ref in zip(placed.split(grad), whole.split(grad[:, dests]), strict=True):
        assert torch.equal(mine, ref)
    with pytest.raises(TypeError, match="placed"):
        placed(parts)
    with pytest.raises(ValueError, match="distinct"):
        whole.place([0, 0, 1, 2, 3], 8)
    with pytest.raises(ValueError, match=r"0\.\.7"):
        whole.place([0, 1, 2, 3, 8], 8)
