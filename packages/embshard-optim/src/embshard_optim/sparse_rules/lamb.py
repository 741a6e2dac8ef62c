"""LAMB and partial row-wise LAMB on the touched rows of a table (FBGEMM's ``LAMB`` and
``PARTIAL_ROWWISE_LAMB``).

The update direction is Adam's (:mod:`~embshard_optim.sparse_rules.adam`) plus ``wd * w``,
scaled per row by the trust ratio ``||w|| / ||r||`` (0 where ``r`` or ``w`` is zero).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from embshard_optim.sparse_rules.adam import adam_direction, partial_rowwise_adam_direction
from embshard_optim.sparse_rules.base import (
    RowReduction,
    compute_dtype,
    gather,
    row_norms,
    safe_ratio,
    write_rows,
)
from embshard_optim.specs import OptimizerSpec


def lamb_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """FBGEMM ``LAMB`` on ``rows`` (unchecked; see ``SparseRule``)."""
    g = grad.to(compute_dtype(weight))
    update = adam_direction(spec, state, rows, g, step)
    _apply_trust_ratio(spec, weight, rows, update, reduction)


def partial_rowwise_lamb_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """FBGEMM ``PARTIAL_ROWWISE_LAMB`` on ``rows`` (unchecked; see ``SparseRule``)."""
    g = grad.to(compute_dtype(weight))
    update = partial_rowwise_adam_direction(spec, state, rows, g, step, reduction)
    _apply_trust_ratio(spec, weight, rows, update, reduction)


def _apply_trust_ratio(
    spec: OptimizerSpec,
    weight: Tensor,
    rows: Tensor,
    update: Tensor,
    reduction: RowReduction | None,
) -> None:
    """``r = update + wd * w``; ``w -= lr * (||w|| / ||r||) * r`` row by row."""
    w = gather(weight, rows, update.dtype)
    r = update + spec.weight_decay * w if spec.weight_decay > 0.0 else update
    w_norm, r_norm = row_norms(w, r, reduction=reduction)
    ratio = safe_ratio(w_norm, r_norm)
    write_rows(weight, rows, w - (spec.learning_rate * ratio)[:, None] * r)
