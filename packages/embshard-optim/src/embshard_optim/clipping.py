"""Gradient clipping before a keyed optimizer's step, with norms taken across sharded parameters.

``VALUE`` clamps each element; ``NORM`` scales as ``clip_grad_norm_`` does with the norm of the
whole unsharded model (sharded gradients reduced over the process group, replicated ones counted
once), so every rank must call ``step``. The result equals clipping the unsharded model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from enum import unique
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from embshard_optim.keyed import KeyedOptimizer, OptimizerWrapper
from embshard_optim.state_io import loaded_type
from embshard_types.vocab import ParsableEnum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@unique
class GradientClipping(ParsableEnum):
    """What to clip."""

    NONE = "none"
    NORM = "norm"
    VALUE = "value"


class GradientClippingOptimizer(OptimizerWrapper):
    """Clip gradients, then step the wrapped optimizer.

    Args:
        optimizer: the optimizer to wrap.
        clipping: ``NORM``, ``VALUE`` or ``NONE``.
        max_gradient: the largest norm (``NORM``) or absolute value (``VALUE``).
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        sharded_params: names of plain-tensor parameters that hold only this rank's shard.
        pg: the process group over which sharded gradients are reduced (``None``: default).

    Raises:
        ValueError: an unknown name in ``sharded_params``, or a non-positive ``max_gradient``.
    """

    def __init__(
        self,
        optimizer: KeyedOptimizer,
        clipping: GradientClipping | str = GradientClipping.NONE,
        max_gradient: float = 0.1,
        norm_type: float = 2.0,
        *,
        sharded_params: Collection[str] = (),
        pg: ProcessGroup | None = None,
    ) -> None:
        super().__init__(optimizer)
        self._clipping = GradientClipping.parse(clipping, what="GradientClippingOptimizer")
        if max_gradient <= 0:
            raise ValueError(f"max_gradient must be positive, got {max_gradient}")
        self._max_gradient = float(max_gradient)
        self._norm_type = float(norm_type)
        self._pg = pg
        unknown = sorted(set(sharded_params) - set(self.params))
        if unknown:
            raise ValueError(f"sharded_params names unknown parameters {unknown}")
        self._sharded_ids = {id(self.params[name]) for name in sharded_params}
        self._sharded_ids |= {
            id(p) for p in self.params.values() if p.requires_grad and _is_sharded_dtensor(p)
        }

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Clip the gradients, then step the wrapped optimizer."""
        grads = [
            (p.grad, id(p) in self._sharded_ids)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if self._clipping is GradientClipping.VALUE:
            for grad, _ in grads:
                _local(grad).clamp_(-self._max_gradient, self._max_gradient)
        elif self._clipping is GradientClipping.NORM:
            total = self.total_norm(grads)
            scale = (self._max_gradient / (total + 1e-6)).clamp(max=1.0)
            for grad, _ in grads:
                local = _local(grad)
                local.mul_(scale.to(local.dtype))
        return super().step(closure)

    def total_norm(self, grads: list[tuple[Tensor, bool]]) -> Tensor:
        """The norm of all gradients of the unsharded model (one collective when sharded).

        Args:
            grads: ``(gradient, is_sharded)`` pairs.
        """
        p = self._norm_type
        replicated = [_local(g).float() for g, sharded in grads if not sharded]
        sharded = [_local(g).float() for g, is_sharded in grads if is_sharded]
        parts = torch.zeros(2)  # (replicated, sharded) contribution
        for index, tensors in enumerate((replicated, sharded)):
            norms = [torch.linalg.vector_norm(t, p).cpu() for t in tensors]
            if norms:
                stacked = torch.stack(norms)
                parts[index] = stacked.max() if p == float("inf") else stacked.pow(p).sum()
        if self._sharded_ids:
            import torch.distributed as dist

            op = dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM
            shard_part = parts[1:2].clone()
            dist.all_reduce(shard_part, op=op, group=self._pg)
            parts[1] = shard_part[0]
        if p == float("inf"):
            return parts.max()
        return parts.sum().pow(1.0 / p)


def _is_sharded_dtensor(value: Tensor) -> bool:
    dtensor = loaded_type("torch.distributed.tensor", "DTensor")
    if dtensor is None or not isinstance(value, dtensor):
        return False
    from torch.distributed.tensor import Replicate

    return any(not isinstance(p, Replicate) for p in value.placements)  # type: ignore[attr-defined]


def _local(grad: Tensor) -> Tensor:
    """The local part of a gradient (``DTensor.to_local()``, or the tensor itself)."""
    dtensor = loaded_type("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(grad, dtensor):
        return grad.to_local()  # type: ignore[attr-defined]
    return grad
