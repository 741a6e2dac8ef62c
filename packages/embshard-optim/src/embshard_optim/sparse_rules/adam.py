"""Adam and partial row-wise Adam on the touched rows of a table (FBGEMM's ``ADAM`` and
``PARTIAL_ROWWISE_ADAM``).

Only touched rows are updated (their moments do not decay in steps that skip them); bias
correction uses the global 1-based step ``t``: ``bc1 = 1 - beta1**t``, ``bc2 = 1 - beta2**t``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from embshard_optim.sparse_rules.base import (
    RowReduction,
    add_to_rows,
    bias_correction,
    compute_dtype,
    ema_rows,
    gather,
    row_mean_square,
    write_rows,
)
from embshard_optim.specs import OptimizerSpec


def adam_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """``u`` of :func:`adam_direction`, then ``w -= lr * (u + wd * w)`` (unchecked)."""
    g = grad.to(compute_dtype(weight))
    _apply_decoupled(spec, weight, rows, adam_direction(spec, state, rows, g, step))


def partial_rowwise_adam_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """As :func:`adam_update` with a row-wise second moment (unchecked)."""
    g = grad.to(compute_dtype(weight))
    update = partial_rowwise_adam_direction(spec, state, rows, g, step, reduction)
    _apply_decoupled(spec, weight, rows, update)


def adam_direction(
    spec: OptimizerSpec, state: Mapping[str, Tensor], rows: Tensor, g: Tensor, step: int
) -> Tensor:
    """``m1 = beta1 * m1 + (1 - beta1) * g``, ``m2`` likewise with ``g**2``; return
    ``u = (m1 / bc1) / (sqrt(m2 / bc2) + eps)`` (Adam's and LAMB's direction)."""
    m1 = ema_rows(state["momentum1"], rows, spec.beta1, g)
    m2 = ema_rows(state["momentum2"], rows, spec.beta2, g * g)
    denominator = (m2 / bias_correction(spec.beta2, step)).sqrt_().add_(spec.eps)
    return m1 / bias_correction(spec.beta1, step) / denominator


def partial_rowwise_adam_direction(
    spec: OptimizerSpec,
    state: Mapping[str, Tensor],
    rows: Tensor,
    g: Tensor,
    step: int,
    reduction: RowReduction | None,
) -> Tensor:
    """As :func:`adam_direction` with ``m2`` row-wise, of ``mean(g**2)`` over the full row."""
    m2 = ema_rows(state["momentum2"], rows, spec.beta2, row_mean_square(g, reduction))
    denominator = (m2 / bias_correction(spec.beta2, step)).sqrt_().add_(spec.eps)
    m1 = ema_rows(state["momentum1"], rows, spec.beta1, g)
    return m1 / bias_correction(spec.beta1, step) / denominator[:, None]


def _apply_decoupled(spec: OptimizerSpec, weight: Tensor, rows: Tensor, update: Tensor) -> None:
    """``w[rows] -= lr * (update + weight_decay * w[rows])``."""
    if spec.weight_decay > 0.0:
        w = gather(weight, rows, update.dtype)
        write_rows(weight, rows, w - spec.learning_rate * (update + spec.weight_decay * w))
    else:
        add_to_rows(weight, rows, -(spec.learning_rate * update))
