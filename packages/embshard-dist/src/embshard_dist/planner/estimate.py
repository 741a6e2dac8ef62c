"""Estimated memory and step time of a whole plan, per rank and per table.

:func:`estimate_plan` adds up the cost model of :mod:`~embshard_dist.planner.costs` shard by
shard for any plan (the planner's, a hand-written one, TorchRec's converted).

Guarantees: pure and deterministic; for a plan made by the planner it reproduces what the
partitioner balanced; a plan missing a table or naming ranks outside the world raises
``ValueError`` naming the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from embshard_dist.planner.constraints import (
    DEFAULT_BATCH_SIZE,
    ParameterConstraints,
    check_constraints,
)
from embshard_dist.planner.cost_model import (
    DEFAULT_RESERVE_FRACTION,
    ZERO,
    Cost,
    CostModel,
    LoadedTable,
    load_tables,
    usable_memory,
)
from embshard_dist.planner.costs import collective_overhead, mixing_cost, sharding_costs
from embshard_dist.planner.tables import TableSource, find_tables
from embshard_dist.planner.topology import Topology
from embshard_optim.specs import OptimizerSpec
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ShardingType

__all__ = [
    "PlanEstimate",
    "RankEstimate",
    "TableEstimate",
    "estimate_plan",
    "estimate_tables",
]


@dataclass(frozen=True)
class RankEstimate:
    """One rank's estimated step.

    Args:
        compute_ms: lookup, backward and update time.
        storage: device bytes used by tables.
        usable: device bytes left for tables (capacity less the reserve and the dense part).
        host_storage: host bytes used (CUDA UVM tables).
    """

    rank: int
    compute_ms: float
    comms_ms: float
    storage: int
    capacity: int
    usable: int
    host_storage: int = 0
    host_capacity: int = 0

    @property
    def total_ms(self) -> float:
        """Compute plus comms."""
        return self.compute_ms + self.comms_ms


@dataclass(frozen=True)
class TableEstimate:
    """One table's share of the estimated step (``per_rank``: its cost on each rank it touches)."""

    key: str
    sharding: ParameterSharding
    per_rank: Mapping[int, Cost] = field(hash=False)

    @property
    def storage(self) -> int:
        """Device bytes over all ranks."""
        return sum(c.storage for c in self.per_rank.values())

    @property
    def max_ms(self) -> float:
        """Its largest time on any one rank."""
        return max((c.time_s for c in self.per_rank.values()), default=0.0) * 1e3


@dataclass(frozen=True)
class PlanEstimate:
    """The estimated memory and step time of a plan, per rank and per table.

    Args:
        overhead: per-rank collective latency of the sharding types used.
    """

    ranks: tuple[RankEstimate, ...]
    tables: tuple[TableEstimate, ...]
    overhead: Cost
    topology: Topology = field(hash=False)

    @property
    def max_ms(self) -> float:
        """The slowest rank's step time (the plan's estimated step time)."""
        return max(r.total_ms for r in self.ranks)

    @property
    def critical_rank(self) -> int:
        """The slowest rank (the lowest among equals)."""
        return max(self.ranks, key=lambda r: (r.total_ms, -r.rank)).rank

    @property
    def imbalance(self) -> float:
        """Slowest rank's time over the mean rank time (1.0 is perfectly balanced)."""
        mean = sum(r.total_ms for r in self.ranks) / len(self.ranks)
        return self.max_ms / mean if mean > 0 else 1.0

    @property
    def storage_imbalance(self) -> float:
        """Largest rank's storage over the mean (1.0 is perfectly balanced)."""
        mean = sum(r.storage for r in self.ranks) / len(self.ranks)
        return max(r.storage for r in self.ranks) / mean if mean > 0 else 1.0

    def per_rank_ms(self) -> list[dict[str, float]]:
        """``[{"compute_ms", "comms_ms", "total_ms"}]`` per rank, for reports and comparisons."""
        return [
            {"compute_ms": r.compute_ms, "comms_ms": r.comms_ms, "total_ms": r.total_ms}
            for r in self.ranks
        ]


def _plan_shardings(plan: ShardingPlan) -> dict[str, ParameterSharding]:
    out: dict[str, ParameterSharding] = {}
    for path, module_plan in plan.items():
        if isinstance(module_plan, EmbeddingModuleShardingPlan):
            for name, ps in module_plan.items():
                out[f"{path}.{name}" if path else name] = ps
    return out


def estimate_tables(
    loaded: Sequence[LoadedTable],
    shardings: Mapping[str, ParameterSharding],
    model: CostModel,
    *,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    dense_bytes: int = 0,
) -> PlanEstimate:
    """Estimate given each table's sharding (keyed by qualified name).

    Raises:
        ValueError: a table without a sharding.
    """
    topo = model.topology
    n = topo.world_size
    totals = [ZERO] * n
    tables = []
    used: list[ShardingType] = []
    for lt in loaded:
        ps = shardings.get(lt.table.key)
        if ps is None:
            raise ValueError(
                f"the plan has no sharding for table {lt.table.key!r}; plan every table "
                f"(the plan shards {sorted(shardings)})"
            )
        ps.check_world(n, table=lt.table.key)
        costs = sharding_costs(lt, ps, model)
        totals = [a + b for a, b in zip(totals, costs, strict=True)]
        tables.append(
            TableEstimate(lt.table.key, ps, {r: c for r, c in enumerate(costs) if c != ZERO})
        )
        if ps.sharding_type not in used:
            used.append(ps.sharding_type)
    overhead = mixing_cost(loaded, model) if len(used) > 1 else ZERO
    for kind in used:
        overhead = overhead + collective_overhead(kind, model)
    usable = usable_memory(topo.memory_per_rank, reserve_fraction, dense_bytes)
    ranks = tuple(
        RankEstimate(
            rank=r,
            compute_ms=(c.compute_s + overhead.compute_s) * 1e3,
            comms_ms=(c.comms_s + overhead.comms_s) * 1e3,
            storage=c.storage,
            capacity=topo.memory_per_rank,
            usable=usable,
            host_storage=c.host_storage,
            host_capacity=topo.host_memory_per_rank,
        )
        for r, c in enumerate(totals)
    )
    return PlanEstimate(ranks, tuple(tables), overhead, topo)


def estimate_plan(
    plan: ShardingPlan,
    tables: TableSource,
    topology: Topology,
    *,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    optimizer: OptimizerSpec | None = None,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    dense_bytes: int = 0,
) -> PlanEstimate:
    """Estimated memory and step time per rank of ``plan`` (any plan, not only the planner's).

    Args:
        tables: the model or table list the plan is for.
        constraints: traffic figures per table (pooling factors, batch sizes...).
        batch_size: samples per rank per step when constraints give none.
        optimizer: the embedding optimizer (default: RowWiseAdagrad).
        reserve_fraction: share of each rank's memory kept free.
        dense_bytes: bytes of dense parameters every rank holds.

    Raises:
        ValueError: the plan misses a table or names ranks outside the topology's world.
    """
    found = find_tables(tables)
    check_constraints(found, constraints, topology.world_size)
    loaded = load_tables(found, constraints, batch_size)
    model = CostModel.build(topology, optimizer)
    return estimate_tables(
        loaded,
        _plan_shardings(plan),
        model,
        reserve_fraction=reserve_fraction,
        dense_bytes=dense_bytes,
    )
