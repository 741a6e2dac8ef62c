"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables are spread over ranks.

Each table is sharded as its plan entry says; tables of one sharding type are served by one
strategy of :mod:`embshard_dist.sharding` (``dp``, ``tw``, ``rw``, ``cw``, and the node-aware
``twrw``, ``twcw``, ``grid``, whose nodes are ``local_world_size`` consecutive ranks, see
:mod:`embshard_dist.sharding.nodes`). A step is::

    forward(kjt)                       # the caller's local batch
      input_dist(ctx, kjt)             # every strategy starts routing its features
      compute(ctx, features)           # every strategy looks up its local shards
      output_dist(ctx, pooled)         # every strategy sends pooled rows back
      -> LazyAwaitable[KeyedTensor]    # keys: the collection's features, in config order

The math follows one rule (see :mod:`embshard_dist.sharding.base`): with N ranks and local losses
``L_i``, a step leaves weights and optimizer state equal to the unsharded module's stepped on the
global batch with loss ``(1/N) * sum_i L_i``.

State: ``state_dict()`` holds ``embedding_bags.{table}.weight`` for every table on every rank:
a ``ShardedTensor`` (``DTensor`` when the environment asks for DTensors) over the local shard
for table-, row- and column-wise tables, the plain tensor for data-parallel ones;
``load_state_dict`` copies into the local shards (see :mod:`.state`). ``named_parameters()``
yields the local shards (``embedding_bags.{table}.weight``, live views of the kernels'
weights). ``fused_optimizer`` combines the kernels' fused optimizers: parameters
``embedding_bags.{table}.weight``, state ``{table}.momentum1``... exposed like the weights.

