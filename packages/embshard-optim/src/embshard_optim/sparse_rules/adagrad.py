"""Adagrad and row-wise Adagrad on the touched rows of a table.

``adagrad_update`` follows FBGEMM's ``EXACT_ADAGRAD`` (codegen ``adagrad()``): point-wise state
``m += g**2``, then ``w -= lr * g / (sqrt(m) + eps)``; no weight decay.

``rowwise_adagrad_update`` follows FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (codegen
``rowwise_adagrad()``), one state value per row:

- ``L2`` decay: ``g' = g + wd * w``, else ``g' = g``;
- ``m += mean(g'**2)`` over the row; ``mult = lr / (sqrt(m) + eps)``;
- ``w = c * w - mult * g`` with ``c = 1 - mult * wd`` (``L2``), ``1 - lr * wd`` (``DECOUPLED``),
  else ``1``;
- then, when ``max_norm > 0``, a row whose norm exceeds ``max_norm`` is scaled down to it (the
  CUDA kernel's post-update; FBGEMM's CPU kernel ignores ``max_norm``).
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
    """FBGEMM ``EXACT_ADAGRAD`` on ``rows`` (unchecked; see ``SparseRule``; point-wise, so
    ``reduction`` is not needed)."""
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
) -> None:
    """FBGEMM ``EXACT_ROWWISE_ADAGRAD`` on ``rows`` (unchecked; see ``SparseRule``)."""
    dtype = compute_dtype(weight)
    g = grad.to(dtype)
    lr, decay = spec.learning_rate, spec.weight_decay
    mode = spec.weight_decay_mode if decay > 0.0 else WeightDecayMode.NONE
    needs_weight = mode is not WeightDecayMode.NONE or spec.max_norm > 0.0
    w = gather(weight, rows, dtype) if needs_weight else None

    g_decayed = g + decay * w if w is not None and mode is WeightDecayMode.L2 else g
    momentum = state["momentum1"]
    add_to_rows(momentum, rows, row_mean_square(g_decayed, reduction).to(momentum.dtype))
    multiplier = lr / (gather(momentum, rows, dtype).sqrt_() + spec.eps)

    if w is None:
        add_to_rows(weight, rows, -(multiplier[:, None] * g))
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
