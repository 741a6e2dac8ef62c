"""EmbeddingBagCollectionSharder: shards an EmbeddingBagCollection and tells planners what it can.

Guarantees: ``sharding_types`` and ``compute_kernels`` list only what
:class:`~embshard_dist.sharded.embedding_bag.ShardedEmbeddingBagCollection` runs on the device
(data-parallel, table-, row- and column-wise, and the node-aware table-row-wise,
table-column-wise and grid; fused kernels, dense ones except for data-parallel tables, UVM
kernels on CUDA only); ``check_plan`` raises a ``ValueError`` naming
the table for any plan the sharded module would refuse, and ``shard`` runs it before building
anything or contacting any rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from embshard_dist.sharded.embedding_bag import STRATEGIES, ShardedEmbeddingBagCollection
from embshard_dist.sharders._common import (
    check_device,
    check_options,
    kernels_on,
    sharding_types_on,
    table_weights,
)
from embshard_dist.sharders.plan_checks import check_plan
from embshard_dist.sharding.nodes import env_local_world_size, resolve_local_world_size
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.fused_params import FusedParams
from embshard_optim.specs import OptimizerSpec
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ModuleSharder
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType


class EmbeddingBagCollectionSharder(ModuleSharder[EmbeddingBagCollection]):
    """Shards ``EmbeddingBagCollection`` modules.

    Args:
        optimizer: the fused optimizer of the sharded tables (default: that of
            ``fused_params``, else the one each collection was built with).
        fused_params: fused-kernel options (output dtype, bounds check, cache).
        qcomm_codecs_registry: quantized comm codecs per ``CommOp`` value.
        local_world_size: ranks per node for table-row-wise, table-column-wise and grid
            tables (default: see :mod:`embshard_dist.sharding.nodes`); tests simulate several
            nodes on one host with it.

    Raises:
        ValueError: ``local_world_size`` is not a positive int.
    """

    def __init__(
        self,
        optimizer: OptimizerSpec | None = None,
        fused_params: FusedParams | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        local_world_size: int | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if local_world_size is not None:
            resolve_local_world_size(local_world_size, local_world_size)
        self._local_world_size = local_world_size
        check_options(optimizer, fused_params)
        self._optimizer = optimizer
        self._fused_params = fused_params

    @property
    def optimizer(self) -> OptimizerSpec | None:
        return self._optimizer

    @property
    def fused_params(self) -> FusedParams | None:
        return self._fused_params

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
        path: str = "",
    ) -> ShardedEmbeddingBagCollection:
        """Build the sharded collection (this rank's shards, weights copied or drawn).

        Args:
            module: the collection (materialised, or on ``meta``).
            params: the sharding of each of its tables.
            env: the ranks to shard over.
            device: this rank's compute device (default: the CPU).
            module_fqn: the module's path in the model (same as ``path``).
            path: the module's path in the model, for messages.

        Raises:
            TypeError / ValueError: the plan does not fit (see :meth:`check_plan`); raised on
                every rank alike, before any collective.
        """
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(
                f"EmbeddingBagCollectionSharder shards EmbeddingBagCollection modules, got "
                f"{type(module).__name__} at {path or module_fqn or 'the root'!r}"
            )
        return ShardedEmbeddingBagCollection(
            module,
            params,
            env,
            device,
            optimizer=self._optimizer,
            fused_params=self._fused_params,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            path=path or module_fqn or "",
            local_world_size=self._local_world_size,
        )

    def shardable_parameters(self, module: EmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """Table name -> its weight."""
        return table_weights(module, "embedding_bags")

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """Data-parallel, table-, row-, column-, table-row-, table-column-wise and grid (on
        ``cpu`` and ``cuda``).

        Raises:
            ValueError: an unknown device type.
        """
        return sharding_types_on(compute_device_type, STRATEGIES)

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """Kernels the sharded collection runs for ``sharding_type`` on the device.

        Raises:
            ValueError: an unknown device type or sharding type.
        """
        return kernels_on(sharding_type, compute_device_type, STRATEGIES)

    def check_plan(
        self,
        module: EmbeddingBagCollection,
        params: Any,
        env: ShardingEnv,
        device_type: str,
        path: str = "",
    ) -> None:
        """Raise unless ``params`` can shard ``module`` over ``env`` on ``device_type``.

        See :mod:`embshard_dist.sharders.plan_checks` for the list of checks.

        Raises:
            TypeError: ``params`` is not an ``EmbeddingModuleShardingPlan``.
            ValueError: the first problem, naming the module path and the table.
        """
        check_device(device_type)
        check_plan(
            module.embedding_bag_configs(),
            params,
            env.world_size,
            device_type,
            path=path,
            sharding_types=self.sharding_types(device_type),
            compute_kernels=lambda kind: self.compute_kernels(kind, device_type),
            local_world_size=env_local_world_size(env, self._local_world_size),
        )
