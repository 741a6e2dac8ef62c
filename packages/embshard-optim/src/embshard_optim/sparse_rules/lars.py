"""LARS-SGD on the touched rows of a table (FBGEMM's ``LARS_SGD``).

Per row ``lr' = lr * eta * ||w|| / (||g|| + wd * ||w||)`` (0 where that divides by zero),
``m1 = momentum * m1 + lr' * (g + wd * w)``, then ``w -= m1``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from embshard_optim.sparse_rules.base import (
    RowReduction,
    compute_dtype,
    gather,
    row_norms,
    safe_ratio,
    write_rows,
)
from embshard_optim.specs import OptimizerSpec


def lars_sgd_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """FBGEMM ``LARS_SGD`` on ``rows`` (unchecked; see ``SparseRule``)."""
    dtype = compute_dtype(weight)
    g = grad.to(dtype)
    w = gather(weight, rows, dtype)
    w_norm, g_norm = row_norms(w, g, reduction=reduction)
    decay = spec.weight_decay
    adjusted_lr = safe_ratio(spec.learning_rate * spec.eta * w_norm, g_norm + decay * w_norm)
    momentum = state["momentum1"]
    decayed_grad = g + decay * w if decay > 0.0 else g
    m1 = gather(momentum, rows, dtype).mul_(spec.momentum).add_(adjusted_lr[:, None] * decayed_grad)
    write_rows(momentum, rows, m1)
    write_rows(weight, rows, w - m1)
