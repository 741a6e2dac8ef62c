"""Every way each table can be sharded on the device, with what each piece of it costs.

Each :class:`ShardingOption` (a sharding type, a kernel and a column-block count the sharder
and constraints allow) has a fixed ``base`` cost per rank and ``units`` the partitioner places
on a rank or a node. Shard sizes come from :mod:`embshard_dist.strategies.layout`, costs from
:mod:`embshard_dist.planner.estimate`, so :meth:`ShardingOption.build` gives exactly what the
partitioner balanced.

Guarantees: options come out in a fixed order; dominated options and options the sharders'
plan check refuses (:mod:`embshard_dist.planner.rules`) are dropped; a table left with no
option raises ``ValueError`` naming it, what it allows, what the sharder offers and why the
sharders refuse the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from embshard_dist.planner.cost_model import ZERO, Cost, CostModel, LoadedTable
from embshard_dist.planner.costs import batch_cost, holder_cost, replica_cost
from embshard_dist.planner.rules import kernel_refusal, type_refusal
from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.sharder import supported_kernels
from embshard_dist.strategies.layout import (
    MIN_COLUMN_BLOCK,
    column_wise_dims,
    row_wise_sizes,
    shard_specs,
)
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = [
    "SHARDING_TYPE_ORDER",
    "DefaultCapabilities",
    "ShardingCapabilities",
    "ShardingOption",
    "Unit",
    "default_sharders",
    "enumerate_options",
]

SHARDING_TYPE_ORDER = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.TABLE_COLUMN_WISE,
    ShardingType.GRID_SHARD,
    ShardingType.DATA_PARALLEL,
)
"""The order options are tried in (earlier wins ties)."""

_ONLY_WHEN_ASKED = (ComputeKernel.QUANT, ComputeKernel.DENSE)
"""Kernels a table gets only when its constraints list them: ``quant`` is inference-only, and
``dense`` tables are not trained by the embedding optimizer (they need a dense optimizer); a
table whose shape no fused kernel takes gets ``dense``, the one kernel the sharders accept."""


@runtime_checkable
class ShardingCapabilities(Protocol):
    """What a sharder tells the planner (``ModuleSharder`` has both methods)."""

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """Sharding types supported on the device."""
        ...

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """Kernels supported for ``sharding_type`` on the device."""
        ...


class DefaultCapabilities:
    """All seven sharding types with the kernels embshard's sharders train on the device."""

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        """Every sharding type."""
        return list(SHARDING_TYPE_ORDER)

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        """The kernels the sharders run for ``sharding_type`` on the device."""
        return supported_kernels(ShardingType.parse(sharding_type), compute_device_type)


def default_sharders() -> list[ShardingCapabilities]:
    """embshard's ``EmbeddingBagCollectionSharder`` and ``EmbeddingCollectionSharder``."""
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


@dataclass(frozen=True)
class Unit:
    """A piece of an option the partitioner places.

    Args:
        costs: one cost (placed on a rank) or one per rank of a node (placed on a node).
    """

    costs: tuple[Cost, ...]
    node: bool = False
    time_s: tuple[float, ...] = field(init=False, repr=False, compare=False)
    storage: tuple[int, ...] = field(init=False, repr=False, compare=False)
    host: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_s", tuple(c.time_s for c in self.costs))
        object.__setattr__(self, "storage", tuple(c.storage for c in self.costs))
        object.__setattr__(self, "host", tuple(c.host_storage for c in self.costs))


