"""Column-wise sharding: each table's columns are cut into blocks, each placed like a table.

Exact for point-wise optimizers; row-wise optimizer statistics gather the blocks' partial row
sums (:class:`ColumnRowSum`, added in rank order), so every block applies the unsharded update.
Kernels run in one order on every rank, so their gathers cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.gather import start_all_gather
from embshard_dist.strategies.base import BagTable, shard_config
from embshard_dist.strategies.lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.strategies.nodes import subgroup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.route import PooledOutputDist, RoutedInputDist
from embshard_dist.strategies.sequence import PooledSequenceSharding, blocks_output_dist
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig
from embshard_kernels.tbe import Backend
from embshard_optim.sparse_rules.base import RowReduction
from embshard_optim.specs import OptimType
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, ComputeKernel, PoolingType, ShardingType

ROW_WISE_OPTIMIZERS = frozenset(
    {
        OptimType.ROWWISE_ADAGRAD,
        OptimType.PARTIAL_ROWWISE_ADAM,
        OptimType.LAMB,
        OptimType.PARTIAL_ROWWISE_LAMB,
        OptimType.LARS_SGD,
    }
)
"""Optimizers whose update uses statistics over a whole row."""


class ColumnRowSum:
    """``RowReduction.row_sum`` over one set of ranks: gathers partial sums, adds in rank order."""

    def __init__(self, group: dist.ProcessGroup, label: str) -> None:
        self._group = group
        self._size = dist.get_world_size(group)
        self._name = f"column_wise_row_sums.{label}"

    def __call__(self, partial: Tensor) -> Tensor:
        local = partial.contiguous()
        gathered = local.new_empty((self._size * local.shape[0], *local.shape[1:]))
        start_all_gather(self._name, gathered, local, group=self._group).wait()
        parts = gathered.view(self._size, *local.shape)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total


class RowSumsByRanks:
    """One :class:`ColumnRowSum` per set of ranks (from ``groups``), shared by every table whose
    rows are summed over it, so a kernel of such tables gathers once."""

    def __init__(
        self, groups: Mapping[tuple[int, ...], dist.ProcessGroup], prefix: str = ""
    ) -> None:
        self._groups = groups
        self._prefix = prefix
        self._made: dict[tuple[int, ...], ColumnRowSum] = {}

    def reduction(self, ranks: tuple[int, ...], full_dim: int) -> RowReduction:
        """The row reduction over ``ranks`` of a table ``full_dim`` wide."""
        row_sum = self._made.get(ranks)
        if row_sum is None:
            label = self._prefix + "ranks_" + "_".join(str(r) for r in ranks)
            row_sum = self._made[ranks] = ColumnRowSum(self._groups[ranks], label)
        return RowReduction(row_sum, full_dim)


class CwSharding:
    """Column-wise sharding of ``tables`` (blocks spanning all rows, one per rank at most)."""

    sharding_type = ShardingType.COLUMN_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._tables = list(tables)
        self._options = options
        self._row_wise = options.fused_params.optimizer.optim_type in ROW_WISE_OPTIMIZERS
        per_rank: list[list[ShardedTableConfig]] = [[] for _ in range(options.world_size)]
        for table in self._tables:
            for spec in sorted(table.specs or (), key=lambda s: s.offsets[1]):
                per_rank[spec.rank].append(shard_config(table, spec, options))
        self._per_rank = per_rank
        self._ranks = {t.name: tuple(sorted(s.rank for s in t.specs or ())) for t in self._tables}
        self._wire = [
            kernel_feature_order(configs, kernel_key=self._kernel_key) for configs in per_rank
        ]
        self._by_feature = {f: t for t in self._tables for f in t.config.feature_names}
        # Every rank creates every group, in table order, whether it joins or not.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for t in self._tables:
            ranks = self._ranks[t.name]
            if self._needs_row_sums(t) and ranks not in self._groups:
                self._groups[ranks] = subgroup(options.pg, list(ranks))

    def _kernel_key(self, config: ShardedTableConfig) -> tuple[int, ...] | str | None:
        """Kernel grouping that keeps row-sum calls in one order on every rank."""
        if not self._row_wise:
            return None
        if config.pooling is PoolingType.NONE:
            return config.name
        return self._ranks[config.name]

    def _needs_row_sums(self, table: BagTable) -> bool:
        return (
            self._row_wise
            and len(table.specs or ()) > 1
            and table.compute_kernel is not ComputeKernel.DENSE
        )

    def feature_names(self) -> list[str]:
        return [f for t in self._tables for f in t.config.feature_names]

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self.feature_names()]

    def features_per_rank(self) -> list[list[str]]:
        """Per rank, the features its lookup takes (one per block it holds)."""
        return [list(features) for features in self._wire]

    def tables_per_rank(self) -> list[list[ShardedTableConfig]]:
        """Per rank, the column blocks its lookup holds."""
        return [list(configs) for configs in self._per_rank]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def create_input_dist(self) -> nn.Module:
        return RoutedInputDist(
            self._options.pg,
            self._wire,
            {f: t.name for f, t in self._by_feature.items()},
            is_weighted=self._options.is_weighted,
        )

    def create_lookup(self) -> GroupedBagLookup:
        configs = self._per_rank[self._options.rank]
        by_name = {t.name: t for t in self._tables}

        def backend(group: GroupedEmbeddingConfig) -> Backend:
            # Only kernels holding a block that exchanges row sums need the torch TBE's hook;
            # the others take the fused path of choice (same kernels, same order).
            tables = group.embedding_tables
            return "torch" if any(self._needs_row_sums(by_name[t.name]) for t in tables) else "auto"

        lookup = GroupedBagLookup(
            configs, self._options, backend=backend, kernel_key=self._kernel_key
        )
        row_sums = RowSumsByRanks(self._groups)
        for group, tbe in lookup.torch_tbes():
            tbe.row_reductions = [
                row_sums.reduction(self._ranks[t.name], by_name[t.name].config.embedding_dim)
                if self._needs_row_sums(by_name[t.name])
                else None
                for t in group.embedding_tables
            ]
        return lookup

    def create_output_dist(self) -> nn.Module:
        return PooledOutputDist(
            self._options.pg,
            [sum(c.cols * c.num_features for c in configs) for configs in self._per_rank],
            columns=self._columns(),
            codecs=self._options.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL),
        )

    def _columns(self) -> list[int]:
        """Received column of each output column (every feature's blocks side by side)."""
        start: dict[tuple[str, int], int] = {}
        at = 0
        for configs, wire in zip(self._per_rank, self._wire, strict=True):
            block = {c.name: c for c in configs}
            for feature in wire:
                config = block[self._by_feature[feature].name]
                assert config.local_metadata is not None
                start[(feature, config.local_metadata.offsets[1])] = at
                at += config.cols
        columns: list[int] = []
        for feature in self.feature_names():
            table = self._by_feature[feature]
            for spec in sorted(table.specs or (), key=lambda s: s.offsets[1]):
                first = start[(feature, spec.offsets[1])]
                columns.extend(range(first, first + spec.sizes[1]))
        return columns


class CwSequenceSharding(PooledSequenceSharding[CwSharding]):
    """Column-wise sharding of sequence ``tables``."""

    sharding_type = ShardingType.COLUMN_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(CwSharding(tables, options), options, blocks_output_dist)
