"""Exact SGD on the touched rows of a table.

Follows FBGEMM's ``EXACT_SGD`` (codegen ``sgd()``): ``w -= lr * g`` for each touched row; no
weight decay, no state.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from embshard_optim.sparse_rules.base import RowReduction, add_to_rows, compute_dtype
from embshard_optim.specs import OptimizerSpec


def sgd_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """FBGEMM ``EXACT_SGD`` on ``rows``: ``w[r] -= lr * g[r]`` (unchecked; see ``SparseRule``)."""
    g = grad.to(compute_dtype(weight))
    add_to_rows(weight, rows, g * -spec.learning_rate)
