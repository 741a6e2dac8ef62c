"""Grid sharding: each table's columns are cut into blocks, each block placed table-row-wise.

Runs as :mod:`.twrw` with every column block as a unit. Row-wise optimizer statistics are
summed over the ranks holding one row (:class:`~embshard_dist.strategies.cw.ColumnRowSum`),
so every block applies the unsharded update; the tables summed over one set of ranks share a
kernel and one gather, in one order on every rank of the set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from embshard_dist.strategies.base import BagTable
from embshard_dist.strategies.cw import ROW_WISE_OPTIMIZERS, RowSumsByRanks
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.nodes import node_groups, subgroup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.twrw import NodeUnit, RowWiseInNodes, node_topology
from embshard_kernels.grouping import ShardedTableConfig
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
        self._needs = {t.name for t in self._tables if self._needs_row_sums(t)}
        # Per (table, row offset): the ranks holding those rows, one per column block; they
        # sum each touched row's partial squares. Every rank creates every group, in table order.
        node_groups(options.pg, topology)
        self._row_ranks: dict[tuple[str, int], tuple[int, ...]] = {}
        self._row_groups: dict[tuple[int, ...], Any] = {}
        for table in self._tables:
            if table.name not in self._needs:
                continue
            for local in range(topology.local_world_size):
                specs = [u.specs[local] for u in self._units[table.name]]
                ranks = tuple(sorted(spec.rank for spec in specs))
                for spec in specs:
                    self._row_ranks[(table.name, spec.offsets[0])] = ranks
                if ranks not in self._row_groups:
                    self._row_groups[ranks] = subgroup(options.pg, list(ranks))
        self._core = RowWiseInNodes(
            units,
            options,
            topology,
            # Tables whose rows are summed over one set of ranks share a kernel (one gather of
            # row sums for all); kernels keep one order on every rank of the set.
            kernel_key=lambda c: self._row_sum_ranks(c) if c.name in self._needs else None,
        )
        self._by_feature = {f: t for t in self._tables for f in t.config.feature_names}

    def _row_sum_ranks(self, config: ShardedTableConfig) -> tuple[int, ...]:
        """The ranks that sum the rows of the shard ``config`` holds."""
        assert config.local_metadata is not None
        return self._row_ranks[(config.name, config.local_metadata.offsets[0])]

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
        if not self._needs:
            # no row sums to exchange (e.g. one column block per table on one node): the
            # fused path of choice, as table-row-wise runs
            return self._core.create_lookup()
        lookup = self._core.create_lookup(backend="torch")
        row_sums = RowSumsByRanks(self._row_groups, prefix="grid_")
        for group, tbe in lookup.torch_tbes():
            tbe.row_reductions = [
                row_sums.reduction(self._row_sum_ranks(t), t.embedding_dim)
                if t.name in self._needs
                else None
                for t in group.embedding_tables
            ]
        return lookup

    def create_output_dist(self) -> nn.Module:
        return self._core.create_output_dist(columns=self._columns())

    def _columns(self) -> list[int]:
        """Received column of each output column (every feature's blocks side by side)."""
        return self._core.columns_of(
            (unit.node, feature)
            for feature in self.feature_names()
            for unit in self._units[self._by_feature[feature].name]
        )
