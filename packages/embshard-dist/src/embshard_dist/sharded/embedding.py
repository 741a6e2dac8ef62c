"""ShardedEmbeddingCollection: an EmbeddingCollection whose sequence tables are spread over ranks.

A step on N ranks equals the unsharded module's on the global batch with loss (1/N) sum_i L_i;
the forward is bit-exact. The plan is checked before anything is built or any rank contacted;
``state_dict()`` holds ``embeddings.{table}.weight`` on every rank (sharded, or plain for DP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

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
from embshard_dist.sharded.context import FeaturesAwaitable
from embshard_dist.sharded.input_checks import InputGate
from embshard_dist.sharded.sharder import CollectionKind, CollectionSharder
from embshard_dist.strategies.cw import CwSequenceSharding
from embshard_dist.strategies.dp import DpSequenceSharding
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.rw import RwSequenceSharding
from embshard_dist.strategies.sequence import (
    EmbeddingSequenceSharding,
    SequenceStepContext,
    lookup_input,
)
from embshard_dist.strategies.tw import TwSequenceSharding
from embshard_kernels.collections import EmbeddingCollection
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.slices import TableWeight
from embshard_optim.keyed import KeyedOptimizer
from embshard_optim.specs import OptimizerSpec
from embshard_types.awaitables import Awaitable, LazyAwaitable, LazyGetItemMixin
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.configs import EmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.interfaces import ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

__all__ = [
    "SEQUENCE_STRATEGIES",
    "EmbeddingCollectionContext",
    "JaggedTensorsAwaitable",
    "ShardedEmbeddingCollection",
]

_ATTR = "embeddings"
"""The name the local weights are registered under (and the state dict's key prefix)."""

SEQUENCE_STRATEGIES: dict[ShardingType, type] = {
    ShardingType.DATA_PARALLEL: DpSequenceSharding,
    ShardingType.TABLE_WISE: TwSequenceSharding,
    ShardingType.ROW_WISE: RwSequenceSharding,
    ShardingType.COLUMN_WISE: CwSequenceSharding,
}


@dataclass
class EmbeddingCollectionContext:
    """What one step carries from input dist to output dist: per-strategy contexts and the batch."""

    sharding_contexts: list[SequenceStepContext] = field(default_factory=list)
    features: KeyedJaggedTensor | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the held tensors as used on ``stream``."""
        for ctx in self.sharding_contexts:
            ctx.record_stream(stream)
        if self.features is not None:
            self.features.record_stream(stream)


class JaggedTensorsAwaitable(
    LazyGetItemMixin[str, JaggedTensor], LazyAwaitable[dict[str, JaggedTensor]]
):
    """Every feature's rows as a JaggedTensor with the caller's lengths, in the given order."""

    def __init__(
        self,
        pending: Sequence[Awaitable[dict[str, Tensor]]],
        keys: list[str],
        features: KeyedJaggedTensor,
    ) -> None:
        super().__init__()
        self._pending = list(pending)
        self._keys = keys
        self._features = features

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        rows: dict[str, Tensor] = {}
        for awaitable in self._pending:
            rows.update(awaitable.wait())
        given = self._features.to_dict()
        return {f: JaggedTensor(rows[f], lengths=given[f].lengths()) for f in self._keys}


class ShardedEmbeddingCollection(
    ShardedModule[
        list[KeyedJaggedTensor], list[Tensor], dict[str, JaggedTensor], EmbeddingCollectionContext
    ]
):
    """An EmbeddingCollection sharded over the ranks of ``env``.

    Args:
        module: the unsharded collection (on ``meta``, weights are drawn deterministically).
        optimizer: the fused optimizer; default: that of ``fused_params``, else the module's.
        check_inputs: check every input batch, with one verdict for all ranks (default: on,
            unless ``EMBSHARD_SKIP_INPUT_CHECKS=1``); see ``sharded.input_checks``.

    Raises:
        ValueError / TypeError: the plan does not fit the module, world or device (on every
            rank, before any collective).
    """

    def __init__(
        self,
        module: EmbeddingCollection,
        plan: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | str | None = None,
        *,
        optimizer: OptimizerSpec | None = None,
        fused_params: FusedParams | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        path: str = "",
        check_inputs: bool | None = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        configs = module.embedding_configs()
        self._env = env
        self._device = dev
        self._plan = plan
        self._configs = configs
        self._format = state_format(env)
        # A 2-D environment's process_group is global; shard within its sharding group.
        self._pg = sharding_group(env)
        options = ShardingOptions(
            device=dev,
            pg=self._pg,
            fused_params=resolve_fused_params(module, optimizer, fused_params),
            is_weighted=False,
            state_format=self._format,
            world_size=env.world_size,
            rank=env.rank,
            qcomm_codecs_registry=dict(self.qcomm_codecs_registry),
        )
        self._tables = build_tables(configs, plan, env.world_size, dev.type)
        self._shardings: list[EmbeddingSequenceSharding] = build_strategies(
            self._tables, SEQUENCE_STRATEGIES, options
        )
        # Kept out of the module tree: the local weights are registered once, under _ATTR.
        self._input_dists = [s.create_input_dist() for s in self._shardings]
        self._lookups: list[GroupedBagLookup] = [s.create_lookup() for s in self._shardings]
        self._output_dists = [s.create_output_dist() for s in self._shardings]

        local = {name: w for lookup in self._lookups for name, w in lookup.local_weights().items()}
        self._local = local
        fill_weights(module, self._tables, local, _ATTR)
        self.embeddings = nn.ModuleDict(
            {c.name: TableWeight(local[c.name][0]) for c in configs if c.name in local}
        )
        self._keys = [f for c in configs for f in c.feature_names]
        self._gate = InputGate(
            self._keys,
            [c.num_embeddings for c in configs for _ in c.feature_names],
            {f: c.name for c in configs for f in c.feature_names},
            weighted=False,
            check_inputs=check_inputs,
        )
        if self._gate.enabled:  # checked once, here: the kernels need not check again
            for lookup in self._lookups:
                lookup.trust_inputs()
        self._fused_optim = combine_optimizers(
            [o for lookup in self._lookups for o in lookup.fused_optimizers()], _ATTR
        )
        self._states = TableStates(_ATTR, self._tables, local, self._format, self._pg, dev.type)
        self._states.register(self)

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext([SequenceStepContext() for _ in self._shardings])

    def input_dist(
        self, ctx: EmbeddingCollectionContext, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """Start routing every strategy's features (in strategy order, on every rank).

        The input is checked here; a bad one on any rank makes every rank's wait raise the same
        ``InvalidInputError`` (see ``sharded.input_checks``) before any lookup.
        """
        (given,) = input
        features, status = self._gate.check(given, "ShardedEmbeddingCollection")
        ctx.features = features
        for sctx in ctx.sharding_contexts:
            sctx.input_status = status
        started = [
            dist(features, sctx)
            for dist, sctx in zip(self._input_dists, ctx.sharding_contexts, strict=True)
        ]
        return self._gate.agreed(
            FeaturesAwaitable(started), started, self._input_dists, status, self._pg
        )

    def compute(
        self, ctx: EmbeddingCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Tensor]:
        rows = []
        for lookup, kjt, sctx in zip(self._lookups, dist_input, ctx.sharding_contexts, strict=True):
            sctx.lookup_input = kjt
            rows.append(lookup(lookup_input(kjt)))
        return rows

    def output_dist(
        self, ctx: EmbeddingCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        pending = [
            dist(rows, sctx)
            for dist, rows, sctx in zip(
                self._output_dists, output, ctx.sharding_contexts, strict=True
            )
        ]
        assert ctx.features is not None
        return JaggedTensorsAwaitable(pending, self._keys, ctx.features)

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._fused_optim

    @property
    def plan(self) -> EmbeddingModuleShardingPlan:
        return self._plan

    @property
    def shardings(self) -> list[EmbeddingSequenceSharding]:
        return list(self._shardings)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)

    def _table_entry(self, name: str) -> Tensor:
        return self._states.entry(name)


class EmbeddingCollectionSharder(CollectionSharder[EmbeddingCollection]):
    """Shards ``EmbeddingCollection`` modules: data-parallel, table-, row- and column-wise."""

    kind = CollectionKind(
        module_type=EmbeddingCollection,
        weights_attr=_ATTR,
        strategies=SEQUENCE_STRATEGIES,
        sharded_type=ShardedEmbeddingCollection,
        configs=EmbeddingCollection.embedding_configs,
    )