@dataclass(frozen=True)
class ShardingOption:
    """One way to shard one table, before placement.

    Args:
        table_index: index of the table in the planner's table list.
        base: fixed cost per rank.
        units: pieces to place (see the module docstring).
        allowed_ranks: ranks a rank unit may go to.
        allowed_nodes: nodes a node unit may go to.
    """

    table_index: int
    table: LoadedTable
    sharding_type: ShardingType
    compute_kernel: ComputeKernel
    base: tuple[Cost, ...]
    units: tuple[Unit, ...]
    allowed_ranks: tuple[int, ...]
    allowed_nodes: tuple[int, ...]
    column_blocks: int = 1
    base_time: tuple[float, ...] = field(init=False, repr=False, compare=False)
    base_storage: tuple[int, ...] = field(init=False, repr=False, compare=False)
    base_host: tuple[int, ...] = field(init=False, repr=False, compare=False)
    total_s: float = field(init=False, repr=False, compare=False)
    has_base: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "base_time", tuple(c.time_s for c in self.base))
        set_(self, "base_storage", tuple(c.storage for c in self.base))
        set_(self, "base_host", tuple(c.host_storage for c in self.base))
        set_(self, "has_base", any(c != ZERO for c in self.base))
        total = sum(self.base_time) + sum(sum(u.time_s) for u in self.units)
        set_(self, "total_s", total)

    @property
    def label(self) -> str:
        """``"column_wise x4 / fused"``-style name for messages."""
        blocks = f" x{self.column_blocks}" if self.column_blocks > 1 else ""
        return f"{self.sharding_type.value}{blocks} / {self.compute_kernel.value}"

    def min_storage_per_rank(self) -> int:
        """The most device bytes it puts on any one rank, however it is placed (a lower bound)."""
        base = max(self.base_storage, default=0)
        units = max((max(u.storage) for u in self.units), default=0)
        return base + units

    def build(self, placement: Sequence[int], model: CostModel) -> ParameterSharding:
        """The table's ``ParameterSharding`` for a placement of its units.

        Args:
            placement: the rank (rank units) or node (node units) of each unit, in order.
        """
        topo = model.topology
        t = self.table.table
        kind = self.sharding_type
        kwargs = self.table.constraints.sharding_kwargs()
        if kind is ShardingType.DATA_PARALLEL:
            ranks: list[int] = list(range(topo.world_size))
            return ParameterSharding(kind, self.compute_kernel, tuple(ranks), None, **kwargs)
        if kind is ShardingType.ROW_WISE:
            ranks = list(range(topo.world_size))
        elif kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            ranks = list(placement)
        elif kind is ShardingType.TABLE_COLUMN_WISE:
            ranks = topo.node_ranks(placement[0])[: self.column_blocks]
        else:  # TABLE_ROW_WISE, GRID_SHARD: the ranks of each block's node, block by block
            ranks = [r for node in placement for r in topo.node_ranks(node)]
        specs = shard_specs(
            kind,
            t.rows,
            t.dim,
            ranks,
            topo.compute_device,
            local_world_size=topo.ranks_per_node,
            table_name=t.key,
        )
        assert specs is not None
        return ParameterSharding(kind, self.compute_kernel, tuple(ranks), tuple(specs), **kwargs)


