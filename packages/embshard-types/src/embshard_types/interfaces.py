"""The interfaces sharders and planners implement (and, re-exported, ``ShardedModule``).

``ModuleSharder`` turns one kind of module into its ``ShardedModule`` and tells a planner what it
supports; ``ShardingPlanner`` produces the ``ShardingPlan``. Abstract methods stay abstract; the
defaults follow TorchRec's (data-parallel, the ``default`` kernel, HBM on accelerators, DDR on CPU).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sharded_module import (
    Multistreamable,
    NullShardedModuleContext,
    ShardedModule,
    ShardedModuleContext,
)
from embshard_types.vocab import ComputeKernel, ParameterStorage, ShardingType

if TYPE_CHECKING:
    from embshard_types.env import ShardingEnv
    from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

__all__ = [
    "ModuleSharder",
    "Multistreamable",
    "NullShardedModuleContext",
    "ShardedModule",
    "ShardedModuleContext",
    "ShardingPlanner",
    "get_tensor_size_bytes",
]


_PACKED_BITS = {torch.quint4x2: 4, torch.quint2x4: 2}


def get_tensor_size_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements occupy; ``quint4x2`` / ``quint2x4`` are counted packed."""
    bits = _PACKED_BITS.get(t.dtype)
    if bits is not None:
        return (t.numel() * bits + 7) // 8
    return t.numel() * t.element_size()


M = TypeVar("M", bound=nn.Module)

_STORAGE_OF_DEVICE = {
    "cuda": ParameterStorage.HBM,
    "mtia": ParameterStorage.HBM,
    "cpu": ParameterStorage.DDR,
}


class ModuleSharder(abc.ABC, Generic[M]):
    """Shards one kind of module and tells a planner which sharding options it supports.

    Args:
        qcomm_codecs_registry: codecs per ``CommOp`` value handed to the sharded modules.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @abc.abstractmethod
    def shard(
        self,
        module: M,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedModule[Any, Any, Any, Any]:
        """Build the sharded module, allocating the shards the plan puts on this rank.

        Args:
            params: the sharding of each of the module's tables.
            env: the ranks and process group to shard over.
            module_fqn: the module's fully qualified name (for trace annotations).
        """

    @property
    @abc.abstractmethod
    def module_type(self) -> type[M]:
        """The type of module this sharder shards."""

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs] | None:
        """The codecs per ``CommOp`` value, if any."""
        return self._qcomm_codecs_registry

    def shardable_parameters(self, module: M) -> dict[str, nn.Parameter]:
        """The parameters of ``module`` that can be sharded (default: all of them)."""
        return dict(module.named_parameters())

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """Sharding types supported on ``compute_device_type`` (default: data-parallel only)."""
        return [ShardingType.DATA_PARALLEL]

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """Kernels supported for ``sharding_type`` on ``compute_device_type`` (default: DEFAULT)."""
        return [ComputeKernel.DEFAULT]

    def storage_usage(
        self,
        tensor: torch.Tensor,
        compute_device_type: str,
        compute_kernel: ComputeKernel | str,
    ) -> dict[ParameterStorage, int]:
        """Memory ``tensor`` takes (default: all of it in the device's own memory).

        Raises:
            ValueError: an unknown device type or compute kernel.
        """
        ComputeKernel.parse(compute_kernel, what="storage_usage")
        storage = _STORAGE_OF_DEVICE.get(compute_device_type)
        if storage is None:
            raise ValueError(
                f"unknown compute device type {compute_device_type!r}; expected one of "
                f"{sorted(_STORAGE_OF_DEVICE)}"
            )
        return {storage: get_tensor_size_bytes(tensor)}


class ShardingPlanner(abc.ABC):
    """Decides how every shardable module of a model is sharded."""

    @abc.abstractmethod
    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan the sharding of ``module`` (one sharder per kind of module) on this process."""

    @abc.abstractmethod
    def collective_plan(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> ShardingPlan:
        """Plan on rank 0 and broadcast the plan, so that every rank uses the same one."""
