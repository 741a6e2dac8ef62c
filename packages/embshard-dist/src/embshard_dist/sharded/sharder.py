"""The one generic sharder of embedding collections, :class:`CollectionSharder`.

A :class:`CollectionKind` says what differs between collections; ``shard`` checks the plan
before anything is built or any rank contacted, then ``build``s.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from embshard_dist.sharded.plan_checks import check_module_plan
from embshard_dist.strategies.nodes import env_local_world_size, resolve_local_world_size
from embshard_kernels.fused_params import FusedParams
from embshard_optim.specs import OptimizerSpec
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.configs import BaseEmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ModuleSharder, ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = ["DEVICE_TYPES", "CollectionKind", "CollectionSharder", "supported_kernels"]

DEVICE_TYPES = ("cpu", "cuda")

_CPU_KERNELS: dict[ShardingType, tuple[ComputeKernel, ...]] = {
    ShardingType.DATA_PARALLEL: (ComputeKernel.FUSED,),
    **{
        kind: (ComputeKernel.FUSED, ComputeKernel.DENSE)
        for kind in (
            ShardingType.TABLE_WISE,
            ShardingType.ROW_WISE,
            ShardingType.COLUMN_WISE,
            ShardingType.TABLE_ROW_WISE,
            ShardingType.TABLE_COLUMN_WISE,
            ShardingType.GRID_SHARD,
        )
    },
}
_CUDA_ONLY = (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)

M = TypeVar("M", bound=nn.Module)


def supported_kernels(sharding_type: ShardingType, device_type: str) -> list[ComputeKernel]:
    """The compute kernels the strategies run for ``sharding_type`` on ``device_type``."""
    kernels = list(_CPU_KERNELS.get(sharding_type, ()))
    if device_type == "cuda" and ComputeKernel.FUSED in kernels:
        kernels[1:1] = _CUDA_ONLY
    return kernels


@dataclass(frozen=True)
class CollectionKind:
    """What a sharder needs to know of one kind of embedding collection.

    Args:
        weights_attr: the attribute its table weights live under (``{attr}.{table}.weight``).
        node_aware: whether it takes ``local_world_size`` (the node-aware sharding types).
    """

    module_type: type[nn.Module]
    weights_attr: str
    strategies: Mapping[ShardingType, type]
    sharded_type: Callable[..., Any]
    configs: Callable[[Any], Sequence[BaseEmbeddingConfig]]
    node_aware: bool = False


class CollectionSharder(ModuleSharder[M]):
    """Shards the collections of :attr:`kind`, which subclasses set.

    Args:
        optimizer: the fused optimizer (default: that of ``fused_params``, else the module's).
        local_world_size: ranks per node, only for collections with node-aware types.

    Raises:
        TypeError: ``optimizer`` or ``fused_params`` of another type.
        ValueError: ``local_world_size`` not a positive int, or given for a collection without
            node-aware sharding types.
    """

    kind: ClassVar[CollectionKind]

    def __init__(
        self,
        optimizer: OptimizerSpec | None = None,
        fused_params: FusedParams | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        local_world_size: int | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
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
        if local_world_size is not None:
            if not self.kind.node_aware:
                raise ValueError(
                    f"{type(self).__name__} takes no local_world_size: "
                    f"{self.kind.module_type.__name__} has no node-aware sharding types"
                )
            resolve_local_world_size(local_world_size, local_world_size)
        self._optimizer = optimizer
        self._fused_params = fused_params
        self._local_world_size = local_world_size

    @property
    def optimizer(self) -> OptimizerSpec | None:
        return self._optimizer

    def with_optimizer(self, optimizer: OptimizerSpec | None) -> CollectionSharder[M]:
        """A new sharder of the same class and options that fuses ``optimizer`` instead.

        ``self`` is left unchanged (DMP gives each module the optimizer its tables declared
        with ``apply_optimizer_in_backward`` this way).

        Raises:
            TypeError: ``optimizer`` is not an ``OptimizerSpec`` (or ``None``).
        """
        if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
            raise TypeError(
                f"{type(self).__name__}.with_optimizer takes an OptimizerSpec, got "
                f"{type(optimizer).__name__}; build one with OptimizerSpec.from_torch(...)"
            )
        # A shallow copy keeps every option, including those of subclasses' constructors.
        clone = copy.copy(self)
        clone._optimizer = optimizer
        return clone

    @property
    def fused_params(self) -> FusedParams | None:
        return self._fused_params

    @property
    def module_type(self) -> type[M]:
        return self.kind.module_type  # type: ignore[return-value]

    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
        path: str = "",
    ) -> ShardedModule[Any, Any, Any, Any]:
        """Check the module's plan, then build its sharded form.

        Raises:
            TypeError / ValueError: wrong module type, or the plan does not fit (on every rank,
                before any collective).
        """
        where = path or module_fqn or ""
        self._check_type(module, where)
        device_type = torch.device(device).type if device is not None else "cpu"
        self.check_plan(module, params, env, device_type, where)
        return self.build(module, params, env, device, where)

    def build(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        path: str = "",
    ) -> ShardedModule[Any, Any, Any, Any]:
        """Build the sharded collection for a plan already checked by :meth:`check_plan`."""
        self._check_type(module, path)
        node = {"local_world_size": self._local_world_size} if self.kind.node_aware else {}
        return self.kind.sharded_type(
            module,
            params,
            env,
            device,
            optimizer=self._optimizer,
            fused_params=self._fused_params,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            path=path,
            **node,
        )

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        prefix = f"{self.kind.weights_attr}."
        return {
            name[len(prefix) : -len(".weight")]: p
            for name, p in module.named_parameters()
            if name.startswith(prefix) and name.endswith(".weight")
        }

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """The sharding types this collection's strategies serve.

        Raises:
            ValueError: an unknown device type.
        """
        _check_device(compute_device_type)
        return list(self.kind.strategies)

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """Kernels the sharded collection runs for ``sharding_type`` on the device.

        Raises:
            ValueError: an unknown device type or sharding type.
        """
        _check_device(compute_device_type)
        kind = ShardingType.parse(sharding_type, what="compute_kernels")
        if kind not in self.kind.strategies:
            return []
        return supported_kernels(kind, compute_device_type)

    def check_plan(
        self,
        module: M,
        params: Any,
        env: ShardingEnv,
        device_type: str,
        path: str = "",
    ) -> None:
        """Raise unless ``params`` can shard ``module`` over ``env`` on ``device_type``.

        Raises:
            TypeError: ``params`` is not an ``EmbeddingModuleShardingPlan``.
            ValueError: the first problem, naming the module path and the table.
        """
        _check_device(device_type)
        check_module_plan(
            self.kind.configs(module),
            params,
            env.world_size,
            device_type,
            path=path,
            sharding_types=self.sharding_types(device_type),
            compute_kernels=lambda kind: self.compute_kernels(kind, device_type),
            module_kind=self.kind.module_type.__name__,
            local_world_size=(
                env_local_world_size(env, self._local_world_size) if self.kind.node_aware else None
            ),
        )

    def _check_type(self, module: nn.Module, path: str) -> None:
        if not isinstance(module, self.kind.module_type):
            raise TypeError(
                f"{type(self).__name__} shards {self.kind.module_type.__name__} modules, got "
                f"{type(module).__name__} at {path or 'the root'!r}"
            )


def _check_device(device_type: str) -> None:
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"unknown compute device type {device_type!r}; expected one of {list(DEVICE_TYPES)}"
        )
