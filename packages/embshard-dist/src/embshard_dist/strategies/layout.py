"""Shard layouts as pure arithmetic: which rows and columns of a table each shard holds.

Row blocks are ``ceil(rows / n)`` (trailing ones short or empty), column blocks multiples of 4
as even as possible, as in TorchRec. Specs tile the table exactly in rank order; bad input
raises ``ValueError`` naming the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ShardingType

MIN_COLUMN_BLOCK = 4
"""Column blocks are multiples of this width (FBGEMM's alignment of embedding dims)."""


def _where(table_name: str | None) -> str:
    return f"table {table_name!r}" if table_name else "table"


def _positive(value: int, what: str, table_name: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{_where(table_name)}: {what} must be a positive int, got {value!r}")
    return value


def row_wise_block_size(num_rows: int, num_shards: int) -> int:
    """Rows per row-wise block: ``ceil(num_rows / num_shards)``."""
    _positive(num_rows, "num_rows", None)
    _positive(num_shards, "num_shards", None)
    return -(-num_rows // num_shards)


def row_wise_sizes(
    num_rows: int,
    num_shards: int,
    *,
    sizes: Sequence[int] | None = None,
    table_name: str | None = None,
) -> list[int]:
    """Rows held by each row-wise shard (``sizes``, if given, checked to add up).

    Raises:
        ValueError: a count is not positive, or ``sizes`` does not fit.
    """
    _positive(num_rows, "num_rows", table_name)
    _positive(num_shards, "the number of row-wise shards", table_name)
    if sizes is not None:
        given = [int(s) for s in sizes]
        if len(given) != num_shards or any(s < 0 for s in given) or sum(given) != num_rows:
            raise ValueError(
                f"{_where(table_name)}: row-wise sizes {given} must give {num_shards} "
                f"non-negative row counts adding up to its {num_rows} rows"
            )
        return given
    block = row_wise_block_size(num_rows, num_shards)
    return [max(0, min(block, num_rows - r * block)) for r in range(num_shards)]


def boundaries(sizes: Sequence[int]) -> list[int]:
    """Running sum of block sizes: ``[0, s0, s0 + s1, ...]``."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


def row_wise_boundaries(
    num_rows: int, num_shards: int, *, sizes: Sequence[int] | None = None
) -> list[int]:
    """First row of each row-wise shard, plus ``num_rows`` (see ``row_wise_sizes``)."""
    return boundaries(row_wise_sizes(num_rows, num_shards, sizes=sizes))


def column_wise_dims(
    embedding_dim: int,
    num_shards: int | None = None,
    *,
    world_size: int | None = None,
    shard_dims: Sequence[int] | None = None,
    table_name: str | None = None,
) -> list[int]:
    """Widths of the column-wise shards of a table.

    Args:
        num_shards: default ``min(world_size, embedding_dim // 4)``, at least 1.
        shard_dims: explicit widths, multiples of 4 unless there is one.

    Raises:
        ValueError: the widths do not fit the dimension or are not multiples of 4.
    """
    where = _where(table_name)
    _positive(embedding_dim, "embedding_dim", table_name)
    if shard_dims is not None:
        dims = [int(d) for d in shard_dims]
        if sum(dims) != embedding_dim or any(d <= 0 for d in dims):
            raise ValueError(
                f"{where}: column-wise shard widths {dims} must be positive and add up to "
                f"its embedding_dim {embedding_dim}"
            )
        if len(dims) > 1 and any(d % MIN_COLUMN_BLOCK for d in dims):
            raise ValueError(
                f"{where}: column-wise shard widths {dims} must each be a multiple of "
                f"{MIN_COLUMN_BLOCK} when the dimension is cut; pick widths that are, or pass "
                "only num_shards for an even cut"
            )
        if num_shards is not None and num_shards != len(dims):
            raise ValueError(
                f"{where}: {len(dims)} column-wise shard widths {dims} given for "
                f"{num_shards} shards"
            )
        return dims
    if num_shards is None:
        if world_size is None:
            raise ValueError(f"{where}: give num_shards, world_size or shard_dims")
        _positive(world_size, "world_size", table_name)
        num_shards = max(1, min(world_size, embedding_dim // MIN_COLUMN_BLOCK))
    _positive(num_shards, "the number of column-wise shards", table_name)
    if num_shards == 1:
        return [embedding_dim]
    return _even_dims(embedding_dim, num_shards, table_name)


def _even_dims(embedding_dim: int, num_shards: int, table_name: str | None) -> list[int]:
    where = _where(table_name)
    if embedding_dim % MIN_COLUMN_BLOCK:
        raise ValueError(
            f"{where}: embedding_dim {embedding_dim} is not a multiple of {MIN_COLUMN_BLOCK}, "
            "so it cannot be cut into column-wise shards; use one shard (table-wise) or a "
            f"dimension that is a multiple of {MIN_COLUMN_BLOCK}"
        )
    units = embedding_dim // MIN_COLUMN_BLOCK
    if num_shards > units:
        raise ValueError(
            f"{where}: embedding_dim {embedding_dim} cannot be cut into {num_shards} column-wise "
            f"shards of at least {MIN_COLUMN_BLOCK} columns; use at most {units} shards"
        )
    base, extra = divmod(units, num_shards)
    return [(base + (i < extra)) * MIN_COLUMN_BLOCK for i in range(num_shards)]


def table_wise_specs(
    num_rows: int, embedding_dim: int, rank: int, device: str = "cpu"
) -> list[ShardSpec]:
    """The single shard of a table placed whole on ``rank``."""
    return [ShardSpec.on(rank, device, (0, 0), (num_rows, embedding_dim))]


def row_wise_specs(
    num_rows: int,
    embedding_dim: int,
    ranks: Sequence[int],
    device: str = "cpu",
    *,
    sizes: Sequence[int] | None = None,
    table_name: str | None = None,
) -> list[ShardSpec]:
    """Row-wise shards, one per rank of ``ranks`` in order (empty ones included)."""
    _check_ranks(ranks, table_name)
    rows = row_wise_sizes(num_rows, len(ranks), sizes=sizes, table_name=table_name)
    starts = boundaries(rows)
    return [
        ShardSpec.on(rank, device, (start, 0), (n, embedding_dim))
        for rank, start, n in zip(ranks, starts, rows, strict=False)
    ]


def column_wise_specs(
    num_rows: int,
    embedding_dim: int,
    ranks: Sequence[int],
    device: str = "cpu",
    *,
    shard_dims: Sequence[int] | None = None,
    table_name: str | None = None,
) -> list[ShardSpec]:
    """Column-wise shards, one per entry of ``ranks`` (a rank may hold several blocks)."""
    _check_ranks(ranks, table_name, distinct=False)
    dims = column_wise_dims(embedding_dim, len(ranks), shard_dims=shard_dims, table_name=table_name)
    starts = boundaries(dims)
    return [
        ShardSpec.on(rank, device, (0, start), (num_rows, width))
        for rank, start, width in zip(ranks, starts, dims, strict=False)
    ]


def grid_specs(
    num_rows: int,
    embedding_dim: int,
    column_block_ranks: Sequence[Sequence[int]],
    device: str = "cpu",
    *,
    shard_dims: Sequence[int] | None = None,
    table_name: str | None = None,
) -> list[ShardSpec]:
    """Grid shards: column blocks, each cut row-wise over its own ranks (one node's)."""
    if not column_block_ranks:
        raise ValueError(f"{_where(table_name)}: grid sharding needs at least one column block")
    dims = column_wise_dims(
        embedding_dim, len(column_block_ranks), shard_dims=shard_dims, table_name=table_name
    )
    specs: list[ShardSpec] = []
    for col, width, ranks in zip(boundaries(dims), dims, column_block_ranks, strict=False):
        for spec in row_wise_specs(num_rows, width, ranks, device, table_name=table_name):
            specs.append(ShardSpec((spec.offsets[0], col), spec.sizes, spec.placement))
    return specs


def shard_specs(
    sharding_type: ShardingType | str,
    num_rows: int,
    embedding_dim: int,
    ranks: Sequence[int],
    device: str = "cpu",
    *,
    local_world_size: int | None = None,
    table_name: str | None = None,
) -> list[ShardSpec] | None:
    """The shard specs of a table for one sharding type (``None`` for data-parallel).

    Args:
        ranks: the ranks holding shards, in block order; for grid, node by node
            (``local_world_size`` per column block).

    Raises:
        ValueError: the ranks do not fit the sharding type, or the table cannot be cut so.
    """
    kind = ShardingType.parse(sharding_type, what=_where(table_name))
    if kind is ShardingType.DATA_PARALLEL:
        return None
    if kind is ShardingType.TABLE_WISE:
        if len(ranks) != 1:
            raise ValueError(
                f"{_where(table_name)}: table-wise sharding places the table on one rank, "
                f"got ranks {list(ranks)}"
            )
        return table_wise_specs(num_rows, embedding_dim, ranks[0], device)
    if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        return row_wise_specs(num_rows, embedding_dim, ranks, device, table_name=table_name)
    if kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        return column_wise_specs(num_rows, embedding_dim, ranks, device, table_name=table_name)
    # GRID_SHARD
    if local_world_size is None or local_world_size <= 0 or len(ranks) % local_world_size:
        raise ValueError(
            f"{_where(table_name)}: grid sharding needs local_world_size (ranks per node) "
            f"dividing the number of ranks {len(ranks)}, got {local_world_size!r}"
        )
    blocks = [list(ranks[i : i + local_world_size]) for i in range(0, len(ranks), local_world_size)]
    return grid_specs(num_rows, embedding_dim, blocks, device, table_name=table_name)


def _check_ranks(ranks: Sequence[int], table_name: str | None, *, distinct: bool = True) -> None:
    where = _where(table_name)
    if not ranks:
        raise ValueError(f"{where}: no ranks given to place its shards on")
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise ValueError(f"{where}: ranks must be non-negative ints, got {list(ranks)}")
    if distinct and len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: row-wise ranks {list(ranks)} repeat a rank")
