"""Table-row-wise sharding: each table lives on one node, its rows cut over that node's ranks.

Partial bags are summed inside the node, so only pooled sums cross nodes; updates are exact and
the forward matches unsharded up to float reassociation. :class:`RowWiseInNodes` is shared with
:mod:`.grid`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from embshard_dist.strategies.base import BagTable, shard_config
from embshard_dist.strategies.layout import boundaries
from embshard_dist.strategies.lookup import GroupedBagLookup, KernelKey, kernel_feature_order
from embshard_dist.strategies.node_dist import (
    NodeRowWiseInputDist,
    NodeRowWiseOutputDist,
    padded_boundaries,
)
from embshard_dist.strategies.nodes import NodeTopology, node_groups, resolve_local_world_size
from embshard_dist.strategies.options import ShardingOptions
from embshard_kernels.grouping import ShardedTableConfig
from embshard_kernels.tbe import Backend
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, PoolingType, ShardingType

__all__ = ["NodeUnit", "RowWiseInNodes", "TwRwSharding", "node_topology"]


@dataclass(frozen=True)
class NodeUnit:
    """A table, or one column block of it, cut into row blocks over the ranks of one node."""

    table: BagTable
    node: int
    specs: tuple[ShardSpec, ...]

    @property
    def first_column(self) -> int:
        return self.specs[0].offsets[1]

    @property
    def width(self) -> int:
        return self.specs[0].sizes[1]

    def row_boundaries(self) -> list[int]:
        return boundaries([s.sizes[0] for s in self.specs])


def node_topology(options: ShardingOptions, local_world_size: int | None) -> NodeTopology:
    """The nodes of the sharding group of ``options``."""
    size = resolve_local_world_size(options.world_size, local_world_size)
    return NodeTopology(options.world_size, size, options.rank)


class RowWiseInNodes:
    """Units cut row-wise over their node's ranks: configs, feature routing and dists.

    Features are (node, feature) pairs, node by node, each in its node's kernel order.

    Raises:
        ValueError: a unit's blocks are not one per rank of its node.
    """

    def __init__(
        self,
        units: Sequence[NodeUnit],
        options: ShardingOptions,
        topology: NodeTopology,
        *,
        kernel_key: KernelKey | None = None,
    ) -> None:
        self.units = list(units)
        self.options = options
        self.topology = topology
        self.kernel_key = kernel_key
        lws = topology.local_world_size
        per_rank: list[list[ShardedTableConfig]] = [[] for _ in range(topology.world_size)]
        for unit in self.units:
            ranks = [s.rank for s in unit.specs]
            if ranks != topology.node_ranks(unit.node):
                raise ValueError(
                    f"table {unit.table.name!r}: its row blocks are on ranks {ranks}, expected "
                    f"one per rank of node {unit.node}: {topology.node_ranks(unit.node)}"
                )
            for spec in unit.specs:
                per_rank[spec.rank].append(
                    shard_config(unit.table, spec, options, pooling=PoolingType.SUM)
                )
        self.per_rank = per_rank

        self.entries: list[tuple[int, str]] = []
        self.wire: list[list[int]] = []
        for node in range(topology.num_nodes):
            orders = [
                kernel_feature_order(per_rank[r], kernel_key=kernel_key)
                for r in topology.node_ranks(node)
            ]
            assert all(o == orders[0] for o in orders), "ranks of a node group kernels alike"
            first = len(self.entries)
            self.entries.extend((node, f) for f in orders[0])
            self.wire.extend([list(range(first, len(self.entries)))] * lws)
        self._unit_of = {(u.node, f): u for u in self.units for f in u.table.config.feature_names}

    def unit(self, entry: int) -> NodeUnit:
        return self._unit_of[self.entries[entry]]

    def node_widths(self) -> list[int]:
        widths = [0] * self.topology.num_nodes
        for i, (node, _) in enumerate(self.entries):
            widths[node] += self.unit(i).width
        return widths

    def columns_of(self, pairs: Iterable[tuple[int, str]]) -> list[int]:
        """The received columns of the entries ``(node, feature)``, block after block."""
        first = self.received_columns()
        index = {pair: i for i, pair in enumerate(self.entries)}
        columns: list[int] = []
        for pair in pairs:
            i = index[pair]
            columns.extend(range(first[i], first[i] + self.unit(i).width))
        return columns

    def received_columns(self) -> dict[int, int]:
        """Entry -> the first column of its block in the output dist's received layout."""
        out: dict[int, int] = {}
        at = 0
        for i in range(len(self.entries)):
            out[i] = at
            at += self.unit(i).width
        return out

    def create_input_dist(self) -> nn.Module:
        feature_tables = {f: u.table.name for (_, f), u in self._unit_of.items()}
        return NodeRowWiseInputDist(
            self.options.pg,
            self.topology,
            [f for _, f in self.entries],
            [
                padded_boundaries(self.unit(i).row_boundaries(), node, self.topology)
                for i, (node, _) in enumerate(self.entries)
            ],
            self.wire,
            feature_tables,
            is_weighted=self.options.is_weighted,
            keep_lengths=any(self._mean()),
        )

    def _mean(self) -> list[bool]:
        return [
            self.unit(i).table.config.pooling is PoolingType.MEAN for i in range(len(self.entries))
        ]

    def create_lookup(self, *, backend: Backend = "auto") -> GroupedBagLookup:
        return GroupedBagLookup(
            self.per_rank[self.options.rank],
            self.options,
            backend=backend,
            kernel_key=self.kernel_key,
        )

    def create_output_dist(self, columns: Sequence[int] | None = None) -> nn.Module:
        """The output dist; ``columns``: output column -> received column (default: in order)."""
        received = [i for i in range(len(self.entries)) for _ in range(self.unit(i).width)]
        return NodeRowWiseOutputDist(
            self.topology,
            node_groups(self.options.pg, self.topology),
            self.node_widths(),
            received,
            self._mean(),
            columns=columns,
            reduce_codecs=self.options.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER),
            all_to_all_codecs=self.options.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL),
        )


