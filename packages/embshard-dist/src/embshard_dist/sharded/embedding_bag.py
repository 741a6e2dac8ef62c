"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables are spread over ranks.

A step on N ranks equals the unsharded module's on the global batch with loss (1/N) sum_i L_i.
The plan is checked before anything is built or any rank contacted; ``state_dict()`` holds
``embedding_bags.{table}.weight`` on every rank (sharded, or plain for DP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.comm.columns import ColumnAssembly
from embshard_dist.comm.placement import PlacedAssembly
from embshard_dist.sharded.common import (
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
from embshard_dist.sharded.input_checks import InputGate
from embshard_dist.sharded.node_plan_checks import NODE_AWARE
from embshard_dist.sharded.sharder import CollectionKind, CollectionSharder
from embshard_dist.strategies.base import EmbeddingBagSharding, ShardingStepContext
from embshard_dist.strategies.cw import CwSharding
from embshard_dist.strategies.dp import DpSharding
from embshard_dist.strategies.grid import GridSharding
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.nodes import env_local_world_size
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.rw import RwSharding
from embshard_dist.strategies.tw import TwSharding
from embshard_dist.strategies.twcw import TwCwSharding
from embshard_dist.strategies.twrw import TwRwSharding
from embshard_dist.strategies.variable_batch import (
    VariableBatchKeyedTensorAwaitable,
    variable_batch_output_dists,
    variable_batch_verdict,
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
from embshard_types.vocab import ShardingType

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


class ShardedEmbeddingBagCollection(
    ShardedModule[list[KeyedJaggedTensor], list[Tensor], KeyedTensor, EmbeddingBagCollectionContext]
):
    """An EmbeddingBagCollection sharded over the ranks of ``env``.

    Args:
        module: the unsharded collection (on ``meta``, weights are drawn deterministically).
        optimizer: the fused optimizer; default: that of ``fused_params``, else the module's.
        local_world_size: ranks per node for the node-aware strategies (default: a 2-D env's
            ``node_group_size``, else ``LOCAL_WORLD_SIZE``, else one node).
        check_inputs: check every input batch, with one verdict for all ranks (default: on,
            unless ``EMBSHARD_SKIP_INPUT_CHECKS=1``); see ``sharded.input_checks``.

    Raises:
        ValueError / TypeError: the plan does not fit the module, world or device (on every
            rank, before any collective).
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
        check_inputs: bool | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        lws = env_local_world_size(env, local_world_size)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        configs = module.embedding_bag_configs()
        self._env = env
        self._device = dev
        self._plan = plan
        self._configs = configs
        self._is_weighted = module.is_weighted()
        self._format = state_format(env)
        # A 2-D environment's process_group is global; shard within its sharding group.
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
        # Kept out of the module tree: the local weights are registered once, under _ATTR.
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
        self._gate = _input_gate(configs, self._is_weighted, check_inputs)
        if self._gate.enabled:  # checked once, here: the kernels need not check again
            for lookup in self._lookups:
                lookup.trust_inputs()
        dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
        self._dims = [dims[f] for f in self._keys]
        self._columns = _column_index(self._shardings, self._keys, dims)
        self._fused_optim = combine_optimizers(
            [o for lk in self._lookups for o in lk.fused_optimizers()], _ATTR
        )
        self._variable_dists: list[nn.Module] | None = None
        self._states = TableStates(_ATTR, self._tables, local, self._format, self._pg, dev.type)
        self._states.register(self)

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext([ShardingStepContext() for _ in self._shardings])

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """Start routing every strategy's features (in strategy order, on every rank).

        The input is checked here; a bad one on any rank makes every rank's wait raise the same
        ``InvalidInputError`` (see ``sharded.input_checks``) before any lookup.
        """
        (given,) = input
        features, status = self._gate.check(given, "ShardedEmbeddingBagCollection")
        features, status = variable_batch_verdict(features, self._keys, self._shardings, status)
        for sctx in ctx.sharding_contexts:
            sctx.input_status = status
            if features.variable_stride_per_key():
                sctx.input_features = features
        started = [
            dist(features, sctx)
            for dist, sctx in zip(self._input_dists, ctx.sharding_contexts, strict=True)
        ]
        return self._gate.agreed(
            FeaturesAwaitable(started), started, self._input_dists, status, self._pg
        )

    def compute(
        self, ctx: EmbeddingBagCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Tensor]:
        return [lookup(kjt) for lookup, kjt in zip(self._lookups, dist_input, strict=True)]

    def output_dist(
        self, ctx: EmbeddingBagCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[KeyedTensor]:
        variable = ctx.sharding_contexts[0].input_features if ctx.sharding_contexts else None
        if variable is not None:
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
        # Overlap the backward's id sorting with the output collectives.
        for lookup in self._lookups:
            lookup.prepare_backward()
        return KeyedTensorAwaitable(pending, self._keys, self._dims, self._columns)

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._fused_optim

    @property
    def plan(self) -> EmbeddingModuleShardingPlan:
        return self._plan

    @property
    def shardings(self) -> list[EmbeddingBagSharding]:
        return list(self._shardings)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _table_entry(self, name: str) -> Tensor:
        return self._states.entry(name)


def _column_index(
    shardings: list[EmbeddingBagSharding], keys: list[str], dims: Mapping[str, int]
) -> PlacedAssembly:
    start: dict[str, int] = {}
    at = 0
    for sharding in shardings:
        for feature, dim in zip(sharding.feature_names(), sharding.embedding_dims(), strict=True):
            start[feature] = at
            at += dim
    widths = [sum(sharding.embedding_dims()) for sharding in shardings]
    return PlacedAssembly(
        ColumnAssembly(widths, [start[f] + j for f in keys for j in range(dims[f])])
    )


def _input_gate(
    configs: list[EmbeddingBagConfig], weighted: bool, check_inputs: bool | None
) -> InputGate:
    features = [f for c in configs for f in c.feature_names]
    return InputGate(
        features,
        [c.num_embeddings for c in configs for _ in c.feature_names],
        {f: c.name for c in configs for f in c.feature_names},
        weighted=weighted,
        check_inputs=check_inputs,
    )


class EmbeddingBagCollectionSharder(CollectionSharder[EmbeddingBagCollection]):
    """Shards ``EmbeddingBagCollection`` modules, with every sharding type."""

    kind = CollectionKind(
        module_type=EmbeddingBagCollection,
        weights_attr=_ATTR,
        strategies=STRATEGIES,
        sharded_type=ShardedEmbeddingBagCollection,
        configs=EmbeddingBagCollection.embedding_bag_configs,
        node_aware=True,
    )
