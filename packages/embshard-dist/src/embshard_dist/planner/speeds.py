"""What one compute kernel (:class:`KernelThroughput`) and one sharding type
(:class:`ShardingOverhead`) cost, as a ``Topology`` holds them.

Guarantees: frozen and validated at construction (``ValueError`` naming the field);
``from_dict(x.to_dict()) == x``; ``from_dict`` refuses unknown fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KernelThroughput", "ShardingOverhead", "check_keys", "check_positive"]


@dataclass(frozen=True)
class KernelThroughput:
    """How fast one compute kernel moves bytes, per second.

    Args:
        fwd_bytes_per_s: forward: rows read plus pooled output written (rows in cache when
            ``miss_bytes_per_s`` is set).
        bwd_bytes_per_s: backward: twice the forward's bytes, as FBGEMM's benchmark counts it
            (including the fused update when ``update_bytes_per_s`` is unset).
        update_bytes_per_s: the fused update: per touched row, weights and gradient read and
            written plus optimizer state (``None``: counted in the backward).
        miss_bytes_per_s: the extra first read of each distinct row a step touches (``None``:
            every read costs the same).
    """

    fwd_bytes_per_s: float
    bwd_bytes_per_s: float
    update_bytes_per_s: float | None = None
    miss_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL_THROUGHPUTS:
                continue
            check_positive(f"KernelThroughput.{f.name}", value)
            object.__setattr__(self, f.name, float(value))

    def to_dict(self) -> dict[str, float]:
        """The throughputs as a JSON-ready dict (the optional ones only when set)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], what: str = "kernel") -> KernelThroughput:
        """Inverse of ``to_dict``."""
        check_keys(data, tuple(f.name for f in fields(cls)), f"topology {what}")
        try:
            return cls(
                data["fwd_bytes_per_s"],
                data["bwd_bytes_per_s"],
                data.get("update_bytes_per_s"),
                data.get("miss_bytes_per_s"),
            )
        except KeyError as e:
            raise ValueError(f"topology {what} lacks field {e.args[0]!r}") from None


_OPTIONAL_THROUGHPUTS = ("update_bytes_per_s", "miss_bytes_per_s")


@dataclass(frozen=True)
class ShardingOverhead:
    """What using one sharding type costs every rank beyond what the bytes predict (calibrated).

    Args:
        step_s: seconds per step for using the type at all.
        per_table_s: seconds per step for each table of that type.
        compute_scale: factor on the lookup, backward and update time of its shards.
    """

    step_s: float
    per_table_s: float = 0.0
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
                or (f.name == "compute_scale" and value == 0)
            ):
                raise ValueError(
                    f"ShardingOverhead.{f.name} must be a non-negative finite number "
                    f"(compute_scale positive), got {value!r}"
                )
            object.__setattr__(self, f.name, float(value))

    def to_dict(self) -> dict[str, float]:
        """The figures as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], what: str) -> ShardingOverhead:
        """Inverse of ``to_dict`` (a missing ``compute_scale`` is 1, ``per_table_s`` 0)."""
        check_keys(data, tuple(f.name for f in fields(cls)), f"topology {what}")
        if "step_s" not in data:
            raise ValueError(f"topology {what} lacks field 'step_s'")
        return cls(data["step_s"], data.get("per_table_s", 0.0), data.get("compute_scale", 1.0))


def check_positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def check_keys(data: Any, allowed: tuple[str, ...], what: str) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, got {data!r}")
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {unknown}; known: {sorted(allowed)}")
