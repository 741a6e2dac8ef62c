"""What a user may ask of the default planner: a sharding type per table, one for all, or "auto".

Guarantees: type names, short names (``tw``, ``rw``...) and ``"auto"`` parse
case-insensitively; a bad name or malformed request raises ``ValueError`` listing what is
accepted. Table names are checked by the planner, not here.
"""

from __future__ import annotations

from collections.abc import Mapping

from embshard_types.vocab import ShardingType

__all__ = [
    "AUTO",
    "ShardingRequest",
    "normalise_request",
    "parse_sharding_request",
    "parse_sharding_type",
]

AUTO = "auto"
"""Request that lets the planner choose a table's sharding type (see the module docstring)."""

ShardingRequest = ShardingType | str | Mapping[str, ShardingType | str]
"""One type (or ``"auto"``) for every table, or a type (or ``"auto"``) per table name."""


def parse_sharding_request(text: str) -> str | dict[str, str]:
    """Read a command-line sharding request.

    Args:
        text: ``"row_wise"`` (one type for all tables), ``"auto"``, or
            ``"t0=row_wise,t1=table_wise"`` (per table; ``auto`` allowed as a value).

    Returns:
        The single type's name, or table name -> type name.

    Raises:
        ValueError: an empty entry, a missing ``=`` in a per-table list, or a table named twice.
    """
    text = text.strip()
    if not text:
        raise ValueError("empty sharding request; give a type, 'auto', or 't0=row_wise,...'")
    if "=" not in text and "," not in text:
        return text
    out: dict[str, str] = {}
    for entry in text.split(","):
        table, sep, kind = (part.strip() for part in entry.partition("="))
        if not sep or not table or not kind:
            raise ValueError(
                f"sharding entry {entry.strip()!r} is not of the form TABLE=TYPE "
                "(e.g. 't0=row_wise,t1=table_wise')"
            )
        if table in out:
            raise ValueError(f"sharding request names table {table!r} twice")
        out[table] = kind
    return out


_SHORT_NAMES = {
    "dp": ShardingType.DATA_PARALLEL,
    "tw": ShardingType.TABLE_WISE,
    "rw": ShardingType.ROW_WISE,
    "cw": ShardingType.COLUMN_WISE,
    "twrw": ShardingType.TABLE_ROW_WISE,
    "twcw": ShardingType.TABLE_COLUMN_WISE,
    "grid": ShardingType.GRID_SHARD,
}


def parse_sharding_type(value: ShardingType | str, what: str = "") -> ShardingType | str:
    """A sharding type, or :data:`AUTO`, from its name or short name (``tw``, ``rw``...).

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key == AUTO:
            return AUTO
        if key in _SHORT_NAMES:
            return _SHORT_NAMES[key]
        value = key
    return ShardingType.parse(value, what=what)


def normalise_request(
    sharding: ShardingRequest | None,
) -> tuple[ShardingType | str, dict[str, ShardingType | str]]:
    """The default type (table-wise unless one type is asked for all) and the per-table types.

    Raises:
        ValueError, TypeError: a bad type name or a request of the wrong shape.
    """
    if sharding is None:
        return ShardingType.TABLE_WISE, {}
    if isinstance(sharding, ShardingType | str):
        return parse_sharding_type(sharding, "the sharding request"), {}
    if not isinstance(sharding, Mapping):
        raise TypeError(
            f"sharding must be a type name, 'auto' or a mapping of table name to type, got "
            f"{sharding!r}"
        )
    per_table = {}
    for table, kind in sharding.items():
        if not isinstance(table, str) or not table:
            raise ValueError(f"sharding request keys must be table names, got {table!r}")
        per_table[table] = parse_sharding_type(kind, f"table {table!r}")
    return ShardingType.TABLE_WISE, per_table