def _column_counts(dim: int, limit: int, min_partition: int) -> list[int]:
    """Column block counts to try: 2, 4, 8... and ``limit``, each leaving blocks >= min width."""
    if dim % MIN_COLUMN_BLOCK:
        return []
    most = min(limit, dim // min_partition)
    counts = []
    k = 2
    while k <= most:
        counts.append(k)
        k *= 2
    if most >= 2 and most not in counts:
        counts.append(most)
    return counts


def _kernels(
    lt: LoadedTable,
    sharder: ShardingCapabilities,
    kind: ShardingType,
    device: str,
    reasons: dict[str, None],
) -> list[ComputeKernel]:
    """The kernels ``lt`` may use for ``kind`` that the sharders accept for its shape; each
    refusal's reason is added to ``reasons``."""
    offered = [ComputeKernel.parse(k) for k in sharder.compute_kernels(kind, device)]
    wanted = lt.constraints.compute_kernels
    kernels = [k for k in offered if (k in wanted if wanted else k not in _ONLY_WHEN_ASKED)]
    accepted = []
    for kernel in dict.fromkeys(kernels):
        why = kernel_refusal(kernel, lt.table.dim)
        if why is None:
            accepted.append(kernel)
        else:
            reasons[why] = None
    if not accepted and not wanted:
        # A sharder of quantized collections offers only ``quant``; a shape no fused kernel
        # takes gets ``dense``.
        fallback: list[ComputeKernel] = [
            k for k in (ComputeKernel.DENSE, ComputeKernel.QUANT) if k in offered
        ]
        accepted = fallback[:1]
    accepted.sort(key=lambda k: k is not ComputeKernel.FUSED)
    return accepted


def _allowed(lt: LoadedTable, model: CostModel) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks ``lt`` may use, and the nodes all of whose ranks it may use."""
    topo = model.topology
    allowed = tuple(lt.constraints.ranks) if lt.constraints.ranks else tuple(range(topo.world_size))
    nodes = tuple(
        node for node in range(topo.num_nodes) if set(topo.node_ranks(node)) <= set(allowed)
    )
    return allowed, nodes


def _options_for(
    index: int,
    lt: LoadedTable,
    kind: ShardingType,
    kernel: ComputeKernel,
    model: CostModel,
) -> list[ShardingOption]:
    """The options of one type and kernel the sharders accept (see :mod:`.rules`).

    Column blocks go to distinct ranks (grid: distinct nodes), so there are at most as many
    as the ranks (nodes) the table may use.
    """
    topo = model.topology
    n, m = topo.world_size, topo.ranks_per_node
    t = lt.table
    allowed, nodes = _allowed(lt, model)
    min_part = max(MIN_COLUMN_BLOCK, lt.constraints.min_partition or MIN_COLUMN_BLOCK)

    memo: dict[tuple[int, int, int], Cost] = {}

    def held(rows: int, cols: int, blocks: int = 1) -> Cost:
        key = (rows, cols, blocks)
        if key not in memo:
            memo[key] = holder_cost(lt, kind, kernel, rows, cols, model, column_blocks=blocks)
        return memo[key]

    def option(base: Sequence[Cost], units: Sequence[Unit], blocks: int = 1) -> ShardingOption:
        return ShardingOption(
            index, lt, kind, kernel, tuple(base), tuple(units), allowed, nodes, blocks
        )

    if kind is ShardingType.DATA_PARALLEL:
        return [option([replica_cost(lt, kernel, model)] * n, [])]
    if kind is ShardingType.TABLE_WISE:
        holder = held(t.rows, t.dim)
        return [option([batch_cost(lt, kind, model)] * n, [Unit((holder,))])]
    if kind is ShardingType.ROW_WISE:
        batch = batch_cost(lt, kind, model)
        sizes = row_wise_sizes(t.rows, n, table_name=t.key)
        return [option([batch + held(s, t.dim) for s in sizes], [])]
    if kind is ShardingType.COLUMN_WISE:
        out = []
        for k in _column_counts(t.dim, len(allowed), min_part) or [1]:
            dims = column_wise_dims(t.dim, k, table_name=t.key)
            units = [Unit((held(t.rows, d, k),)) for d in dims]
            out.append(option([batch_cost(lt, kind, model, column_blocks=k)] * n, units, k))
        return out
    if kind is ShardingType.TABLE_ROW_WISE:
        sizes = row_wise_sizes(t.rows, m, table_name=t.key)
        unit = Unit(tuple(held(s, t.dim) for s in sizes), True)
        return [option([batch_cost(lt, kind, model)] * n, [unit])]
    if kind is ShardingType.TABLE_COLUMN_WISE:
        k = max(_column_counts(t.dim, m, min_part), default=1)
        dims = column_wise_dims(t.dim, k, table_name=t.key)
        costs = [held(t.rows, d, k) for d in dims]
        unit = Unit(tuple(costs) + (ZERO,) * (m - k), True)
        return [option([batch_cost(lt, kind, model, column_blocks=k)] * n, [unit], k)]
    # GRID_SHARD: one column block per node (as many as the width allows), each row-wise.
    k = max(_column_counts(t.dim, len(nodes), min_part), default=1)
    dims = column_wise_dims(t.dim, k, table_name=t.key)
    sizes = row_wise_sizes(t.rows, m, table_name=t.key)
    units = [
        Unit(
            tuple(held(s, d, k) for s in sizes),
            True,
        )
        for d in dims
    ]
    return [option([batch_cost(lt, kind, model, column_blocks=k)] * n, units, k)]


def _dominates(a: ShardingOption, b: ShardingOption) -> bool:
    """Whether ``a`` is nowhere worse than ``b`` (same type and shape)."""
    if a.sharding_type is not b.sharding_type or len(a.units) != len(b.units):
        return False
    pairs = [(a.base, b.base)] + [
        (ua.costs, ub.costs) for ua, ub in zip(a.units, b.units, strict=True)
    ]
    for ca_list, cb_list in pairs:
        if len(ca_list) != len(cb_list):
            return False
        for ca, cb in zip(ca_list, cb_list, strict=True):
            if (
                ca.time_s > cb.time_s
                or ca.storage > cb.storage
                or ca.host_storage > cb.host_storage
            ):
                return False
    return True


def _prune(options: list[ShardingOption]) -> list[ShardingOption]:
    """Drop options another of the same type and shape beats everywhere (first of equals stays)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, o in enumerate(options):
        shape = (o.sharding_type, o.column_blocks, tuple(len(u.costs) for u in o.units))
        groups.setdefault(shape, []).append(i)
    dropped: set[int] = set()
    for members in groups.values():
        for i in members:
            for j in members:
                if (
                    i != j
                    and j not in dropped
                    and _dominates(options[j], options[i])
                    and (j < i or not _dominates(options[i], options[j]))
                ):
                    dropped.add(i)
                    break
    return [o for i, o in enumerate(options) if i not in dropped]


def enumerate_options(
    tables: Sequence[LoadedTable],
    sharders: Sequence[Any],
    model: CostModel,
) -> list[list[ShardingOption]]:
    """The options of every table, in table order (``sharders``: one per table).

    Raises:
        ValueError: a table has no option left (named, with what was allowed and offered).
    """
    device = model.topology.compute_device
    world = model.topology.world_size
    out = []
    for index, (lt, sharder) in enumerate(zip(tables, sharders, strict=True)):
        offered = [ShardingType.parse(k) for k in sharder.sharding_types(device)]
        wanted = lt.constraints.sharding_types
        allowed, nodes = _allowed(lt, model)
        options: list[ShardingOption] = []
        reasons: dict[str, None] = {}
        for kind in SHARDING_TYPE_ORDER:
            if kind not in offered or (wanted and kind not in wanted):
                continue
            why = type_refusal(kind, lt.table.dim, allowed, world, nodes)
            if why is not None:
                reasons[why] = None
                continue
            for kernel in _kernels(lt, sharder, kind, device, reasons):
                options.extend(_options_for(index, lt, kind, kernel, model))
        if not options:
            raise ValueError(_no_option_message(lt, offered, sharder, device, model, list(reasons)))
        out.append(_prune(options))
    return out


def _no_option_message(
    lt: LoadedTable,
    offered: list[ShardingType],
    sharder: Any,
    device: str,
    model: CostModel,
    reasons: Sequence[str],
) -> str:
    c = lt.constraints
    allowed_types = [k.value for k in c.sharding_types] if c.sharding_types else "any"
    allowed_kernels = (
        [k.value for k in c.compute_kernels] if c.compute_kernels else "any training kernel"
    )
    kernels = {
        k.value: [ComputeKernel.parse(x).value for x in sharder.compute_kernels(k, device)]
        for k in offered
    }
    ranks = f", ranks {list(c.ranks)}" if c.ranks else ""
    t = lt.table
    where = f"module {t.path!r}: table {t.name!r}" if t.path else f"table {t.name!r}"
    why = f" The sharders refuse it: {'; '.join(reasons)}." if reasons else ""
    return (
        f"{where} has no sharding option on {device} with "
        f"{model.topology.world_size} ranks: its constraints allow sharding types "
        f"{allowed_types}, kernels {allowed_kernels}{ranks}; the sharder "
        f"{type(sharder).__name__} offers {kernels}.{why} Relax the table's constraints "
        "or change its shape"
    )
