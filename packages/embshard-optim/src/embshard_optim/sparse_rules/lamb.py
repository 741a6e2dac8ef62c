"""LAMB and partial row-wise LAMB on the touched rows of a table.

Both follow FBGEMM's kernels (codegen ``lamb()`` and ``partial_rowwise_lamb()``), with ``t`` the
1-based step, ``bc1 = 1 - beta1**t`` and ``bc2 = 1 - beta2**t``:

- ``LAMB``: point-wise ``m1 = beta1 * m1 + (1 - beta1) * g``,
  ``m2 = beta2 * m2 + (1 - beta2) * g**2``; ``r = (m1 / bc1) / (sqrt(m2 / bc2) + eps) + wd * w``.
- ``PARTIAL_ROWWISE_LAMB``: ``m1`` as above, ``m2`` row-wise with ``mean(g**2)`` over the row;
  ``r = (m1 / bc1) / (sqrt(m2 / bc2) + eps) + wd * w``.
- then, per row, the trust ratio ``||w|| / ||r||`` and ``w -= lr * ratio * r``.

A row whose ``r`` is zero gets ratio 0 (FBGEMM would divide by zero); a zero row (``||w|| = 0``)
gets ratio 0 and stays zero, as in FBGEMM.
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
