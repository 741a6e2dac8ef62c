"""Table-wise sharding: each table lives whole on one rank.

Features go to the table's rank, which looks up the global batch; forward and update are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.strategies.base import BagTable, shard_config
from embshard_dist.strategies.lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.route import PooledOutputDist, RoutedInputDist
from embshard_dist.strategies.sequence import PooledSequenceSharding, blocks_output_dist
from embshard_kernels.grouping import ShardedTableConfig
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, ShardingType


class TwSharding:
    """Table-wise sharding of ``tables`` (each with one shard)."""

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._tables = list(tables)
        self._options = options
        per_rank: list[list[ShardedTableConfig]] = [[] for _ in range(options.world_size)]
        for table in self._tables:
            assert table.specs is not None and len(table.specs) == 1
            spec = table.specs[0]
            per_rank[spec.rank].append(shard_config(table, spec, options))
        self._per_rank = per_rank
        self._wire = [kernel_feature_order(configs) for configs in per_rank]
        dims = {f: t.config.embedding_dim for t in self._tables for f in t.config.feature_names}
        self._dims = dims
        self._feature_tables = {f: t.name for t in self._tables for f in t.config.feature_names}

    def feature_names(self) -> list[str]:
        """Features in the collection's order (the output dist reorders while assembling)."""
        return [f for t in self._tables for f in t.config.feature_names]

    def embedding_dims(self) -> list[int]:
        return [self._dims[f] for f in self.feature_names()]

    def features_per_rank(self) -> list[list[str]]:
        return [list(features) for features in self._wire]

    def tables_per_rank(self) -> list[list[ShardedTableConfig]]:
        return [list(configs) for configs in self._per_rank]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def create_input_dist(self) -> nn.Module:
        return RoutedInputDist(
            self._options.pg,
            self._wire,
            self._feature_tables,
            is_weighted=self._options.is_weighted,
        )

    def create_lookup(self) -> GroupedBagLookup:
        return GroupedBagLookup(self._per_rank[self._options.rank], self._options)

    def _columns(self) -> list[int]:
        """Received column of each output column (received: rank by rank, in kernel order)."""
        start: dict[str, int] = {}
        at = 0
        for feature in (f for features in self._wire for f in features):
            start[feature] = at
            at += self._dims[feature]
        return [start[f] + j for f in self.feature_names() for j in range(self._dims[f])]

    def create_output_dist(self) -> nn.Module:
        return PooledOutputDist(
            self._options.pg,
            [sum(self._dims[f] for f in features) for features in self._wire],
            columns=self._columns(),
            codecs=self._options.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL),
        )


class TwSequenceSharding(PooledSequenceSharding[TwSharding]):
    """Table-wise sharding of sequence ``tables`` (each with one shard)."""

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(TwSharding(tables, options), options, blocks_output_dist)
