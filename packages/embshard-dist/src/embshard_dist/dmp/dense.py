"""The dense rest of a sharded model: data-parallel (DDP) and its optimizer.

DDP averages the dense gradients, the dense half of the 1/N rule; it never touches the sharded
sub-modules' parameters or buffers, and broadcasts rank 0's dense parameters at construction.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode
from embshard_types.env import ShardingEnv

__all__ = [
    "DataParallelWrapper",
    "DefaultDataParallelWrapper",
    "DenseOptimizerFactory",
    "default_dense_optimizer",
    "dense_named_parameters",
    "dense_optimizer_factory",
    "wrap_data_parallel",
]

DenseOptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def _inside(name: str, sharded: set[str]) -> bool:
    return any(p == "" or name.startswith(p + ".") for p in sharded)


def dense_named_parameters(model: nn.Module, sharded: set[str]) -> dict[str, nn.Parameter]:
    """Name -> parameter for the trainable parameters outside the sharded sub-modules, less
    those stepped in the backward (``apply_optimizer_in_backward``)."""
    return {
        name: p
        for name, p in model.named_parameters()
        if p.requires_grad
        and not _inside(name, sharded)
        and not hasattr(p, "_in_backward_optimizers")
    }


def meta_dense_names(model: nn.Module, sharded: set[str]) -> list[str]:
    """Names of the parameters and buffers outside ``sharded`` still on the ``meta`` device."""
    return [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if t.is_meta and not _inside(name, sharded)
    ]


def wrap_data_parallel(
    model: nn.Module, sharded: set[str], env: ShardingEnv, device: torch.device, **ddp_kwargs: Any
) -> nn.Module:
    """``model`` in a ``DistributedDataParallel`` that skips the sharded sub-modules.

    Returns ``model`` itself when it has no trainable dense parameter (DDP refuses such a
    model) or no process group; ``ddp_kwargs`` override the defaults.
    """
    trainable = [
        p for name, p in model.named_parameters() if p.requires_grad and not _inside(name, sharded)
    ]
    if env.process_group is None or not trainable:
        return model
    ignore = [
        name
        for name, _ in (*model.named_parameters(), *model.named_buffers())
        if _inside(name, sharded)
    ]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    options: dict[str, Any] = {"forward_sync_buffers": False, "gradient_as_bucket_view": True}
    options.update(ddp_kwargs)
    device_ids = None if device.type == "cpu" else [device]
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=env.process_group, **options
    )


class DataParallelWrapper(abc.ABC):
    """How ``DistributedModelParallel`` makes its dense rest data-parallel (TorchRec's interface).

    ``wrap`` sets ``dmp._dmp_wrapped_module`` to the wrapped model, as TorchRec's wrappers do.
    """

    @abc.abstractmethod
    def wrap(self, dmp: nn.Module, env: ShardingEnv, device: torch.device) -> None:
        """Wrap ``dmp.module`` (the model with its sharded sub-modules) for data parallelism."""


class DefaultDataParallelWrapper(DataParallelWrapper):
    """``DistributedDataParallel`` over the dense rest, skipping the sharded sub-modules.

    Args:
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``,
            ``static_graph``, ``find_unused_parameters``), over embshard's defaults.
    """

    def __init__(self, **ddp_kwargs: Any) -> None:
        self._ddp_kwargs = ddp_kwargs

    def wrap(self, dmp: nn.Module, env: ShardingEnv, device: torch.device) -> None:
        target: Any = dmp  # a DistributedModelParallel (not imported: it imports this module)
        sharded = set(cast(Mapping[str, nn.Module], target.sharded_modules))
        model = cast(nn.Module, target.module)
        target._dmp_wrapped_module = wrap_data_parallel(
            model, sharded, env, device, **self._ddp_kwargs
        )


def default_dense_optimizer(
    spec: OptimizerSpec,
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class and keyword arguments matching an embedding optimizer.

    Torch has no LAMB or LARS: they map to Adam/AdamW and SGD with momentum.
    """
    kind, lr = spec.optim_type, spec.learning_rate
    if kind is OptimType.SGD:
        return torch.optim.SGD, {"lr": lr}
    if kind is OptimType.LARS_SGD:
        return torch.optim.SGD, {
            "lr": lr,
            "momentum": spec.momentum,
            "weight_decay": spec.weight_decay,
        }
    if kind in (OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD):
        decay = spec.weight_decay if spec.weight_decay_mode is WeightDecayMode.L2 else 0.0
        return torch.optim.Adagrad, {"lr": lr, "eps": spec.eps, "weight_decay": decay}
    adam_kwargs = {"lr": lr, "betas": (spec.beta1, spec.beta2), "eps": spec.eps}
    if spec.weight_decay > 0.0:
        return torch.optim.AdamW, {**adam_kwargs, "weight_decay": spec.weight_decay}
    return torch.optim.Adam, adam_kwargs


def dense_optimizer_factory(
    dense_optimizer: type[torch.optim.Optimizer] | DenseOptimizerFactory | None,
    spec: OptimizerSpec,
) -> DenseOptimizerFactory:
    """What builds the dense optimizer.

    Args:
        dense_optimizer: ``None`` (the default for ``spec``), a ``torch.optim`` class (built
            with ``spec``'s learning rate), or a factory ``params -> optimizer``.
    """
    if dense_optimizer is None:
        cls, kwargs = default_dense_optimizer(spec)
        return lambda params: cls(params, **kwargs)
    if isinstance(dense_optimizer, type):
        if not issubclass(dense_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"dense_optimizer must be a torch.optim.Optimizer class or a factory, got "
                f"{dense_optimizer.__name__}"
            )
        opt_cls: Any = dense_optimizer
        return lambda params: opt_cls(params, lr=spec.learning_rate)
    if not callable(dense_optimizer):
        raise TypeError(
            f"dense_optimizer must be a torch.optim.Optimizer class or a factory "
            f"params -> optimizer, got {dense_optimizer!r}"
        )
    return dense_optimizer
