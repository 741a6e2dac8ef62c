"""Exact SGD on the touched rows of a table: FBGEMM's ``EXACT_SGD``, ``w -= lr * g``, no state."""

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
    consume_grad: bool = False,
) -> None:
    """``w[rows] -= lr * grad`` (unchecked; see ``SparseRule``).

    Args:
        consume_grad: ``grad`` may be overwritten (saves a copy).
    """
    g = grad.to(compute_dtype(weight))
    add_to_rows(
        weight, rows, g.mul_(-spec.learning_rate) if consume_grad else g * -spec.learning_rate
    )
