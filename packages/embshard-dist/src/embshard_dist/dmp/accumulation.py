"""Gradient accumulation over a sharded model: :func:`no_sync` and the check of ``k``.

Inside :func:`no_sync` every fused kernel of the model keeps its row gradients instead of
updating (:func:`embshard_kernels.accumulate.defer_sparse_updates`) and DDP keeps the dense
gradients local (``DistributedDataParallel.no_sync``). The backward of the first forward taken
outside then applies each kernel's kept gradients and its own in one fused step (row-gradient
exchanges and other collectives of the update run then, once) and all-reduces the summed dense
gradients once. So ``k`` micro-batches with losses ``L_1 .. L_k`` give the step of one batch
made of all of them with loss ``L_1 + ... + L_k`` (divide each by ``k`` for the mean): exactly
for SGD's sparse update, up to float rounding for the adaptive rules and the dense optimizer.
Every rank must run the same micro-batches inside and outside the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from embshard_kernels.accumulate import defer_sparse_updates, grad_accumulations

__all__ = [
    "check_accumulate_grad_batches",
    "check_applied",
    "data_parallel_modules",
    "no_sync",
]


def check_accumulate_grad_batches(value: object, where: str) -> int:
    """``value`` as a count of micro-batches per optimizer step.

    Raises:
        ValueError: not an int, or below 1 (``where`` names the option).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{where}: accumulate_grad_batches must be an int >= 1 (micro-batches per optimizer "
            f"step), got {value!r}"
        )
    if value < 1:
        raise ValueError(
            f"{where}: accumulate_grad_batches must be >= 1 (micro-batches per optimizer step), "
            f"got {value}; use 1 for no accumulation"
        )
    return value


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Inside: ``model``'s fused kernels keep their gradients and DDP does not all-reduce.

    Wrap the forward and backward of every micro-batch but the last of each optimizer step; see
    the module docstring. Contexts nest.

    Raises:
        ValueError: the model holds key-value tables, which cannot keep gradients (before
            anything changes).
    """
    with ExitStack() as stack:
        stack.enter_context(defer_sparse_updates(model))
        for ddp in data_parallel_modules(model):
            stack.enter_context(ddp.no_sync())
        yield


def data_parallel_modules(model: nn.Module) -> list[DistributedDataParallel]:
    """The DDP modules inside ``model`` (a ``DistributedModelParallel``'s dense wrapper)."""
    return [sub for sub in model.modules() if isinstance(sub, DistributedDataParallel)]


def check_applied(model: nn.Module, what: str) -> None:
    """Raise unless every fused kernel of ``model`` has applied its kept gradients.

    Raises:
        RuntimeError: a kernel holds gradients of micro-batches (``what`` says what was tried).
    """
    for accumulation in grad_accumulations(model):
        accumulation.check_applied(what)
