"""What the collection sharders (embedding bags and sequence embeddings) check and answer alike.

The two sharders differ only in their module type, the name their module registers its weights
under (``embedding_bags`` / ``embeddings``) and their strategy registry; the pieces here take
those as arguments.

Guarantees: every check raises before anything is built, with a message saying what to pass
instead.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from torch import nn

from embshard_dist.sharded.embedding_bag import supported_kernels
from embshard_kernels.fused_params import FusedParams
from embshard_optim.specs import OptimizerSpec
from embshard_types.vocab import ComputeKernel, ShardingType

DEVICE_TYPES = ("cpu", "cuda")
"""The compute device types the sharders know."""


def check_options(optimizer: object, fused_params: object) -> None:
    """Raise unless the sharder's ``optimizer`` and ``fused_params`` have their types.

    Raises:
        TypeError: either is given with another type.
    """
    if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
        raise TypeError(
            f"optimizer must be an OptimizerSpec, got {type(optimizer).__name__}; build one "
            "with OptimizerSpec.from_name(...) or OptimizerSpec.from_torch(...)"
        )
    if fused_params is not None and not isinstance(fused_params, FusedParams):
        raise TypeError(
            f"fused_params must be FusedParams, got {type(fused_params).__name__}; "
            "convert a dict with FusedParams.from_dict(...)"
        )


def check_device(device_type: str) -> None:
    """Raise a ``ValueError`` unless ``device_type`` is one of :data:`DEVICE_TYPES`."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"unknown compute device type {device_type!r}; expected one of {list(DEVICE_TYPES)}"
        )


def table_weights(module: nn.Module, attr: str) -> dict[str, nn.Parameter]:
    """Table name -> its weight, for the module's parameters ``{attr}.{table}.weight``."""
    prefix = f"{attr}."
    return {
        name[len(prefix) : -len(".weight")]: p
        for name, p in module.named_parameters()
        if name.startswith(prefix) and name.endswith(".weight")
    }


def sharding_types_on(device_type: str, strategies: Iterable[ShardingType]) -> list[ShardingType]:
    """The sharding types of ``strategies`` (the same on every known device type).

    Raises:
        ValueError: an unknown device type.
    """
    check_device(device_type)
    return list(strategies)


def kernels_on(
    sharding_type: ShardingType | str,
    device_type: str,
    strategies: Container[ShardingType],
) -> list[ComputeKernel]:
    """The kernels a strategy of ``strategies`` runs on ``device_type`` (none for another type).

    Raises:
        ValueError: an unknown device type or sharding type.
    """
    check_device(device_type)
    kind = ShardingType.parse(sharding_type, what="compute_kernels")
    if kind not in strategies:
        return []
    return supported_kernels(kind, device_type)
