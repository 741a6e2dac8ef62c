"""Table-column-wise sharding: each table lives on one node, its columns cut over that node's ranks.

A table-column-wise table is a column-wise table whose blocks all sit on the ranks of one node
(at most one block per rank), so this strategy runs column-wise sharding's flow
(:mod:`.cw`) on such tables: the input dist sends every feature to each rank holding a block of
its table, each rank pools its blocks for the global batch, and the output dist divides the
gradient by the world size, returns each rank's rows with a pooled-embeddings all-to-all and
puts every feature's blocks back side by side. Column blocks are concatenated, never summed, so
there is no reduction to do inside the node (TorchRec's table-column-wise sharding uses the
column-wise dists too); what the node placement buys is that the traffic of row-wise optimizers
stays inside the node: the per-row partial sums of g² that make RowWiseAdagrad (and the other
row-wise optimizers) see the full row are gathered over the table's blocks' ranks, all on one
node.

Math: that of column-wise sharding: the forward is exact, point-wise optimizers are exact per
element, and row-wise optimizer statistics cover the full row (see :mod:`.cw`), so a step
leaves weights and optimizer state equal to the unsharded module's for
``L = (1/N) * sum_i L_i``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.cw import CwSharding
from embshard_dist.sharding.twrw import node_topology
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ShardingType

__all__ = ["TwCwSharding"]


class TwCwSharding:
    """Table-column-wise sharding of ``tables`` (each table's blocks on the ranks of one node).

    Args:
        tables: the table-column-wise tables, in the collection's order.
        options: where to run and how to build kernels.
        local_world_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else one node).

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
        """Features in output order (the collection's order)."""
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
