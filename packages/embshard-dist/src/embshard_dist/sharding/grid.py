"""Grid sharding: each table's columns are cut into blocks, each block placed table-row-wise.

A grid table has column blocks on different nodes; on its node a block is cut into one row
block per rank (every block cut at the same rows). Flow: exactly that of table-row-wise sharding
(:mod:`.twrw`) with every column block as a unit: the input dist bucketizes a feature's ids
once per block (over the block's node) and sends them there; the output dist divides the
gradient by the world size, sums the partial bags inside each node, crosses nodes with one
all-to-all among the ranks at the same local position, and puts every feature's blocks back
side by side (one ``index_select``).

Math: the forward adds a bag's partial sums per block (in local-rank order), as row-wise
sharding does, and column blocks are exact side by side. Point-wise optimizers (SGD, Adagrad,
Adam) are exact per element. Row-wise optimizer statistics must cover the full row: a row of a
table is held by the ranks at one local position of the blocks' nodes (every block is cut at
the same rows), so for each table and local position there is one process group over those
ranks, and the blocks' kernels run embshard's torch update with a row reduction that gathers the
per-row partial sums over that group and adds them in group order
(:class:`~embshard_dist.sharding.cw.ColumnRowSum`), as column-wise sharding does: every block
then applies the unsharded row-wise update. The same ids reach every block of a row (they are
bucketized at the same boundaries), so the blocks touch the same rows. Deadlock freedom: each
table has its own kernel and backward passes run in reverse table order on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.cw import ROW_WISE_OPTIMIZERS, ColumnRowSum
from embshard_dist.sharding.nodes import node_groups, subgroup
from embshard_dist.sharding.twrw import NodeUnit, RowWiseInNodes, node_topology
from embshard_optim.sparse_rules.base import RowReduction
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = ["GridSharding"]


class GridSharding:
    """Grid sharding of ``tables`` (column blocks on distinct nodes, each cut over its node).

    Args:
        tables: the grid tables, in the collection's order.
        options: where to run and how to build kernels.
        local_world_size: ranks per node (default: ``LOCAL_WORLD_SIZE``, else one node).
    """

    sharding_type = ShardingType.GRID_SHARD

    def __init__(
        self,
        tables: Sequence[BagTable],
        options: ShardingOptions,
        *,
        local_world_size: int | None = None,
    ) -> None:
        self._tables = list(tables)
        self._options = options
        topology = node_topology(options, local_world_size)
        self._row_wise = options.fused_params.optimizer.optim_type in ROW_WISE_OPTIMIZERS
        self._units: dict[str, list[NodeUnit]] = {}
        for table in self._tables:
            blocks: dict[int, list[ShardSpec]] = {}
            for spec in table.specs or ():
                blocks.setdefault(spec.offsets[1], []).append(spec)
            self._units[table.name] = [
                NodeUnit(
                    table,
                    topology.node_of(blocks[col][0].rank),
                    tuple(sorted(blocks[col], key=lambda s: s.offsets[0])),
                )
                for col in sorted(blocks)
            ]
        units = [u for t in self._tables for u in self._units[t.name]]
        needs = {t.name for t in self._tables if self._needs_row_sums(t)}
        self._core = RowWiseInNodes(
            units,
            options,
            topology,
            # a table with cross-node row sums gets its own kernel (its collective per step)
            kernel_key=lambda config: config.name if config.name in needs else None,
        )
        self._by_feature = {f: t for t in self._tables for f in t.config.feature_names}
        # Process groups are made by every rank, in table order, whether it joins or not.
        node_groups(options.pg, topology)
        self._row_groups: dict[str, Any] = {}
        for table in self._tables:
            if not self._needs_row_sums(table):
                continue
            for local in range(topology.local_world_size):
                ranks = sorted(u.specs[local].rank for u in self._units[table.name])
                group = subgroup(options.pg, ranks)
                if options.rank in ranks:
                    self._row_groups[table.name] = group

    def _needs_row_sums(self, table: BagTable) -> bool:
        return (
            self._row_wise
            and len(self._units[table.name]) > 1
            and table.compute_kernel is not ComputeKernel.DENSE
        )

    def feature_names(self) -> list[str]:
        """Features in output order (the collection's order)."""
        return [f for t in self._tables for f in t.config.feature_names]

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self.feature_names()]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def create_input_dist(self) -> nn.Module:
        return self._core.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        if not self._row_wise:
            return self._core.create_lookup()
        lookup = self._core.create_lookup(backend="torch")
        for group, tbe in lookup.torch_tbes():
            reductions: list[RowReduction | None] = []
            for table in group.embedding_tables:
                pg = self._row_groups.get(table.name)
                reductions.append(
                    None
                    if pg is None
                    else RowReduction(ColumnRowSum(pg, table.name), table.embedding_dim)
                )
            tbe.row_reductions = reductions
        return lookup

    def create_output_dist(self) -> nn.Module:
        return self._core.create_output_dist(columns=self._columns())

    def _columns(self) -> list[int]:
        """Received column of each output column (every feature's blocks side by side)."""
        entry = {pair: i for i, pair in enumerate(self._core.entries)}
        first = self._core.received_columns()
        columns: list[int] = []
        for feature in self.feature_names():
            for unit in self._units[self._by_feature[feature].name]:
                start = first[entry[(unit.node, feature)]]
                columns.extend(range(start, start + unit.width))
        return columns
