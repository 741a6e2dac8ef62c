"""Summing the gradients of repeated rows: a sparse product (CPU float32) or ``index_add_``.

Both return the sorted unique rows and, per row, its gradients summed in input order.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from embshard_kernels.row_sums import group_rows, sparse_product
from embshard_kernels.workspace import Workspace

__all__ = ["RowSum", "sum_rows_by_index_add", "sum_rows_by_sparse_product"]


class RowSum(Protocol):
    """``(rows, grads, sources, workspace) -> (unique_rows, summed)`` (see ``sum_rows``)."""

    def __call__(
        self, rows: Tensor, grads: Tensor, sources: Tensor | None, workspace: Workspace | None
    ) -> tuple[Tensor, Tensor]: ...


def sum_rows_by_sparse_product(
    rows: Tensor, grads: Tensor, sources: Tensor | None, workspace: Workspace | None
) -> tuple[Tensor, Tensor]:
    """A sparse ``[unique x grads]`` matrix of ones (each row's ids in input order) times the
    gradient rows: one pass, no per-id scatter; int32 indices where they fit."""
    index = torch.int32 if grads.shape[0] < 2**31 else torch.int64
    unique, crow, order = group_rows(rows, index)
    picked = order if sources is None else sources.index_select(0, order)
    shape = (unique.numel(), grads.shape[1])
    summed = (
        grads.new_empty(shape)
        if workspace is None
        else workspace.take("summed", shape, grads.dtype, grads.device)
    )
    sparse_product(crow, picked.to(index), torch.ones(rows.numel()), grads, summed)
    return unique, summed


def sum_rows_by_index_add(
    rows: Tensor, grads: Tensor, sources: Tensor | None, workspace: Workspace | None
) -> tuple[Tensor, Tensor]:
    """``index_add_`` of the gradient rows into a zeroed ``[unique, dim]`` (it adds in index
    order, which is the input order here); ``workspace`` is not used."""
    unique, crow, order = group_rows(rows, torch.int64)
    picked = order if sources is None else sources.index_select(0, order)
    inverse = torch.repeat_interleave(
        torch.arange(unique.numel(), device=rows.device), crow.diff(), output_size=rows.numel()
    )
    summed = grads.new_zeros(unique.shape[0], grads.shape[1])
    summed.index_add_(0, inverse, grads.index_select(0, picked))
    return unique, summed
