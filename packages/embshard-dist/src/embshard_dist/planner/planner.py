"""``EmbeddingShardingPlanner``: the cost-based sharding planner.

It enumerates every option the sharders offer, estimates each one's memory and time per rank
from a ``Topology``, and partitions the tables so the slowest rank is as fast as the memory
limits allow. ``collective_plan`` plans on the first rank and broadcasts the result, errors
included.

Guarantees: deterministic; never exceeds a rank's usable memory; every plan passes the
sharders' plan check (the one DMP runs); when nothing fits, ``PlannerError`` says what to
relax; bad constraints, or a table no option the sharders accept is left for, raise
``ValueError`` naming the table.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.comm.collectives import collective_device
from embshard_dist.comm.timeouts import issue
from embshard_dist.planner.constraints import (
    DEFAULT_BATCH_SIZE,
    ParameterConstraints,
    check_constraints,
)
from embshard_dist.planner.cost_model import (
    DEFAULT_RESERVE_FRACTION,
    CostModel,
    load_tables,
    usable_memory,
)
from embshard_dist.planner.enumerate import default_sharders, enumerate_options
from embshard_dist.planner.estimate import PlanEstimate, estimate_tables
from embshard_dist.planner.loads import PartitionContext
from embshard_dist.planner.partition import NoFit, SearchMode, partition
from embshard_dist.planner.stats import PlannerError, format_bytes, format_stats, no_fit_error
from embshard_dist.planner.tables import (
    PlannerTable,
    TableSource,
    dense_parameter_bytes,
    find_collections,
    find_tables,
)
from embshard_dist.planner.topology import Topology, default_topology
from embshard_optim.specs import OptimizerSpec
from embshard_types.interfaces import ShardingPlanner
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

__all__ = ["EmbeddingShardingPlanner", "PlannerResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerResult:
    """A plan with its estimate and how it was found.

    Args:
        method: the search steps that produced it.
        optimal: the exact search proved it the fastest of the enumerated options.
    """

    plan: ShardingPlan
    estimate: PlanEstimate = field(hash=False)
    method: str
    optimal: bool
    tables: tuple[PlannerTable, ...]

    def stats(self) -> str:
        """The stats table (see :func:`~embshard_dist.planner.stats.format_stats`)."""
        proof = ", proven optimal" if self.optimal and "optimal" not in self.method else ""
        title = (
            f"embshard plan: estimated step {self.estimate.max_ms:.2f} ms "
            f"(slowest rank; search: {self.method}{proof})"
        )
        return format_stats(self.estimate, title=title)


def _world_size_now() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class EmbeddingShardingPlanner(ShardingPlanner):
    """Plans the sharding of every table for the fastest slowest rank that fits in memory.

    Args:
        topology: the machine (default: ``default_topology`` for ``world_size`` ranks on
            ``compute_device``).
        world_size: ranks, when no topology is given (default: the process group's size, else 1).
        constraints: per table name (or ``"path.table"``) constraints and traffic figures.
        batch_size: samples per rank per step, for tables whose constraints give none.
        optimizer: the embedding optimizer (default: the sharder's, else RowWiseAdagrad).
        reserve_fraction: share of each rank's memory kept free of tables, in ``[0, 1)``.
        search: ``"auto"``, ``"greedy"``, ``"beam"`` or ``"exact"``.

    Raises:
        ValueError: a bad batch size, reserve fraction or search mode.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        world_size: int | None = None,
        compute_device: str = "cpu",
        constraints: Mapping[str, ParameterConstraints] | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        optimizer: OptimizerSpec | None = None,
        reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
        search: SearchMode = "auto",
        pg: Any = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(reserve_fraction, int | float) or not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
        if search not in ("auto", "greedy", "beam", "exact"):
            raise ValueError(f"search must be 'auto', 'greedy', 'beam' or 'exact', got {search!r}")
        if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be an OptimizerSpec, got {optimizer!r}")
        if topology is None:
            topology = default_topology(
                world_size or _world_size_now(), compute_device=compute_device
            )
        elif world_size is not None and world_size != topology.world_size:
            raise ValueError(
                f"world_size {world_size} differs from the topology's {topology.world_size}; "
                "pass one of them (Topology.with_world makes a topology for another size)"
            )
        self.topology = topology
        self.constraints = dict(constraints or {})
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.reserve_fraction = float(reserve_fraction)
        self.search: SearchMode = search
        self._pg = pg
        self.last_result: PlannerResult | None = None

    def propose(self, tables: TableSource, sharders: Sequence[Any] | None = None) -> PlannerResult:
        """Plan ``tables`` and return the plan with its estimate (no communication).

        Args:
            tables: a model (its ``EmbeddingBagCollection`` modules) or a list of tables.
            sharders: in a model, a sharder with a ``module_type`` serves only modules of exactly
                that type; a table list is served by the first. Default: ``default_sharders()``.

        Raises:
            ValueError: bad constraints, a table with no allowed option, or
                :class:`PlannerError` when nothing fits.
        """
        planned, sharders_used = self._planned(tables, sharders)
        topo = self.topology
        dense = dense_parameter_bytes(tables) if isinstance(tables, nn.Module) else 0
        usable = usable_memory(topo.memory_per_rank, self.reserve_fraction, dense)
        if usable <= 0:
            raise PlannerError(
                f"no memory is left for tables: each rank has {format_bytes(topo.memory_per_rank)}"
                f", less a {self.reserve_fraction:.0%} reserve and "
                f"{format_bytes(4 * dense)} for the dense parameters (weights, gradients, "
                "optimizer state); use ranks with more memory or lower reserve_fraction"
            )
        model = CostModel.build(topo, self.optimizer or _sharder_optimizer(sharders_used))
        loaded = load_tables(planned, self.constraints, self.batch_size)
        options = enumerate_options(loaded, sharders_used, model)
        host_usable = (
            usable_memory(topo.host_memory_per_rank, self.reserve_fraction, 0)
            if topo.compute_device == "cuda"
            else None
        )
        ctx = PartitionContext(options, model, usable, host_usable)
        try:
            result = partition(ctx, search=self.search)
        except NoFit as e:
            raise no_fit_error(
                options,
                e.table_index,
                e.state,
                usable,
                topo.memory_per_rank,
                self.reserve_fraction,
                dense,
            ) from None
        shardings = {
            lt.table.key: placed.option.build(placed.placement, model)
            for lt, placed in zip(loaded, result.choices, strict=True)
        }
        estimate = estimate_tables(
            loaded, shardings, model, reserve_fraction=self.reserve_fraction, dense_bytes=dense
        )
        plan = _to_plan(planned, shardings)
        return PlannerResult(plan, estimate, result.method, result.optimal, tuple(planned))

    def check_options(self, tables: TableSource, sharders: Sequence[Any] | None = None) -> None:
        """Refuse, as :meth:`propose` would, a table its constraints leave no option the
        sharders accept (e.g. a pinned type its shape cannot take); nothing is placed.

        Raises:
            ValueError: bad constraints, or a table with no allowed option (named, with why).
        """
        planned, sharders_used = self._planned(tables, sharders)
        model = CostModel.build(self.topology, self.optimizer or _sharder_optimizer(sharders_used))
        enumerate_options(
            load_tables(planned, self.constraints, self.batch_size), sharders_used, model
        )

    def _planned(
        self, tables: TableSource, sharders: Sequence[Any] | None
    ) -> tuple[list[PlannerTable], list[Any]]:
        """The tables a sharder serves, with their sharders; constraints checked."""
        found = find_tables(tables)
        given = list(sharders) if sharders else default_sharders()
        per_table = self._sharders_for(tables, found, given)
        planned = [t for t, s in zip(found, per_table, strict=True) if s is not None]
        if not planned:
            raise ValueError(
                "none of the sharders given serves the model's embedding collections (their "
                "module_type differs); pass a sharder for EmbeddingBagCollection"
            )
        check_constraints(planned, self.constraints, self.topology.world_size)
        return planned, [s for s in per_table if s is not None]

    def _sharders_for(
        self, source: TableSource, tables: Sequence[PlannerTable], sharders: Sequence[Any]
    ) -> list[Any | None]:
        if not isinstance(source, nn.Module):
            return [sharders[0]] * len(tables)
        modules = find_collections(source)
        out: list[Any | None] = []
        for t in tables:
            kind = type(modules[t.path])
            out.append(
                next(
                    (s for s in sharders if getattr(s, "module_type", None) in (None, kind)),
                    None,
                )
            )
        return out

    def plan(
        self, module: nn.Module | TableSource, sharders: Sequence[Any] | None = None
    ) -> ShardingPlan:
        """Plan on this process alone (no communication; see :meth:`propose`)."""
        result = self.propose(module, sharders)
        self.last_result = result
        logger.info("%s", result.stats())
        return result.plan

    def collective_plan(
        self,
        module: nn.Module | TableSource,
        sharders: Sequence[Any] | None = None,
        pg: Any = None,
    ) -> ShardingPlan:
        """Plan on the group's first rank and broadcast the plan to every rank.

        Raises:
            ValueError: on every rank, when planning failed on the first rank (same message).
            CollectiveError: a peer died or hung during the broadcast.
            RuntimeError: no process group is initialised.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "collective_plan needs an initialised process group "
                "(torch.distributed.init_process_group); on one process use plan()"
            )
        group = pg if pg is not None else self._pg
        if dist.get_rank(group) != 0:
            return _receive_plan(group)
        try:
            plan = self.plan(module, sharders)
        except Exception as e:
            _send(1, f"{type(e).__name__}: {e}".encode(), group)
            raise
        _send(0, plan.to_json(indent=None).encode(), group)
        return plan


def _sharder_optimizer(sharders: Sequence[Any]) -> OptimizerSpec | None:
    """The optimizer a sharder was built with (``EmbeddingBagCollectionSharder.optimizer``)."""
    for s in sharders:
        spec = getattr(s, "optimizer", None)
        if isinstance(spec, OptimizerSpec):
            return spec
    return None


def _to_plan(
    tables: Sequence[PlannerTable], shardings: Mapping[str, ParameterSharding]
) -> ShardingPlan:
    modules: dict[str, dict[str, ParameterSharding]] = {}
    for t in tables:
        modules.setdefault(t.path, {})[t.name] = shardings[t.key]
    return ShardingPlan({p: EmbeddingModuleShardingPlan(m) for p, m in modules.items()})


def _broadcast(tensor: torch.Tensor, group: Any, what: str) -> None:
    issue(
        f"collective_plan.{what}",
        lambda: dist.broadcast(tensor, group=group, group_src=0, async_op=True),
        group=group,
        device=tensor.device,
    ).wait()


def _send(status: int, payload: bytes, group: Any) -> None:
    device = collective_device(group)
    header = torch.tensor([status, len(payload)], dtype=torch.int64, device=device)
    _broadcast(header, group, "header")
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        _broadcast(data, group, "payload")


def _receive_plan(group: Any) -> ShardingPlan:
    device = collective_device(group)
    header = torch.zeros(2, dtype=torch.int64, device=device)
    _broadcast(header, group, "header")
    status, length = (int(v) for v in header.tolist())
    payload = torch.empty(length, dtype=torch.uint8, device=device)
    if length:
        _broadcast(payload, group, "payload")
    text = bytes(payload.tolist()).decode()
    if status != 0:
        raise PlannerError(f"planning failed on the planning rank (rank 0 of the group): {text}")
    return ShardingPlan.from_json(text)
