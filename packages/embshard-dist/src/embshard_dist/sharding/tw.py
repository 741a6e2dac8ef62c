"""Table-wise sharding: each table lives whole on one rank.

Flow: the input dist sends every feature to the rank holding its table (one permutation of the
caller's KJT, then a KJT all-to-all); that rank looks the global batch up in its grouped
kernels; the output dist divides the gradient by the world size and returns each rank's rows
with a pooled-embeddings all-to-all, which puts the features in the collection's order as it
assembles what arrives (one copy).

Math: every row lives on one rank, and all ids that touch it (the global batch, in rank
order) meet in one kernel backward, so the fused optimizer (FBGEMM's or embshard's) applies
exactly the unsharded update for ``L = (1/N) * sum_i L_i`` (see :mod:`.base`). The forward is
exact: each bag is pooled by the same kernel arithmetic as in the unsharded module.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.sharding._lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.sharding._route import PooledOutputDist, RoutedInputDist
from embshard_dist.sharding.base import BagTable, ShardingOptions, shard_config
from embshard_kernels.grouping import ShardedTableConfig
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, ShardingType


class TwSharding:
    """Table-wise sharding of ``tables`` (each with one shard).

    Args:
        tables: the table-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

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
        """Features in output order: the collection's order (the output dist puts the received
        blocks in that order while assembling them, so the collection needs no reorder)."""
        return [f for t in self._tables for f in t.config.feature_names]

    def embedding_dims(self) -> list[int]:
        return [self._dims[f] for f in self.feature_names()]

    def features_per_rank(self) -> list[list[str]]:
        """Per rank, the features its lookup takes, in order."""
        return [list(features) for features in self._wire]

    def tables_per_rank(self) -> list[list[ShardedTableConfig]]:
        """Per rank, the shards its lookup holds."""
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
