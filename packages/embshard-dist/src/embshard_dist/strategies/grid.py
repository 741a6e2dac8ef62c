"""Grid sharding: each table's columns are cut into blocks, each block placed table-row-wise.

Runs as :mod:`.twrw` with every column block as a unit. Row-wise optimizer statistics are
summed over the ranks holding one row (:class:`~embshard_dist.strategies.cw.ColumnRowSum`),
so every block applies the unsharded update; one kernel per such table keeps the order fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from embshard_dist.strategies.base import BagTable
from embshard_dist.strategies.cw import ROW_WISE_OPTIMIZERS, ColumnRowSum
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.nodes import node_groups, subgroup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.twrw import NodeUnit, RowWiseInNodes, node_topology
from embshard_optim.sparse_rules.base import RowReduction
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = ["GridSharding"]


class GridSharding:
    """Grid sharding of ``tables`` (column blocks on distinct nodes, each cut over its node).

    Args:
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
            # A table with cross-node row sums gets its own kernel, so collectives keep one order.
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
        return [f for t in self._tables for f in t.config.feature_names]

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self.feature_names()]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def create_input_dist(self) -> nn.Module:
        return self._core.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        if not any(self._needs_row_sums(t) for t in self._tables):
            # no row sums to exchange (e.g. one column block per table on one node): the
            # fused path of choice, as table-row-wise runs
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
