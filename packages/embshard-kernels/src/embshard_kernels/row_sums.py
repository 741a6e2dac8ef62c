"""Summing gradient rows per distinct row id with one sparse product (CPU, float32).

:func:`group_rows` sorts the row ids once (stably) into a CSR ``[distinct rows x entries]``
pattern (the fast pooled backward then sums with ``embedding_bag``); :func:`sparse_product`
multiplies it with the entries' rows by one ``addmm`` (the data-parallel row exchange).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from embshard_optim.sorting import stable_sort


def group_rows(rows: Tensor, index_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(distinct rows, CSR row pointers, order)`` of 1-D ``rows``.

    Args:
        rows: row ids (any integer dtype).
        index_dtype: dtype of the row pointers (int32 where the entries fit: faster products).

    Returns:
        the distinct rows, sorted (``rows``' dtype); ``crow`` (``index_dtype``, one more than
        the distinct rows); ``order``: the entries grouped by row, each row's in input order.
    """
    keys, order = stable_sort(rows)
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    crow = torch.zeros(unique.numel() + 1, dtype=index_dtype, device=rows.device)
    torch.cumsum(counts, 0, out=crow[1:])
    return unique, crow, order


def sparse_product(
    crow: Tensor, columns: Tensor, values: Tensor, dense: Tensor, out: Tensor
) -> Tensor:
    """``out = S @ dense`` for the CSR matrix ``S`` of ``crow``, ``columns``, ``values``.

    Args:
        crow: row pointers (``out``'s rows + 1).
        columns: per entry, its row of ``dense`` (``crow``'s dtype).
        values: per entry, its weight (float32).
        dense: ``[columns, width]``.
        out: ``[rows, width]``, overwritten.
    """
    with warnings.catch_warnings():  # "sparse CSR support is in beta", once per process
        warnings.simplefilter("ignore", UserWarning)
        pattern = torch.sparse_csr_tensor(
            crow,
            columns,
            values,
            (out.shape[0], dense.shape[0]),
            check_invariants=False,
        )
        torch.addmm(out, pattern, dense, beta=0, out=out)
    return out
