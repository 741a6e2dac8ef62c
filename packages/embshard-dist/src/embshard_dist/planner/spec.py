"""Table spec files for ``embshard plan``: tables, their traffic and constraints, in JSON or YAML.

A spec gives ``module``, ``batch_size``, ``optimizer`` and ``tables``: each with ``name``,
``rows``, ``dim``, optional ``pooling_factor``, ``features``, ``data_type``, ``pooling``,
``weighted``, ``module`` and any ``ParameterConstraints`` field.

Guarantees: unknown keys and bad values raise ``ValueError`` naming the file, table and key
(a string where a list is expected is refused, never split into letters); a YAML file without
PyYAML raises ``ValueError`` saying to install it or use JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embshard_dist.planner.constraints import DEFAULT_BATCH_SIZE, ParameterConstraints
from embshard_dist.planner.tables import PlannerTable, qualified_name
from embshard_optim.specs import OptimizerSpec

__all__ = ["TableSpec", "load_table_spec", "parse_table_spec"]

_TOP_KEYS = ("module", "batch_size", "optimizer", "tables")
_TABLE_KEYS = ("name", "rows", "dim", "features", "data_type", "pooling", "weighted", "module")
_PF_KEYS = ("pooling_factor", "pooling_factors")

_LISTS: dict[str, tuple[str, tuple[type, ...]]] = {
    "features": ("feature names", (str,)),
    "sharding_types": ("sharding type names", (str,)),
    "compute_kernels": ("compute kernel names", (str,)),
    "pooling_factors": ("numbers", (int, float)),
    "num_poolings": ("numbers", (int, float)),
    "batch_sizes": ("integers", (int,)),
    "ranks": ("integers", (int,)),
}
"""Fields that take a list, with what its items are."""

_SCALARS: dict[str, tuple[str, tuple[type, ...]]] = {
    "name": ("a string", (str,)),
    "module": ("a module path string", (str,)),
    "data_type": ("a data type name", (str,)),
    "pooling": ("a pooling name", (str,)),
    "bounds_check_mode": ("a bounds check mode name", (str,)),
    "output_dtype": ("a data type name", (str,)),
    "rows": ("an integer", (int,)),
    "dim": ("an integer", (int,)),
    "min_partition": ("an integer", (int,)),
    "pooling_factor": ("a number", (int, float)),
    "zipf_exponent": ("a number", (int, float)),
    "weighted": ("true or false", (bool,)),
    "is_weighted": ("true or false", (bool,)),
    "enforce_hbm": ("true or false", (bool,)),
    "stochastic_rounding": ("true or false", (bool,)),
    "cache_params": ("a mapping", (Mapping,)),
    "key_value_params": ("a mapping", (Mapping,)),
}
"""Fields that take one value, with its kind."""


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def _check_fields(where: str, entry: Mapping[str, Any]) -> None:
    """Refuse a value of the wrong kind, naming the table and the field."""
    for key, value in entry.items():
        if value is None:
            continue
        if key in _LISTS:
            what, kinds = _LISTS[key]
            if isinstance(value, str):
                raise ValueError(
                    f"{where}: field {key!r} must be a list of {what}, got the string "
                    f"{value!r}; write [{value!r}]"
                )
            if not isinstance(value, list | tuple):
                raise ValueError(f"{where}: field {key!r} must be a list of {what}, got {value!r}")
            bad = [v for v in value if not _is(v, kinds)]
            if bad:
                raise ValueError(
                    f"{where}: field {key!r} must be a list of {what}, but it holds {bad[0]!r}"
                )
        elif key in _SCALARS:
            what, kinds = _SCALARS[key]
            if not _is(value, kinds):
                raise ValueError(f"{where}: field {key!r} must be {what}, got {value!r}")


@dataclass(frozen=True)
class TableSpec:
    """The contents of a table spec file (``constraints`` per qualified table name)."""

    tables: tuple[PlannerTable, ...]
    constraints: Mapping[str, ParameterConstraints]
    batch_size: int
    optimizer: OptimizerSpec


def _read(path: Path) -> Any:
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise ValueError(
                f"table spec {str(path)!r} is YAML but PyYAML is not installed; install it "
                "(pip install pyyaml) or write the spec as JSON"
            ) from None
        return yaml.safe_load(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"table spec {str(path)!r} is not valid JSON: {e}") from e


def load_table_spec(path: str | os.PathLike[str]) -> TableSpec:
    """Read a table spec file (``.json``, or ``.yaml`` / ``.yml`` with PyYAML).

    Raises:
        ValueError: the file is unreadable or invalid (the message names the file and key).
    """
    p = Path(path)
    try:
        return parse_table_spec(_read(p))
    except (ValueError, TypeError) as e:
        if str(e).startswith("table spec"):
            raise
        raise ValueError(f"table spec {str(p)!r}: {e}") from e


def parse_table_spec(data: Any) -> TableSpec:
    """Build a :class:`TableSpec` from the decoded file.

    Raises:
        ValueError, TypeError: a bad key or value, naming the table.
    """
    if not isinstance(data, Mapping):
        raise ValueError(
            f"the spec must be a mapping with a 'tables' list, got {type(data).__name__}"
        )
    unknown = sorted(str(k) for k in data if k not in _TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}; known: {list(_TOP_KEYS)}")
    entries = data.get("tables")
    if not isinstance(entries, list) or not entries:
        raise ValueError("'tables' must be a non-empty list of tables")
    module = data.get("module", "")
    if not isinstance(module, str):
        raise ValueError(f"'module' must be a module path string, got {module!r}")
    batch = data.get("batch_size", DEFAULT_BATCH_SIZE)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"'batch_size' must be a positive int, got {batch!r}")
    optimizer_name = data.get("optimizer", "rowwise_adagrad")
    if not isinstance(optimizer_name, str):
        raise ValueError(
            f"'optimizer' must be an optimizer name such as 'rowwise_adagrad', got {optimizer_name!r}"
        )
    optimizer = OptimizerSpec.from_name(optimizer_name)
    tables: list[PlannerTable] = []
    constraints: dict[str, ParameterConstraints] = {}
    for i, entry in enumerate(entries):
        table, c = _parse_table(entry, i, module)
        tables.append(table)
        if c is not None:
            constraints[table.key] = c
    return TableSpec(tuple(tables), constraints, batch, optimizer)


def _parse_table(
    entry: Any, index: int, module: str
) -> tuple[PlannerTable, ParameterConstraints | None]:
    if not isinstance(entry, Mapping):
        raise ValueError(f"table {index} must be a mapping, got {entry!r}")
    name = entry.get("name")
    where = f"table {name!r}" if isinstance(name, str) else f"table {index}"
    allowed = (*_TABLE_KEYS, *_PF_KEYS, *ParameterConstraints.field_names())
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(set(allowed))}")
    for required in ("name", "rows", "dim"):
        if required not in entry:
            raise ValueError(f"{where}: missing key {required!r}")
    _check_fields(where, entry)
    path = entry.get("module", module)
    try:
        table = PlannerTable(
            name=entry["name"],
            rows=entry["rows"],
            dim=entry["dim"],
            path=path,
            features=tuple(entry.get("features", ())),
            data_type=entry.get("data_type", "fp32"),
            pooling=entry.get("pooling", "sum"),
            is_weighted=entry.get("weighted", False),
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from e
    kwargs = {k: v for k, v in entry.items() if k in ParameterConstraints.field_names()}
    if "pooling_factor" in entry and "pooling_factors" in entry:
        raise ValueError(f"{where}: give pooling_factor or pooling_factors, not both")
    if "pooling_factor" in entry:
        kwargs["pooling_factors"] = [entry["pooling_factor"]]
    for key in (
        "sharding_types",
        "compute_kernels",
        "pooling_factors",
        "num_poolings",
        "batch_sizes",
        "ranks",
    ):
        if key in kwargs and isinstance(kwargs[key], list):
            kwargs[key] = tuple(kwargs[key])
    if not kwargs:
        return table, None
    try:
        return table, ParameterConstraints(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"table {qualified_name(path, table.name)!r}: {e}") from e
