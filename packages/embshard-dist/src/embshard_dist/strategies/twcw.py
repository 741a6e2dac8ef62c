"""Table-column-wise sharding: each table lives on one node, its columns cut over that node's ranks.

Runs :mod:`.cw` on tables whose blocks share a node, so row-wise optimizer traffic stays inside
the node; same guarantees as column-wise.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.strategies.base import BagTable
from embshard_dist.strategies.cw import CwSharding
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.twrw import node_topology
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ShardingType

__all__ = ["TwCwSharding"]


class TwCwSharding:
    """Table-column-wise sharding of ``tables`` (each table's blocks on the ranks of one node).

    Raises:
        ValueError: a table's blocks span several nodes.
    """

    sharding_type = ShardingType.TABLE_COLUMN_WISE

    def __init__(
        self,
        tables: Sequence[BagTable],
        options: ShardingOptions,
        *,
        local_world_size: int | None = None,
    ) -> None:
        topology = node_topology(options, local_world_size)
        for table in tables:
            nodes = sorted({topology.node_of(s.rank) for s in table.specs or ()})
            if len(nodes) != 1:
                raise ValueError(
                    f"table {table.name!r}: table_column_wise blocks must all be on one node "
                    f"({topology.local_world_size} ranks per node), got nodes {nodes}; use "
                    "column_wise sharding to spread blocks over nodes"
                )
        self._columns = CwSharding(tables, options)

    def feature_names(self) -> list[str]:
        return self._columns.feature_names()

    def embedding_dims(self) -> list[int]:
        return self._columns.embedding_dims()

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return self._columns.shard_specs()

    def create_input_dist(self) -> nn.Module:
        return self._columns.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        return self._columns.create_lookup()

    def create_output_dist(self) -> nn.Module:
        return self._columns.create_output_dist()
