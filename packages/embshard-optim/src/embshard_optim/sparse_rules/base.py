"""Shared pieces of the sparse update rules: the rule protocol, state creation, checks, row I/O.

A rule changes only the touched rows of a table and their optimizer state, as FBGEMM's fused
backward does. ``SparseRule.apply`` checks every argument before writing anything; the update
functions it calls compute in float32 (float64 for float64 tables), read rows with
``index_select`` and write them with ``index_copy_`` / ``scatter_add_`` / ``index_add_``.
A :class:`RowReduction` gives a column shard the row-wise statistics of the full rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from embshard_optim.specs import OptimizerSpec


@runtime_checkable
class SparseUpdateRule(Protocol):
    """An optimizer's update restricted to the touched rows of one table."""

    @property
    def spec(self) -> OptimizerSpec:
        """The optimizer and hyperparameters this rule applies."""
        ...

    def init_state(
        self,
        num_rows: int,
        dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> dict[str, Tensor]:
        """Zero optimizer state for a ``[num_rows, dim]`` table, keyed by ``spec.state_names()``."""
        ...

    def apply(
        self,
        weight: Tensor,
        state: Mapping[str, Tensor],
        rows: Tensor,
        grad: Tensor,
        step: int,
        *,
        check_bounds: bool = True,
        reduction: RowReduction | None = None,
    ) -> None:
        """Update ``rows`` of ``weight`` and ``state`` in place (see :meth:`SparseRule.apply`)."""
        ...


UpdateFn = Callable[[OptimizerSpec, Tensor, Mapping[str, Tensor], Tensor, Tensor, int], None]
"""``update(spec, weight, state, rows, grad, step, *, reduction=None)``: one optimizer's math."""


@dataclass(frozen=True)
class RowReduction:
    """How to complete row-wise statistics when a table's columns are split across shards.

    Args:
        row_sum: per-row partial sums over this shard's columns (``[rows]`` or ``[rows, k]``)
            -> sums over the full rows; every column shard must get the same result.
        full_dim: the width of the full rows (the divisor of row means).
    """

    row_sum: Callable[[Tensor], Tensor]
    full_dim: int

    def __post_init__(self) -> None:
        if isinstance(self.full_dim, bool) or not isinstance(self.full_dim, int):
            raise TypeError(f"RowReduction.full_dim must be an int, got {self.full_dim!r}")
        if self.full_dim < 1:
            raise ValueError(f"RowReduction.full_dim must be positive, got {self.full_dim}")
        if not callable(self.row_sum):
            raise TypeError(f"RowReduction.row_sum must be callable, got {self.row_sum!r}")


@dataclass(frozen=True)
class SparseRule:
    """A :class:`SparseUpdateRule`: a spec and its optimizer's (unchecked) update function,
    called by ``apply`` after checking the arguments."""

    spec: OptimizerSpec
    update: UpdateFn

    def init_state(
        self,
        num_rows: int,
        dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> dict[str, Tensor]:
        """Zero state keyed by ``spec.state_names()`` (see :func:`init_state`)."""
        return init_state(self.spec, num_rows, dim, dtype=dtype, device=device)

    def apply(
        self,
        weight: Tensor,
        state: Mapping[str, Tensor],
        rows: Tensor,
        grad: Tensor,
        step: int,
        *,
        check_bounds: bool = True,
        reduction: RowReduction | None = None,
    ) -> None:
        """Check the arguments, then update ``rows`` of ``weight`` and ``state`` in place.

        Args:
            rows: distinct row ids (``aggregate`` sums repeated ones).
            grad: ``[len(rows), dim]``, the summed gradient of each row.
            step: 1-based number of this update (Adam / LAMB bias correction).
            check_bounds: check that every row id is in range.
            reduction: completes row-wise statistics of a column shard (``None``: full rows).

        Raises:
            ValueError / TypeError / IndexError: bad arguments, before anything is written.
        """
        rows = check_update(self.spec, weight, state, rows, grad, step, check_bounds=check_bounds)
        if reduction is not None and reduction.full_dim < weight.shape[1]:
            raise ValueError(
                f"{self.spec.optim_type.name} sparse update: reduction.full_dim "
                f"{reduction.full_dim} is narrower than the shard's {weight.shape[1]} columns"
            )
        if rows.numel() > 0:
            with torch.no_grad():  # weights may be Parameters; the update is not differentiated
                if reduction is None:
                    self.update(self.spec, weight, state, rows, grad, step)
                else:
                    update: Any = self.update
                    update(self.spec, weight, state, rows, grad, step, reduction=reduction)


def init_state(
    spec: OptimizerSpec,
    num_rows: int,
    dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """Zero state for ``spec``: row-wise states are ``[num_rows]``, point-wise ``[num_rows, dim]``.

    Raises:
        ValueError: a negative size or a non-floating dtype.
    """
    if num_rows < 0 or dim < 0:
        raise ValueError(f"table size must be non-negative, got [{num_rows}, {dim}]")
    if not dtype.is_floating_point:
        raise ValueError(f"optimizer state must be floating point, got {dtype}")
    return {
        name: torch.zeros(
            (num_rows,) if spec.state_is_rowwise(name) else (num_rows, dim),
            dtype=dtype,
            device=device,
        )
        for name in spec.state_names()
    }


def check_update(
    spec: OptimizerSpec,
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    step: int,
    *,
    check_bounds: bool,
) -> Tensor:
    """Validate the arguments of ``apply`` and return ``rows`` as int64.

    Raises:
        ValueError / TypeError / IndexError: naming the argument, what was expected and got.
    """
    where = f"{spec.optim_type.name} sparse update"
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"{where}: weight must be a 2-D floating tensor, got {weight.dtype} "
            f"of shape {list(weight.shape)}"
        )
    num_rows, dim = weight.shape
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{where}: rows must be a 1-D int64 tensor, got {rows.dtype} of shape "
            f"{list(rows.shape)}"
        )
    if tuple(grad.shape) != (rows.numel(), dim) or not grad.is_floating_point():
        raise ValueError(
            f"{where}: grad must be a floating tensor of shape [len(rows), dim] = "
            f"[{rows.numel()}, {dim}], got {grad.dtype} of shape {list(grad.shape)}"
        )
    if rows.device != weight.device or grad.device != weight.device:
        raise ValueError(
            f"{where}: weight ({weight.device}), rows ({rows.device}) and grad "
            f"({grad.device}) must be on one device"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(
            f"{where}: step must be an int >= 1 (1 for the first update), got {step!r}"
        )
    expected = spec.state_names()
    if set(state) != set(expected):
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        raise ValueError(
            f"{where}: state keys {sorted(state)} do not match {list(expected)} "
            f"(missing {missing}, unexpected {extra}); build state with rule.init_state()"
        )
    for name in expected:
        tensor = state[name]
        shape = (num_rows,) if spec.state_is_rowwise(name) else (num_rows, dim)
        if tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise ValueError(
                f"{where}: state {name!r} must be a floating tensor of shape {list(shape)}, "
                f"got {tensor.dtype} of shape {list(tensor.shape)}"
            )
        if tensor.device != weight.device:
            raise ValueError(
                f"{where}: state {name!r} is on {tensor.device}, weight on {weight.device}"
            )
    if check_bounds and rows.numel() > 0:
        low, high = (int(v) for v in torch.aminmax(rows))
        if low < 0 or high >= num_rows:
            raise IndexError(
                f"{where}: row ids must lie in [0, {num_rows}), got ids from {low} to {high}"
            )
    return rows if rows.dtype == torch.int64 else rows.long()


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the update is computed in: float64 for float64 tables, else float32."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def gather(tensor: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor[rows]`` (a copy) in ``dtype``."""
    return tensor.index_select(0, rows).to(dtype)


def write_rows(tensor: Tensor, rows: Tensor, values: Tensor) -> None:
    """``tensor[rows] = values`` through ``index_copy_`` (rounding to ``tensor``'s dtype)."""
    tensor.index_copy_(0, rows, values.to(tensor.dtype))


def add_to_rows(tensor: Tensor, rows: Tensor, delta: Tensor) -> None:
    """``tensor[rows] += delta`` in place (rounding to ``tensor``'s dtype)."""
    if tensor.dtype == delta.dtype and delta.dim() == 2:
        # scatter_add_ with the row index broadcast over the columns beats index_add_ here
        tensor.scatter_add_(0, rows.unsqueeze(1).expand_as(delta), delta)
    elif tensor.dtype == delta.dtype:
        tensor.index_add_(0, rows, delta)
    else:
        write_rows(tensor, rows, gather(tensor, rows, delta.dtype) + delta)


def ema_rows(tensor: Tensor, rows: Tensor, beta: float, value: Tensor) -> Tensor:
    """``tensor[rows] = beta * tensor[rows] + (1 - beta) * value``; the new rows in ``value``'s
    dtype."""
    new = gather(tensor, rows, value.dtype).mul_(beta).add_(value, alpha=1.0 - beta)
    write_rows(tensor, rows, new)
    return new


def bias_correction(beta: float, step: int) -> float:
    """Adam's ``1 - beta**step``."""
    return 1.0 - beta**step


def row_norm(values: Tensor) -> Tensor:
    """The L2 norm of each row of a 2-D tensor."""
    return torch.linalg.vector_norm(values, dim=1)


def row_mean_square(values: Tensor, reduction: RowReduction | None = None) -> Tensor:
    """``mean(values**2)`` of each row; over the full rows when ``reduction`` is given."""
    if reduction is None:
        return (values * values).mean(dim=1)
    return reduction.row_sum((values * values).sum(dim=1)) / reduction.full_dim


def row_norms(*values: Tensor, reduction: RowReduction | None = None) -> tuple[Tensor, ...]:
    """The L2 norm of each row of each of ``values`` (full rows with ``reduction``, summed in
    one call of ``reduction.row_sum``)."""
    if reduction is None:
        return tuple(row_norm(v) for v in values)
    partial = torch.stack([(v * v).sum(dim=1) for v in values], dim=1)
    return tuple(reduction.row_sum(partial).sqrt().unbind(dim=1))


def safe_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, and 0 where the denominator is 0 (instead of inf / nan)."""
    zero = torch.zeros((), dtype=numerator.dtype, device=numerator.device)
    return torch.where(denominator > 0, numerator / denominator, zero)
