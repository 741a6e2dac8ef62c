"""ShardedEmbeddingCollection: an EmbeddingCollection whose sequence tables are spread over ranks.

Each table is sharded as its plan entry says; tables of one sharding type are served by one
sequence strategy (:mod:`embshard_dist.sharding.dp_seq`, ``tw_seq``, ``rw_seq``, ``cw_seq``).
A step is::

    forward(kjt)                       # the caller's local batch
      input_dist(ctx, kjt)             # every strategy starts routing its features
      compute(ctx, features)           # every strategy looks up the rows of its ids
      output_dist(ctx, rows)           # every strategy sends the rows back (sequence all-to-all)
      -> LazyAwaitable[dict[str, JaggedTensor]]   # one per feature, in config order

Each output JaggedTensor holds one ``[dim]`` row per id of the caller's feature, with the
caller's lengths. Batch sizes may vary per feature (each feature its own number of samples,
on every rank alike). The loss of every rank must depend on the outputs (even empty ones), so
that every rank takes part in the backward collectives.

The math follows one rule (see :mod:`embshard_dist.sharding.base`): with N ranks and local losses
``L_i``, a step leaves weights and optimizer state equal to the unsharded module's stepped on the
global batch with loss ``(1/N) * sum_i L_i``. The forward moves rows without arithmetic, so it
equals the unsharded collection's bit for bit.

State: ``state_dict()`` holds ``embeddings.{table}.weight`` for every table on every rank: a
``ShardedTensor`` (``DTensor`` when the environment asks for DTensors) over the local shard for
table-, row- and column-wise tables, the plain tensor for data-parallel ones;
``load_state_dict`` copies into the local shards (see :mod:`.state`). ``named_parameters()``
yields the local shards. ``fused_optimizer`` combines the kernels' fused optimizers
(parameters ``embeddings.{table}.weight``, state ``{table}.momentum1``...).

Initial weights: copied from the unsharded module when it is materialised; drawn
deterministically per table otherwise (see :mod:`.init`). Guarantees: the plan is checked
before anything is built or any rank is contacted (:mod:`embshard_dist.sharders.plan_checks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

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
from embshard_dist.sharded.context import FeaturesAwaitable
from embshard_dist.sharded.embedding_bag import supported_kernels
from embshard_dist.sharders.plan_checks import check_plan
from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import ShardingOptions
from embshard_dist.sharding.cw_seq import CwSequenceSharding
from embshard_dist.sharding.dp_seq import DpSequenceSharding
from embshard_dist.sharding.rw_seq import RwSequenceSharding
from embshard_dist.sharding.sequence import (
    EmbeddingSequenceSharding,
    SequenceStepContext,
    lookup_input,
)
from embshard_dist.sharding.tw_seq import TwSequenceSharding
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
"""The strategy class serving each supported sharding type of sequence tables."""


@dataclass
class EmbeddingCollectionContext:
    """What one step carries from input dist to output dist.

    Attributes:
        sharding_contexts: one context per strategy.
        features: the caller's batch (the outputs take its lengths).
    """

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
    """Every feature's rows as a JaggedTensor with the caller's lengths, in the given order.

    Args:
        pending: per strategy, its output dist's awaitable ``{feature: rows}``.
        keys: the output features, in order.
        features: the caller's batch.
    """

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
    """An EmbeddingCollection sharded over the ranks of ``env`` (see the module docstring).

    Args:
        module: the unsharded collection (materialised: weights are copied; on ``meta``: they
            are drawn deterministically).
        plan: how each of its tables is sharded.
        env: the ranks to shard over (its process group carries the collectives).
        device: this rank's compute device.
        optimizer: the fused optimizer; default: that of ``fused_params`` if given, else the
            one ``module`` was built with, else FBGEMM's default (SGD, lr 0.01).
        fused_params: fused-kernel options (output dtype, bounds check, cache).
        qcomm_codecs_registry: quantized comm codecs per ``CommOp`` value (the sequence
            all-to-all reads ``sequence_embeddings_all_to_all``).
        path: the module's path in the model, for messages.

    Raises:
        ValueError / TypeError: the plan does not fit the module, world or device (every rank
            raises the same error before any collective).
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
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        configs = module.embedding_configs()
        check_plan(
            configs,
            plan,
            env.world_size,
            dev.type,
            path=path,
            sharding_types=list(SEQUENCE_STRATEGIES),
            compute_kernels=lambda kind: supported_kernels(kind, dev.type),
            module_kind="EmbeddingCollection",
        )
        self._env = env
        self._device = dev
        self._plan = plan
        self._configs = configs
        self._format = state_format(env)
        # A 2-D environment shards within its sharding group (its process_group is global).
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
        # The three stages of the flow, one module per strategy, kept out of the module tree:
        # the local weights are registered once, under ``embeddings``.
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
        self._fused_optim = combine_optimizers(
            [o for lookup in self._lookups for o in lookup.fused_optimizers()], _ATTR
        )
        self._states = TableStates(_ATTR, self._tables, local, self._format, self._pg, dev.type)
        self._states.register(self)

    # -- the flow ---------------------------------------------------------------------------

    def create_context(self) -> EmbeddingCollectionContext:
        return EmbeddingCollectionContext([SequenceStepContext() for _ in self._shardings])

    def input_dist(
        self, ctx: EmbeddingCollectionContext, *input: Any, **kwargs: Any
    ) -> Awaitable[Awaitable[list[KeyedJaggedTensor]]]:
        """Start routing every strategy's features (in strategy order, on every rank).

        Args:
            ctx: the step's context.
            *input: the caller's ``KeyedJaggedTensor`` (local batch; extra features ignored,
                weights ignored; batch sizes may vary per feature).

        Raises:
            TypeError: the input is not a KeyedJaggedTensor.
            ValueError: a feature is missing (named with its table), before any collective.
        """
        (features,) = input
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"ShardedEmbeddingCollection takes a KeyedJaggedTensor, got "
                f"{type(features).__name__}"
            )
        ctx.features = features
        return FeaturesAwaitable(
            [
                dist(features, sctx)
                for dist, sctx in zip(self._input_dists, ctx.sharding_contexts, strict=True)
            ]
        )

    def compute(
        self, ctx: EmbeddingCollectionContext, dist_input: list[KeyedJaggedTensor]
    ) -> list[Tensor]:
        """Every strategy's lookup: the rows of its ids, flattened."""
        rows = []
        for lookup, kjt, sctx in zip(self._lookups, dist_input, ctx.sharding_contexts, strict=True):
            sctx.lookup_input = kjt
            rows.append(lookup(lookup_input(kjt)))
        return rows

    def output_dist(
        self, ctx: EmbeddingCollectionContext, output: list[Tensor]
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """Start every strategy's output dist; the result waits for them on first use."""
        pending = [
            dist(rows, sctx)
            for dist, rows, sctx in zip(
                self._output_dists, output, ctx.sharding_contexts, strict=True
            )
        ]
        assert ctx.features is not None
        return JaggedTensorsAwaitable(pending, self._keys, ctx.features)

    # -- introspection ----------------------------------------------------------------------

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingCollection

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The fused optimizers of every local kernel, as one keyed optimizer."""
        return self._fused_optim

    @property
    def plan(self) -> EmbeddingModuleShardingPlan:
        return self._plan

    @property
    def shardings(self) -> list[EmbeddingSequenceSharding]:
        """The strategies, in the order their collectives run."""
        return list(self._shardings)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The unsharded collection's table configs."""
        return list(self._configs)

    # -- state ------------------------------------------------------------------------------

    def _table_entry(self, name: str) -> Tensor:
        return self._states.entry(name)