Initial weights: copied from the unsharded module when it is materialised; drawn
deterministically per table otherwise (see :mod:`.init`). Guarantees: the plan is checked
before anything is built or any rank is contacted (:mod:`embshard_dist.sharders.plan_checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.comm.columns import ColumnAssembly
from embshard_dist.sharded._common import (
    TableStates,
    build_strategies,
    build_tables,
    combine_optimizers,
    fill_weights,
    resolve_fused_params,
    sharding_group,
    state_format,
)
from embshard_dist.sharded.context import (
    EmbeddingBagCollectionContext,
    FeaturesAwaitable,
    KeyedTensorAwaitable,
)
from embshard_dist.sharders.node_plan_checks import NODE_AWARE
from embshard_dist.sharders.plan_checks import check_plan
from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import (
    EmbeddingBagSharding,
    ShardingOptions,
    ShardingStepContext,
)
from embshard_dist.sharding.cw import CwSharding
from embshard_dist.sharding.dp import DpSharding
from embshard_dist.sharding.grid import GridSharding
from embshard_dist.sharding.nodes import env_local_world_size
from embshard_dist.sharding.rw import RwSharding
from embshard_dist.sharding.tw import TwSharding
from embshard_dist.sharding.twcw import TwCwSharding
from embshard_dist.sharding.twrw import TwRwSharding
from embshard_dist.sharding.variable_batch import (
    VariableBatchKeyedTensorAwaitable,
    check_variable_batch,
    variable_batch_output_dists,
)
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.slices import TableWeight
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.specs import OptimizerSpec
from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import ComputeKernel, ShardingType

_ATTR = "embedding_bags"
"""The name the local weights are registered under (and the state dict's key prefix)."""

STRATEGIES: dict[ShardingType, type] = {
    ShardingType.DATA_PARALLEL: DpSharding,
    ShardingType.TABLE_WISE: TwSharding,
    ShardingType.ROW_WISE: RwSharding,
    ShardingType.COLUMN_WISE: CwSharding,
    ShardingType.TABLE_ROW_WISE: TwRwSharding,
    ShardingType.TABLE_COLUMN_WISE: TwCwSharding,
    ShardingType.GRID_SHARD: GridSharding,
}
"""The strategy class serving each supported sharding type."""

SUPPORTED_KERNELS: dict[ShardingType, tuple[ComputeKernel, ...]] = {
    ShardingType.DATA_PARALLEL: (ComputeKernel.FUSED,),
    ShardingType.TABLE_WISE: (ComputeKernel.FUSED, ComputeKernel.DENSE),
    ShardingType.ROW_WISE: (ComputeKernel.FUSED, ComputeKernel.DENSE),
    ShardingType.COLUMN_WISE: (ComputeKernel.FUSED, ComputeKernel.DENSE),
    ShardingType.TABLE_ROW_WISE: (ComputeKernel.FUSED, ComputeKernel.DENSE),
    ShardingType.TABLE_COLUMN_WISE: (ComputeKernel.FUSED, ComputeKernel.DENSE),
    ShardingType.GRID_SHARD: (ComputeKernel.FUSED, ComputeKernel.DENSE),
}
"""Compute kernels each strategy runs on the CPU (CUDA adds the UVM fused kernels)."""

_CUDA_ONLY = (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def supported_kernels(sharding_type: ShardingType, device_type: str) -> list[ComputeKernel]:
    """The compute kernels a strategy runs on ``device_type``."""
    kernels = list(SUPPORTED_KERNELS.get(sharding_type, ()))
    if device_type == "cuda" and ComputeKernel.FUSED in kernels:
        kernels[1:1] = _CUDA_ONLY
    return kernels


class ShardedEmbeddingBagCollection(
    ShardedModule[list[KeyedJaggedTensor], list[Tensor], KeyedTensor, EmbeddingBagCollectionContext]
):
    """An EmbeddingBagCollection sharded over the ranks of ``env`` (see the module docstring).

    Args:
        module: the unsharded collection (materialised: weights are copied; on ``meta``: they
            are drawn deterministically).
        plan: how each of its tables is sharded.
        env: the ranks to shard over (its process group carries the collectives).
        device: this rank's compute device.
        optimizer: the fused optimizer; default: that of ``fused_params`` if given, else the
            one ``module`` was built with, else FBGEMM's default (SGD, lr 0.01).
        fused_params: fused-kernel options (output dtype, bounds check, cache).
        qcomm_codecs_registry: quantized comm codecs per ``CommOp`` value.
        path: the module's path in the model, for messages.
        local_world_size: ranks per node for table-row-wise, table-column-wise and grid
            tables; default: a 2-D environment's ``node_group_size`` (else its whole sharding
            group), else ``LOCAL_WORLD_SIZE``, else one node.

    Raises:
        ValueError / TypeError: the plan does not fit the module, world or device (every rank
            raises the same error before any collective).
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | str | None = None,
        *,
        optimizer: OptimizerSpec | None = None,
        fused_params: FusedParams | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        path: str = "",
        local_world_size: int | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        lws = env_local_world_size(env, local_world_size)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        configs = module.embedding_bag_configs()
        check_plan(
            configs,
            plan,
            env.world_size,
            dev.type,
            path=path,
            sharding_types=list(STRATEGIES),
            compute_kernels=lambda kind: supported_kernels(kind, dev.type),
            local_world_size=lws,
        )
        self._env = env
        self._device = dev
        self._plan = plan
        self._configs = configs
        self._is_weighted = module.is_weighted()
        self._format = state_format(env)
        # A 2-D environment shards within its sharding group (its process_group is global).
        self._pg = sharding_group(env)
        options = ShardingOptions(
            device=dev,
            pg=self._pg,
            fused_params=resolve_fused_params(module, optimizer, fused_params),
            is_weighted=self._is_weighted,
            state_format=self._format,
            world_size=env.world_size,
            rank=env.rank,
            qcomm_codecs_registry=dict(self.qcomm_codecs_registry),
        )
        self._tables = build_tables(configs, plan, env.world_size, dev.type, local_world_size=lws)
        self._shardings: list[EmbeddingBagSharding] = build_strategies(
            self._tables,
            STRATEGIES,
            options,
            lambda kind: {"local_world_size": lws} if kind in NODE_AWARE else {},
        )
        # The three stages of the flow, one module per strategy. They are kept out of the
        # module tree: the local weights are registered once, under ``embedding_bags``.
        self._input_dists = [s.create_input_dist() for s in self._shardings]
        self._lookups: list[GroupedBagLookup] = [s.create_lookup() for s in self._shardings]
        self._output_dists = [s.create_output_dist() for s in self._shardings]

        local = {name: w for lookup in self._lookups for name, w in lookup.local_weights().items()}
        self._local = local
        fill_weights(module, self._tables, local, _ATTR)
        self.embedding_bags = nn.ModuleDict(
            {c.name: TableWeight(local[c.name][0]) for c in configs if c.name in local}
        )
        self._keys = [f for c in configs for f in c.feature_names]
        dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
        self._dims = [dims[f] for f in self._keys]
        self._columns = _column_index(self._shardings, self._keys, dims)
        self._fused_optim = combine_optimizers(
            [o for lk in self._lookups for o in lk.fused_optimizers()], _ATTR
        )
        self._variable_dists: list[nn.Module] | None = None  # built for the first such batch
        self._states = TableStates(_ATTR, self._tables, local, self._format, self._pg, dev.type)
        self._states.register(self)

    # -- the flow ---------------------------------------------------------------------------

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext([ShardingStepContext() for _ in self._shardings])

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """Start routing every strategy's features (in strategy order, on every rank).

        Args:
            ctx: the step's context.
            *input: the caller's ``KeyedJaggedTensor`` (local batch; extra features ignored;
                batch sizes may vary per feature, with inverse indices, on every rank alike:
                see :mod:`embshard_dist.sharding.variable_batch`).
        """
        (features,) = input
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"ShardedEmbeddingBagCollection takes a KeyedJaggedTensor, got "
                f"{type(features).__name__}"
            )
        if features.variable_stride_per_key():
            check_variable_batch(features, self._keys, self._shardings)
            for sctx in ctx.sharding_contexts:
                sctx.input_features = features
        return FeaturesAwaitable(
            [
                dist(features, sctx)
                for dist, sctx in zip(self._input_dists, ctx.sharding_contexts, strict=True)
            ]
        )

    def compute(
        self, ctx: EmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Tensor]:
        """Every strategy's lookup of its local shards."""
        return [lookup(kjt) for lookup, kjt in zip(self._lookups, dist_input, strict=True)]

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """Start every strategy's output dist; the result waits for them on first use."""
        variable = ctx.sharding_contexts[0].input_features if ctx.sharding_contexts else None
        if variable is not None:  # batch sizes vary per feature
            if self._variable_dists is None:
                self._variable_dists = variable_batch_output_dists(
                    self._shardings, self._tables, self._pg, self.qcomm_codecs_registry
                )
            started = [
                dist(embeddings, sctx)
                for dist, embeddings, sctx in zip(
                    self._variable_dists, output, ctx.sharding_contexts, strict=True
                )
            ]
            return VariableBatchKeyedTensorAwaitable(started, self._keys, self._dims, variable)
        pending = [
            dist(embeddings, sctx)
            for dist, embeddings, sctx in zip(
                self._output_dists, output, ctx.sharding_contexts, strict=True
            )
        ]
        # while the output collectives fly: the backward's id sorting
        for lookup in self._lookups:
            lookup.prepare_backward()
        return KeyedTensorAwaitable(pending, self._keys, self._dims, self._columns)

    # -- introspection ----------------------------------------------------------------------

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The fused optimizers of every local kernel, as one keyed optimizer."""
        return self._fused_optim

    @property
    def plan(self) -> EmbeddingModuleShardingPlan:
        return self._plan

    @property
    def shardings(self) -> list[EmbeddingBagSharding]:
        """The strategies, in the order their collectives run."""
        return list(self._shardings)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The unsharded collection's table configs."""
        return list(self._configs)

    def is_weighted(self) -> bool:
        """Whether the features carry per-id weights."""
        return self._is_weighted

    # -- state ------------------------------------------------------------------------------

    def _table_entry(self, name: str) -> Tensor:
        return self._states.entry(name)


def _column_index(
    shardings: list[EmbeddingBagSharding], keys: list[str], dims: Mapping[str, int]
) -> ColumnAssembly:
    """The strategies' outputs side by side, in the caller's key order."""
    start: dict[str, int] = {}
    at = 0
    for sharding in shardings:
        for feature, dim in zip(sharding.feature_names(), sharding.embedding_dims(), strict=True):
            start[feature] = at
            at += dim
    widths = [sum(sharding.embedding_dims()) for sharding in shardings]
    return ColumnAssembly(widths, [start[f] + j for f in keys for j in range(dims[f])])
