"""Adagrad and row-wise Adagrad on the touched rows of a table (FBGEMM's ``EXACT_ADAGRAD`` and
``EXACT_ROWWISE_ADAGRAD``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from embshard_optim.sparse_rules.base import (
    RowReduction,
    add_to_rows,
    compute_dtype,
    gather,
    row_mean_square,
    row_norms,
    write_rows,
)
from embshard_optim.specs import OptimizerSpec, WeightDecayMode


def adagrad_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
) -> None:
    """``m += g**2``, ``w -= lr * g / (sqrt(m) + eps)`` point-wise (unchecked; see ``SparseRule``)."""
    dtype = compute_dtype(weight)
    g = grad.to(dtype)
    momentum = state["momentum1"]
    add_to_rows(momentum, rows, (g * g).to(momentum.dtype))
    denominator = gather(momentum, rows, dtype).sqrt_().add_(spec.eps)
    add_to_rows(weight, rows, -(spec.learning_rate * g / denominator))


def rowwise_adagrad_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    reduction: RowReduction | None = None,
    mean_square: Tensor | None = None,
    consume_grad: bool = False,
) -> None:
    """Row-wise Adagrad on ``rows`` (unchecked; see ``SparseRule``).

    ``g' = g + wd * w`` under ``L2`` decay; ``m += mean(g'**2)``; ``mult = lr / (sqrt(m) + eps)``;
    ``w = c * w - mult * g`` with ``c`` ``1 - mult * wd`` (``L2``), ``1 - lr * wd`` (``DECOUPLED``)
    or 1; then rows longer than ``max_norm > 0`` are scaled down to it (FBGEMM's CUDA post-update).

    Args:
        mean_square: each row's mean of ``g**2`` over the full row, if the caller has it
            (ignored under ``L2`` decay, whose statistic is of the decayed gradient).
        consume_grad: ``grad`` may be overwritten (saves a copy).
    """
    dtype = compute_dtype(weight)
    g = grad.to(dtype)
    lr, decay = spec.learning_rate, spec.weight_decay
    mode = spec.weight_decay_mode if decay > 0.0 else WeightDecayMode.NONE
    needs_weight = mode is not WeightDecayMode.NONE or spec.max_norm > 0.0
    w = gather(weight, rows, dtype) if needs_weight else None

    g_decayed = g + decay * w if w is not None and mode is WeightDecayMode.L2 else g
    if mean_square is None or g_decayed is not g:
        mean_square = row_mean_square(g_decayed, reduction)
    momentum = state["momentum1"]
    add_to_rows(momentum, rows, mean_square.to(momentum.dtype))
    multiplier = lr / (gather(momentum, rows, dtype).sqrt_() + spec.eps)

    if w is None:
        step_size = multiplier.neg_().unsqueeze(1)
        add_to_rows(weight, rows, g.mul_(step_size) if consume_grad else g * step_size)
        return
    if mode is WeightDecayMode.L2:
        new = (1.0 - multiplier * decay)[:, None] * w - multiplier[:, None] * g
    elif mode is WeightDecayMode.DECOUPLED:
        new = (1.0 - lr * decay) * w - multiplier[:, None] * g
    else:
        new = w - multiplier[:, None] * g
    if spec.max_norm > 0.0:
        # max_norm / norm is inf for a zero row and clamps to 1 (left as is).
        scale = (spec.max_norm / row_norms(new, reduction=reduction)[0]).clamp_(max=1.0)
        new = new * scale[:, None]
    write_rows(weight, rows, new)
