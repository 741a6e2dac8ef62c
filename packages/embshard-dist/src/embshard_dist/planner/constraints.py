"""What a user may tell the planner about each table: allowed options, traffic, placement.

Fields follow TorchRec's ``ParameterConstraints``; embshard adds ``ranks`` (allowed placement)
and ``zipf_exponent`` (id skew). Constraints are keyed by table name or ``"module.path.table"``
(the qualified name wins).

Guarantees: constraints are frozen and validated at construction; :func:`check_constraints`
refuses keys naming no table and ranks outside the world before anything is planned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from embshard_dist.planner.tables import PlannerTable
from embshard_types.kernel_params import BoundsCheckMode, CacheParams, KeyValueParams
from embshard_types.vocab import ComputeKernel, DataType, ShardingType

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_POOLING_FACTOR",
    "ParameterConstraints",
    "TableWorkload",
    "check_constraints",
    "constraints_for",
    "table_workload",
]

DEFAULT_POOLING_FACTOR = 1.0
"""Average ids per bag assumed when a table's constraints give none (TorchRec's default)."""

DEFAULT_BATCH_SIZE = 512
"""Samples per rank per step assumed when the planner is given none (TorchRec's default)."""


def _floats(value: Any, name: str, *, minimum: float, strict: bool) -> tuple[float, ...]:
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(f"ParameterConstraints.{name} must be a list of numbers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"ParameterConstraints.{name} must hold numbers, got {v!r}")
        if v < minimum or (strict and v == minimum):
            bound = f"> {minimum}" if strict else f">= {minimum}"
            raise ValueError(f"ParameterConstraints.{name} values must be {bound}, got {v!r}")
        out.append(float(v))
    if not out:
        raise ValueError(f"ParameterConstraints.{name} is empty; give at least one value or None")
    return tuple(out)


@dataclass(frozen=True)
class ParameterConstraints:
    """The planner's constraints and traffic figures for one table.

    Args:
        sharding_types: the sharding types it may use (``None``: any the sharder offers).
        compute_kernels: the kernels it may use (``None``: any the sharder offers for
            training; the inference-only ``quant`` kernel only when listed here).
        min_partition: narrowest column block of column-wise, table-column-wise and grid
            sharding (a multiple of 4).
        pooling_factors: average ids per bag, per feature (one value: every feature).
        num_poolings: bags per sample, per feature (default 1).
        batch_sizes: samples per rank per step, per feature (default: the planner's batch).
        is_weighted: override whether the inputs carry weights.
        cache_params: device-cache options (``load_factor`` sizes the cache in device memory).
        enforce_hbm, stochastic_rounding, bounds_check_mode, output_dtype, key_value_params:
            copied into the plan.
        ranks: the only ranks its shards may go to (one rank: a forced placement).
        zipf_exponent: the ids follow a Zipf law of this exponent over the rows (``None`` or 0:
            uniform); sets how many distinct rows a step touches.
    """

    sharding_types: tuple[ShardingType, ...] | None = None
    compute_kernels: tuple[ComputeKernel, ...] | None = None
    min_partition: int | None = None
    pooling_factors: tuple[float, ...] = (DEFAULT_POOLING_FACTOR,)
    num_poolings: tuple[float, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    is_weighted: bool | None = None
    cache_params: CacheParams | None = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: BoundsCheckMode | None = None
    output_dtype: DataType | None = None
    key_value_params: KeyValueParams | None = None
    ranks: tuple[int, ...] | None = None
    zipf_exponent: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.sharding_types is not None:
            kinds = _enum_tuple(self.sharding_types, ShardingType, "sharding_types")
            set_(self, "sharding_types", kinds)
        if self.compute_kernels is not None:
            set_(
                self,
                "compute_kernels",
                _enum_tuple(self.compute_kernels, ComputeKernel, "compute_kernels"),
            )
        mp = self.min_partition
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 4 or mp % 4):
            raise ValueError(
                f"ParameterConstraints.min_partition must be a positive multiple of 4, got {mp!r}"
            )
        set_(
            self,
            "pooling_factors",
            _floats(self.pooling_factors, "pooling_factors", minimum=0.0, strict=False),
        )
        if self.num_poolings is not None:
            set_(
                self,
                "num_poolings",
                _floats(self.num_poolings, "num_poolings", minimum=0.0, strict=False),
            )
        if self.batch_sizes is not None:
            sizes = tuple(self.batch_sizes)
            if not sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes
            ):
                raise ValueError(
                    f"ParameterConstraints.batch_sizes must be positive ints, got {sizes!r}"
                )
            set_(self, "batch_sizes", sizes)
        for name in ("is_weighted", "enforce_hbm", "stochastic_rounding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(
                    f"ParameterConstraints.{name} must be a bool or None, got {value!r}"
                )
        if isinstance(self.cache_params, Mapping):
            set_(self, "cache_params", CacheParams.from_dict(self.cache_params))
        if isinstance(self.key_value_params, Mapping):
            set_(self, "key_value_params", KeyValueParams.from_dict(self.key_value_params))
        if self.bounds_check_mode is not None:
            set_(self, "bounds_check_mode", BoundsCheckMode.parse(self.bounds_check_mode))
        if self.output_dtype is not None:
            set_(self, "output_dtype", DataType.parse(self.output_dtype, what="output_dtype"))
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if not ranks or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks
            ):
                raise ValueError(
                    f"ParameterConstraints.ranks must be non-negative ints, got {self.ranks!r}"
                )
            set_(self, "ranks", tuple(sorted(set(ranks))))
        z = self.zipf_exponent
        if z is not None:
            if isinstance(z, bool) or not isinstance(z, int | float) or not 0 <= z < 100:
                raise ValueError(
                    f"ParameterConstraints.zipf_exponent must be a number in [0, 100), got {z!r}"
                )
            set_(self, "zipf_exponent", float(z))

    def sharding_kwargs(self) -> dict[str, Any]:
        """The kernel options to copy into the table's ``ParameterSharding``."""
        names = (
            "cache_params",
            "enforce_hbm",
            "stochastic_rounding",
            "bounds_check_mode",
            "output_dtype",
            "key_value_params",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the fields (for readers of spec files)."""
        return tuple(f.name for f in fields(cls))


def _enum_tuple(values: Any, enum: Any, name: str) -> tuple[Any, ...]:
    if isinstance(values, str | enum):
        values = (values,)
    out = tuple(enum.parse(v, what=f"ParameterConstraints.{name}") for v in values)
    if not out:
        raise ValueError(
            f"ParameterConstraints.{name} is empty, which allows nothing; give at least one or None"
        )
    return out


def constraints_for(
    table: PlannerTable, constraints: Mapping[str, ParameterConstraints] | None
) -> ParameterConstraints:
    """The constraints of ``table``: by qualified name, else by table name, else the defaults."""
    if constraints:
        for key in (table.key, table.name):
            if key in constraints:
                return constraints[key]
    return _DEFAULT


_DEFAULT = ParameterConstraints()


def check_constraints(
    tables: Sequence[PlannerTable],
    constraints: Mapping[str, ParameterConstraints] | None,
    world_size: int,
) -> None:
    """Refuse constraints that name no table, are of the wrong type or name ranks outside the world.

    Raises:
        ValueError, TypeError: naming the key and what to fix.
    """
    if not constraints:
        return
    known = {t.key for t in tables} | {t.name for t in tables}
    for key, c in constraints.items():
        if key not in known:
            raise ValueError(
                f"constraints name table {key!r}, which is not among the tables planned "
                f"({sorted(t.key for t in tables)}); use a table name or 'module.path.table'"
            )
        if not isinstance(c, ParameterConstraints):
            raise TypeError(
                f"constraints for table {key!r} must be ParameterConstraints, got {type(c).__name__}"
            )
        if c.ranks is not None and max(c.ranks) >= world_size:
            raise ValueError(
                f"constraints for table {key!r} allow ranks {list(c.ranks)}, but the world has "
                f"{world_size} ranks (0..{world_size - 1})"
            )
    for t in tables:
        c = constraints_for(t, constraints)
        n = len(t.features)
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = getattr(c, name)
            if values is not None and len(values) not in (1, n):
                raise ValueError(
                    f"constraints for table {t.key!r}: {name} has {len(values)} values but the "
                    f"table has {n} feature(s) {list(t.features)}; give one value or one per feature"
                )


@dataclass(frozen=True)
class TableWorkload:
    """What one rank feeds a table per step.

    Args:
        ids: ids looked up per rank per step (all features).
        bags: pooled outputs per rank per step (all features).
        outputs: output rows per rank per step (``bags`` pooled, ``ids`` sequence; default
            ``bags``).
        zipf_exponent: skew of the ids (``None``: uniform).
    """

    ids: float
    bags: float
    weighted: bool
    outputs: float | None = None
    zipf_exponent: float | None = None

    def __post_init__(self) -> None:
        if self.outputs is None:
            object.__setattr__(self, "outputs", self.bags)

    @property
    def output_rows(self) -> float:
        """``outputs`` resolved."""
        return self.bags if self.outputs is None else self.outputs


def _per_feature(values: tuple[Any, ...] | None, n: int, default: Any) -> list[Any]:
    if values is None:
        return [default] * n
    return list(values) * n if len(values) == 1 else list(values)


def table_workload(
    table: PlannerTable, constraints: ParameterConstraints, batch_size: int
) -> TableWorkload:
    """The ids and bags one rank sends ``table`` per step.

    Args:
        batch_size: samples per rank when the constraints give no batch sizes.
    """
    n = len(table.features)
    pf = _per_feature(constraints.pooling_factors, n, DEFAULT_POOLING_FACTOR)
    npool = _per_feature(constraints.num_poolings, n, 1.0)
    bs = _per_feature(constraints.batch_sizes, n, batch_size)
    bags = sum(b * p for b, p in zip(bs, npool, strict=True))
    ids = sum(b * p * f for b, p, f in zip(bs, npool, pf, strict=True))
    weighted = table.is_weighted if constraints.is_weighted is None else constraints.is_weighted
    return TableWorkload(
        ids=float(ids),
        bags=float(bags),
        weighted=weighted,
        outputs=float(ids if table.sequence else bags),
        zipf_exponent=constraints.zipf_exponent,
    )
