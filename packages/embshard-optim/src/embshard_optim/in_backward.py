"""Optimizers declared per parameter and applied in the backward, as torch and TorchRec do it.

:func:`apply_optimizer_in_backward` is torch's ``_apply_optimizer_in_backward`` (what TorchRec's
function of the same name calls): each parameter is marked with ``_optimizer_classes`` /
``_optimizer_kwargs`` and gets an optimizer stepped by a hook once its gradient is accumulated.
``DistributedModelParallel`` reads the marks of embedding tables and fuses that optimizer into the
sharded kernels (:func:`in_backward_spec`); classes it cannot fuse are refused, never ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from embshard_optim.specs import OptimizerSpec, OptimType

__all__ = [
    "FUSABLE_OPTIMIZERS",
    "apply_optimizer_in_backward",
    "in_backward_optimizer",
    "in_backward_optimizer_filter",
    "in_backward_spec",
]

FUSABLE_OPTIMIZERS = (
    "torch.optim.SGD (momentum 0), torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW, "
    "or a class named like a fused optimizer (RowWiseAdagrad, PartialRowWiseAdam, LAMB, "
    "PartialRowWiseLAMB, LarsSGD, as TorchRec's torchrec.optim classes are)"
)
"""What the fused embedding kernels can run, for error messages."""


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[nn.Parameter],
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Attach ``optimizer_class(**optimizer_kwargs)`` to each parameter, stepped in the backward.

    Same contract as torch's ``torch.distributed.optim._apply_optimizer_in_backward``: after
    ``backward()`` the parameter is updated and its ``.grad`` is ``None``; the class and kwargs
    are recorded on the parameter (``_optimizer_classes`` / ``_optimizer_kwargs``), which is
    what ``DistributedModelParallel`` fuses into sharded tables.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass, or a
            parameter is not a leaf ``nn.Parameter`` that requires grad.
        ValueError: a parameter already carries a fused optimizer (its collection was built
            with ``optimizer=``); declare the optimizer one way.
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"apply_optimizer_in_backward: optimizer_class must be a torch.optim.Optimizer "
            f"subclass, got {optimizer_class!r}"
        )
    params = list(params)
    for i, param in enumerate(params):
        if not isinstance(param, nn.Parameter) or not param.requires_grad:
            raise TypeError(
                f"apply_optimizer_in_backward: parameter {i} must be an nn.Parameter that "
                f"requires grad, got {type(param).__name__}"
            )
        if hasattr(param, "_in_backward_optimizers") and not hasattr(param, "_optimizer_classes"):
            raise ValueError(
                f"apply_optimizer_in_backward: parameter {i} (shape {tuple(param.shape)}) "
                "already has a fused optimizer (its collection was built with optimizer=...); "
                "build the collection without optimizer= or do not apply another one"
            )
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(optimizer_class, params, dict(optimizer_kwargs))


def in_backward_optimizer_filter(
    named_parameters: Iterable[tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[tuple[str, nn.Parameter]]:
    """The named parameters without an in-backward optimizer (``include=True``: only those with).

    Parameters of fused kernels (sharded or not) count as having one, so
    ``in_backward_optimizer_filter(model.named_parameters())`` is the dense part to optimize.
    """
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param


def in_backward_optimizer(
    param: nn.Parameter, where: str = "parameter"
) -> tuple[type, dict[str, Any]] | None:
    """The ``(class, kwargs)`` declared on ``param`` by :func:`apply_optimizer_in_backward`.

    Returns ``None`` when none was declared.

    Raises:
        ValueError: several optimizers were declared on the one parameter.
    """
    classes = list(getattr(param, "_optimizer_classes", ()))
    kwargs = list(getattr(param, "_optimizer_kwargs", ()))
    if not classes:
        return None
    if len(classes) != 1 or len(kwargs) != 1:
        names = [c.__name__ for c in classes]
        raise ValueError(
            f"{where}: apply_optimizer_in_backward was called {len(classes)} times on it "
            f"({names}); a fused embedding table runs one optimizer, apply exactly one"
        )
    return classes[0], dict(kwargs[0])


def in_backward_spec(param: nn.Parameter, where: str = "parameter") -> OptimizerSpec | None:
    """The fused optimizer spec of the optimizer declared on ``param`` (``None``: none declared).

    Raises:
        ValueError: the class or one of its arguments has no fused equivalent, naming the
            class, ``where`` and the classes that can be fused.
    """
    declared = in_backward_optimizer(param, where)
    if declared is None:
        return None
    cls, kwargs = declared
    try:
        return OptimizerSpec.from_torch(cls, **kwargs)
    except (ValueError, TypeError) as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(
            f"{where}: apply_optimizer_in_backward({cls.__module__}.{cls.__qualname__}, "
            f"{{{shown}}}) cannot be fused into an embedding kernel ({e}). Use one of "
            f"{FUSABLE_OPTIMIZERS}; optimizers embshard fuses: "
            f"{[k.value for k in OptimType]}"
        ) from None
