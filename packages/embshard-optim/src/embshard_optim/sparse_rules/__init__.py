"""Plain-torch sparse update rules: FBGEMM's fused optimizers, restricted to the touched rows.

One update function per optimizer, following FBGEMM's kernel formulas, so CPU and CUDA training
agree; every plain-torch path calls these. ``rule_for(spec)`` wraps one in a checked
:class:`SparseRule`; ``aggregate`` sums per-id gradients per distinct row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embshard_optim.sorting import unique_with_inverse
from embshard_optim.sparse_rules.adagrad import adagrad_update, rowwise_adagrad_update
from embshard_optim.sparse_rules.adam import adam_update, partial_rowwise_adam_update
from embshard_optim.sparse_rules.base import SparseRule, SparseUpdateRule, UpdateFn, init_state
from embshard_optim.sparse_rules.lamb import lamb_update, partial_rowwise_lamb_update
from embshard_optim.sparse_rules.lars import lars_sgd_update
from embshard_optim.sparse_rules.sgd import sgd_update
from embshard_optim.specs import OptimizerSpec, OptimType

_UPDATES: dict[OptimType, UpdateFn] = {
    OptimType.SGD: sgd_update,
    OptimType.ADAGRAD: adagrad_update,
    OptimType.ROWWISE_ADAGRAD: rowwise_adagrad_update,
    OptimType.ADAM: adam_update,
    OptimType.PARTIAL_ROWWISE_ADAM: partial_rowwise_adam_update,
    OptimType.LAMB: lamb_update,
    OptimType.PARTIAL_ROWWISE_LAMB: partial_rowwise_lamb_update,
    OptimType.LARS_SGD: lars_sgd_update,
}


def rule_for(spec: OptimizerSpec) -> SparseRule:
    """The sparse update rule of ``spec``'s optimizer.

    Args:
        spec: the optimizer and hyperparameters.
    """
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(
            f"rule_for takes an OptimizerSpec, got {type(spec).__name__}; build one with "
            "OptimizerSpec.from_name(...) or OptimizerSpec.from_torch(...)"
        )
    return SparseRule(spec, _UPDATES[spec.optim_type])


def aggregate(ids: Tensor, grad_rows: Tensor) -> tuple[Tensor, Tensor]:
    """Sum the gradients of repeated ids: one row id and one summed gradient per distinct id.

    Args:
        ids: ``[n]`` integer row ids, repeats allowed.
        grad_rows: ``[n, dim]``, the gradient for each id.

    Returns:
        ``(rows, grads)``: sorted distinct int64 ids ``[m]`` and their summed gradients
        ``[m, dim]`` (in ``grad_rows``' dtype).

    Raises:
        ValueError: ``ids`` is not 1-D integer, or the lengths disagree.
    """
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
    if grad_rows.dim() != 2 or grad_rows.shape[0] != ids.shape[0]:
        raise ValueError(
            f"grad_rows must be [len(ids), dim] = [{ids.shape[0]}, dim], "
            f"got {list(grad_rows.shape)}"
        )
    rows, inverse = unique_with_inverse(ids.long())
    summed = grad_rows.new_zeros((rows.shape[0], grad_rows.shape[1]))
    summed.index_add_(0, inverse, grad_rows)
    return rows, summed


__all__ = [
    "SparseRule",
    "SparseUpdateRule",
    "UpdateFn",
    "adagrad_update",
    "adam_update",
    "aggregate",
    "init_state",
    "lamb_update",
    "lars_sgd_update",
    "partial_rowwise_adam_update",
    "partial_rowwise_lamb_update",
    "rowwise_adagrad_update",
    "rule_for",
    "sgd_update",
]
