"""Optimizers fused into a kernel's backward pass, and modules that own one.

A fused optimizer updates weights inside the kernel's backward; its ``step()`` and ``zero_grad()``
only push hyperparameter changes to the kernel, and its state is saved by name like any
``KeyedOptimizer``'s.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection
from typing import Protocol, runtime_checkable

from embshard_optim.keyed import KeyedOptimizer


class FusedOptimizer(KeyedOptimizer, abc.ABC):
    """A keyed optimizer whose update runs inside a kernel's backward pass."""

    @abc.abstractmethod
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Push pending hyperparameter changes to the kernel (the update already happened)."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Push pending hyperparameter changes to the kernel (there are no gradients)."""

    def init_state(self, sparse_grad_parameter_names: Collection[str] | None = None) -> None:
        """Nothing to do: a fused kernel allocates its optimizer state up front."""

    def set_optimizer_step(self, step: int) -> None:
        """Set the kernel's step counter (used for bias correction); no-op by default."""


class EmptyFusedOptimizer(FusedOptimizer):
    """A fused optimizer over nothing (for modules whose tables live elsewhere)."""

    def __init__(self) -> None:
        super().__init__({}, {}, [{"params": []}])

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing to update."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No gradients to reset."""


@runtime_checkable
class FusedOptimizerModule(Protocol):
    """A module that trains some of its parameters with a fused optimizer."""

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The optimizer fused into the module's backward pass."""
        ...
