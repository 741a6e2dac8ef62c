"""What the planner's costs are made of: :class:`Cost` per rank and step, the :class:`CostModel`
they are computed for, and each table with its traffic (:class:`LoadedTable`).

Guarantees: frozen values and pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from embshard_dist.planner.constraints import (
    ParameterConstraints,
    TableWorkload,
    constraints_for,
    table_workload,
)
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_optim.specs import OptimizerSpec, OptimType

__all__ = [
    "DEFAULT_PLANNER_OPTIMIZER",
    "DEFAULT_RESERVE_FRACTION",
    "ZERO",
    "Cost",
    "CostModel",
    "LoadedTable",
    "load_tables",
    "usable_memory",
]

DEFAULT_PLANNER_OPTIMIZER = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)
"""The optimizer assumed when none is given (its state is one fp32 per row)."""

DEFAULT_RESERVE_FRACTION = 0.1
"""Share of each rank's memory kept free of tables (allocator slack, activations)."""

DENSE_STATE_FACTOR = 4
"""Dense parameters cost weights + gradients + two optimizer states (Adam) on every rank."""

ID_BYTES = 8
"""Bytes sent per id."""
WEIGHT_BYTES = 4
"""Bytes sent per per-sample weight."""
STATE_BYTES = 4
"""Bytes per optimizer state element (fp32)."""


@dataclass(frozen=True)
class Cost:
    """What something costs one rank per step.

    Args:
        storage: bytes of compute-device memory (HBM on CUDA, host memory on the CPU).
        host_storage: bytes of host memory on CUDA (UVM tables); 0 on the CPU.
    """

    compute_s: float = 0.0
    comms_s: float = 0.0
    storage: int = 0
    host_storage: int = 0

    @property
    def time_s(self) -> float:
        """Compute plus comms."""
        return self.compute_s + self.comms_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.compute_s + other.compute_s,
            self.comms_s + other.comms_s,
            self.storage + other.storage,
            self.host_storage + other.host_storage,
        )


ZERO = Cost()


@dataclass(frozen=True)
class CostModel:
    """The topology and optimizer the costs are computed for.

    Args:
        fused_on_torch: the fused kernel runs embshard's plain-torch update (optimizers that
            FBGEMM cannot run on the device), costed at the ``sparse_update`` throughput.
        cache_load_factor: share of rows cached in device memory by the UVM-caching and
            key-value kernels when the table's cache params give none.
    """

    topology: Topology
    optimizer: OptimizerSpec = DEFAULT_PLANNER_OPTIMIZER
    fused_on_torch: bool = False
    cache_load_factor: float = 0.2
    rowwise_states: int = field(init=False, repr=False, compare=False)
    pointwise_states: int = field(init=False, repr=False, compare=False)

    @classmethod
    def build(cls, topology: Topology, optimizer: OptimizerSpec | None = None) -> CostModel:
        """The model for ``topology`` and ``optimizer`` (default: RowWiseAdagrad)."""
        spec = optimizer or DEFAULT_PLANNER_OPTIMIZER
        on_torch = False
        if topology.compute_device == "cpu":
            from embshard_kernels.fbgemm_mapping import fbgemm_refusal

            on_torch = fbgemm_refusal(spec, "cpu") is not None
        return cls(topology, spec, on_torch)

    def __post_init__(self) -> None:
        names = self.optimizer.state_names()
        rowwise = sum(1 for n in names if self.optimizer.state_is_rowwise(n))
        object.__setattr__(self, "rowwise_states", rowwise)
        object.__setattr__(self, "pointwise_states", len(names) - rowwise)

    def state_bytes_per_row(self, cols: int) -> int:
        """Optimizer state bytes per row of a ``cols``-wide shard."""
        return STATE_BYTES * (self.pointwise_states * cols + self.rowwise_states)

    def rowwise_state(self) -> bool:
        """Whether the optimizer keeps a per-row statistic (needs full rows under CW)."""
        return self.rowwise_states > 0


@dataclass(frozen=True)
class LoadedTable:
    """A table with its constraints and per-rank traffic."""

    table: PlannerTable
    constraints: ParameterConstraints
    workload: TableWorkload

    @property
    def output_bytes(self) -> int:
        """Bytes per element of its pooled output."""
        dtype = self.constraints.output_dtype
        return 4 if dtype is None else max(1, dtype.bits // 8)

    @property
    def id_bytes(self) -> int:
        """Bytes sent per id (the id, plus its weight when weighted)."""
        return ID_BYTES + (WEIGHT_BYTES if self.workload.weighted else 0)


def load_tables(
    tables: Sequence[PlannerTable],
    constraints: Mapping[str, ParameterConstraints] | None,
    batch_size: int,
) -> list[LoadedTable]:
    """Attach constraints and traffic to each table."""
    out = []
    for t in tables:
        c = constraints_for(t, constraints)
        out.append(LoadedTable(t, c, table_workload(t, c, batch_size)))
    return out


def usable_memory(capacity: int, reserve_fraction: float, dense_bytes: int) -> int:
    """Bytes of a rank's ``capacity`` left for tables after the reserve and the dense part."""
    return int(capacity * (1.0 - reserve_fraction)) - DENSE_STATE_FACTOR * dense_bytes