class TwRwSharding:
    """Table-row-wise sharding of ``tables`` (each on the ranks of one node, in order)."""

    sharding_type = ShardingType.TABLE_ROW_WISE

    def __init__(
        self,
        tables: Sequence[BagTable],
        options: ShardingOptions,
        *,
        local_world_size: int | None = None,
    ) -> None:
        self._tables = list(tables)
        topology = node_topology(options, local_world_size)
        units = []
        for table in self._tables:
            specs = tuple(sorted(table.specs or (), key=lambda s: s.offsets[0]))
            units.append(NodeUnit(table, topology.node_of(specs[0].rank), specs))
        self._core = RowWiseInNodes(units, options, topology)
        self._dims = {
            f: t.config.embedding_dim for t in self._tables for f in t.config.feature_names
        }
        # Every rank creates the groups here, at the same point.
        node_groups(options.pg, topology)
        # Across nodes the all-to-all puts the columns in table order as it assembles them; on
        # one node they stay in the node's kernel order (a reorder would cost a copy there).
        self._table_order = topology.num_nodes > 1

    def feature_names(self) -> list[str]:
        if self._table_order:
            return [f for t in self._tables for f in t.config.feature_names]
        return [f for _, f in self._core.entries]

    def embedding_dims(self) -> list[int]:
        return [self._dims[f] for f in self.feature_names()]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def create_input_dist(self) -> nn.Module:
        return self._core.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        return self._core.create_lookup()

    def create_output_dist(self) -> nn.Module:
        if not self._table_order:
            return self._core.create_output_dist()
        entry = {feature: (node, feature) for node, feature in self._core.entries}
        columns = self._core.columns_of(entry[f] for f in self.feature_names())
        return self._core.create_output_dist(columns=columns)
