"""A rule-based sharding plan: table bytes (weights plus optimizer state) balanced across ranks.

``SimplePlanner`` writes the plan a user asks for (table-wise by default, one type for all, one
per table, or ``"auto"``: data-parallel for small tables, row-wise for tables above a fair
share, table-wise otherwise), placing the largest tables first on the least-loaded rank.

Guarantees: the plan depends only on table shapes, options and world size, so every rank
computes the same one; bad requests raise ``ValueError`` naming the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from embshard_dist.planner.agreement import check_plan_agreement
from embshard_dist.planner.requests import AUTO, ShardingRequest, normalise_request
from embshard_dist.sharded.shardable import TableShape, find_shardable_modules, table_shapes
from embshard_dist.strategies.layout import column_wise_dims, row_wise_sizes, shard_specs
from embshard_optim.specs import OptimizerSpec
from embshard_types.interfaces import ModuleSharder, ShardingPlanner
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = ["DEFAULT_SMALL_TABLE_BYTES", "SimplePlanner", "shard_bytes"]

DEFAULT_SMALL_TABLE_BYTES = 64 * 1024
"""Tables up to this many bytes (weights + optimizer state) are data-parallel under ``auto``."""

_STATE_BYTES = 4  # optimizer state is kept in fp32


def shard_bytes(shape: TableShape, rows: int, cols: int, optimizer: OptimizerSpec | None) -> int:
    """Bytes a ``rows x cols`` shard of the table takes with its optimizer state, if any."""
    per_row = cols * shape.element_bytes
    if optimizer is not None:
        for name in optimizer.state_names():
            per_row += _STATE_BYTES * (1 if optimizer.state_is_rowwise(name) else cols)
    return rows * per_row


@dataclass(frozen=True)
class _Table:
    path: str
    shape: TableShape
    sharder: ModuleSharder[Any]
    kind: ShardingType
    nbytes: int


class SimplePlanner(ShardingPlanner):
    """A rule-based planner (see the module docstring for the rules).

    Args:
        device_type: the compute device type (``cpu``, ``cuda``); shard placements name it.
        sharding: ``None`` (table-wise), one type or ``"auto"`` for all, or a mapping of table
            name (or ``"path.table"``) to a type or ``"auto"``.
        local_world_size: ranks per node, for the node-aware types (default: ``world_size``).
        small_table_bytes: the largest table ``auto`` makes data-parallel.
        pg: the process group ``collective_plan`` checks agreement on (``None``: default).

    Raises:
        ValueError: a bad world size, node size or sharding type name.
    """

    def __init__(
        self,
        world_size: int,
        *,
        device_type: str = "cpu",
        sharding: ShardingRequest | None = None,
        optimizer: OptimizerSpec | None = None,
        local_world_size: int | None = None,
        small_table_bytes: int = DEFAULT_SMALL_TABLE_BYTES,
        pg: Any = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"SimplePlanner: world_size must be a positive int, got {world_size!r}"
            )
        local = world_size if local_world_size is None else local_world_size
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise ValueError(
                f"SimplePlanner: local_world_size must be a positive int, got {local!r}"
            )
        if world_size % local:
            raise ValueError(
                f"SimplePlanner: local_world_size {local} does not divide world_size "
                f"{world_size}; give the number of ranks per node"
            )
        self.world_size = world_size
        self.local_world_size = local
        self.device_type = device_type
        self.optimizer = optimizer
        self.small_table_bytes = small_table_bytes
        self._pg = pg
        self._default, self._per_table = normalise_request(sharding)

    def plan(self, module: nn.Module, sharders: Sequence[ModuleSharder[Any]]) -> ShardingPlan:
        """Plan every shardable sub-module of ``module`` (no communication).

        Raises:
            ValueError: a requested table does not exist, or a requested sharding type is
                unknown or not supported by the table's sharder on this device.
        """
        found = find_shardable_modules(module, sharders)
        shapes = {path: table_shapes(m, sharder) for path, (m, sharder) in found.items()}
        self._check_requested_tables(shapes)
        whole = {
            (path, s.name): shard_bytes(s, s.rows, s.dim, self.optimizer)
            for path, ss in shapes.items()
            for s in ss
        }
        total = sum(whole.values())
        tables = [
            _Table(path, s, found[path][1], self._kind(path, s, found[path][1], whole, total), n)
            for path, ss in shapes.items()
            for s in ss
            for n in [whole[(path, s.name)]]
        ]
        tables.sort(key=lambda t: (-t.nbytes, t.path, t.shape.name))
        loads = [0] * self.world_size
        placed = {(t.path, t.shape.name): self._place(t, loads) for t in tables}
        return ShardingPlan(
            {
                path: EmbeddingModuleShardingPlan({s.name: placed[(path, s.name)] for s in ss})
                for path, ss in shapes.items()
            }
        )

    def collective_plan(
        self, module: nn.Module, sharders: Sequence[ModuleSharder[Any]]
    ) -> ShardingPlan:
        """Plan on every rank and check with one all-gather that all got the same plan.

        Raises:
            ValueError: on every rank, when the ranks' plans differ (the message lists them).
        """
        plan = self.plan(module, sharders)
        check_plan_agreement(plan, self._pg)
        return plan

    def _check_requested_tables(self, shapes: Mapping[str, list[TableShape]]) -> None:
        known = {s.name for ss in shapes.values() for s in ss}
        known |= {_qualified(path, s.name) for path, ss in shapes.items() for s in ss}
        unknown = sorted(set(self._per_table) - known)
        if unknown:
            raise ValueError(
                f"sharding request names tables {unknown} that the model does not have; its "
                f"tables are {sorted(s.name for ss in shapes.values() for s in ss)}"
            )

    def _requested(self, path: str, table: str) -> ShardingType | str:
        for key in (_qualified(path, table), table):
            if key in self._per_table:
                return self._per_table[key]
        return self._default

    def _kind(
        self,
        path: str,
        shape: TableShape,
        sharder: ModuleSharder[Any],
        whole: Mapping[tuple[str, str], int],
        total: int,
    ) -> ShardingType:
        supported = list(sharder.sharding_types(self.device_type))
        requested = self._requested(path, shape.name)
        if requested == AUTO:
            nbytes = whole[(path, shape.name)]
            wanted = ShardingType.TABLE_WISE
            if self.world_size > 1 and nbytes <= self.small_table_bytes:
                wanted = ShardingType.DATA_PARALLEL
            elif nbytes * self.world_size > total and shape.rows >= self.world_size:
                wanted = ShardingType.ROW_WISE
            if wanted in supported:
                return wanted
            return ShardingType.TABLE_WISE if ShardingType.TABLE_WISE in supported else supported[0]
        assert isinstance(requested, ShardingType)
        if requested not in supported:
            names = ", ".join(k.value for k in supported)
            raise ValueError(
                f"table {shape.name!r} of module {path!r}: sharding type {requested.value!r} is "
                f"not supported by {type(sharder).__name__} on {self.device_type}; "
                f"supported: {names}"
            )
        return requested

    def _place(self, table: _Table, loads: list[int]) -> ParameterSharding:
        shape, kind = table.shape, table.kind
        if kind is ShardingType.DATA_PARALLEL:
            for r in range(self.world_size):
                loads[r] += table.nbytes
            return self._sharding(table, range(self.world_size), shards=False)
        if kind is ShardingType.TABLE_WISE:
            rank = _least_loaded(loads, range(self.world_size))
            loads[rank] += table.nbytes
            return self._sharding(table, [rank])
        if kind is ShardingType.ROW_WISE:
            everyone = list(range(self.world_size))
            self._load_rows(table, everyone, shape.dim, loads)
            return self._sharding(table, everyone)
        if kind is ShardingType.COLUMN_WISE:
            return self._sharding(table, self._place_columns(table, range(self.world_size), loads))
        node = self._least_loaded_node(loads)
        if kind is ShardingType.TABLE_ROW_WISE:
            self._load_rows(table, node, shape.dim, loads)
            return self._sharding(table, node)
        if kind is ShardingType.TABLE_COLUMN_WISE:
            return self._sharding(table, self._place_columns(table, node, loads))
        # GRID_SHARD: column blocks, each cut row-wise over the least-loaded node.
        dims = column_wise_dims(shape.dim, world_size=self.num_nodes, table_name=shape.name)
        ranks: list[int] = []
        for width in dims:
            node = self._least_loaded_node(loads)
            self._load_rows(table, node, width, loads)
            ranks.extend(node)
        return self._sharding(table, ranks)

    @property
    def num_nodes(self) -> int:
        """Number of nodes (``world_size / local_world_size``)."""
        return self.world_size // self.local_world_size

    def _nodes(self) -> list[list[int]]:
        lws = self.local_world_size
        return [list(range(n * lws, (n + 1) * lws)) for n in range(self.num_nodes)]

    def _least_loaded_node(self, loads: Sequence[int]) -> list[int]:
        nodes = self._nodes()
        best = min(range(len(nodes)), key=lambda n: (sum(loads[r] for r in nodes[n]), n))
        return nodes[best]

    def _load_rows(self, table: _Table, ranks: Sequence[int], cols: int, loads: list[int]) -> None:
        sizes = row_wise_sizes(table.shape.rows, len(ranks), table_name=table.shape.name)
        for rank, rows in zip(ranks, sizes, strict=True):
            loads[rank] += shard_bytes(table.shape, rows, cols, self.optimizer)

    def _place_columns(self, table: _Table, ranks: Sequence[int], loads: list[int]) -> list[int]:
        shape = table.shape
        dims = column_wise_dims(shape.dim, world_size=len(ranks), table_name=shape.name)
        chosen: list[int] = []
        for width in dims:
            free = [r for r in ranks if r not in chosen] or list(ranks)
            rank = _least_loaded(loads, free)
            loads[rank] += shard_bytes(shape, shape.rows, width, self.optimizer)
            chosen.append(rank)
        return chosen

    def _sharding(
        self, table: _Table, ranks: Sequence[int] | range, *, shards: bool = True
    ) -> ParameterSharding:
        shape, kind = table.shape, table.kind
        specs = (
            shard_specs(
                kind,
                shape.rows,
                shape.dim,
                list(ranks),
                self.device_type,
                local_world_size=self.local_world_size,
                table_name=shape.name,
            )
            if shards
            else None
        )
        return ParameterSharding(
            sharding_type=kind,
            compute_kernel=self._kernel(table),
            ranks=tuple(ranks),
            shards=tuple(specs) if specs is not None else None,
        )

    def _kernel(self, table: _Table) -> ComputeKernel:
        kernels = list(table.sharder.compute_kernels(table.kind, self.device_type))
        if not kernels:
            raise ValueError(
                f"table {table.shape.name!r}: {type(table.sharder).__name__} offers no compute "
                f"kernel for {table.kind.value} on {self.device_type}"
            )
        return ComputeKernel.FUSED if ComputeKernel.FUSED in kernels else kernels[0]


def _qualified(path: str, table: str) -> str:
    return f"{path}.{table}" if path else table


def _least_loaded(loads: Sequence[int], ranks: Sequence[int] | range) -> int:
    return min(ranks, key=lambda r: (loads[r], r))
