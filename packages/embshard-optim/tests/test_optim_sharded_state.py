"""State layouts computed from the weight's shard specs, without any process group."""

from __future__ import annotations

import pytest

from embshard_optim.sharded_state import (
    StateFormat,
    check_tiling,
    pointwise_state_layout,
    rowwise_state_layout,
    state_layout,
)
from embshard_types.shard_spec import ShardSpec


def _spec(rank: int, offsets: tuple[int, int], sizes: tuple[int, int]) -> ShardSpec:
    return ShardSpec.on(rank, "cpu", offsets, sizes)


def _plain(specs: tuple[ShardSpec, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    return [(s.offsets, s.sizes, s.rank) for s in specs]


def test_row_wise_table() -> None:
    weight = (_spec(0, (0, 0), (3, 4)), _spec(1, (3, 0), (5, 4)))
    specs, size = rowwise_state_layout(weight, (8, 4))
    assert size == (8,)
    assert _plain(specs) == [((0,), (3,), 0), ((3,), (5,), 1)]
    assert pointwise_state_layout(weight, (8, 4)) == (weight, (8, 4))


def test_column_wise_table_lays_column_blocks_end_to_end() -> None:
    # Given out of column order on purpose: blocks are ordered by column offset.
    weight = (_spec(1, (0, 4), (8, 2)), _spec(0, (0, 0), (8, 4)), _spec(0, (0, 6), (8, 2)))
    specs, size = rowwise_state_layout(weight, (8, 8))
    assert size == (24,)
    assert _plain(specs) == [((8,), (8,), 1), ((0,), (8,), 0), ((16,), (8,), 0)]


def test_grid_table() -> None:
    weight = tuple(
        _spec(2 * block + half, (4 * half, 3 * block), (4, 3))
        for block in range(2)
        for half in range(2)
    )
    specs, size = state_layout(weight, (8, 6), rowwise=True)
    assert size == (16,)
    assert _plain(specs) == [((0,), (4,), 0), ((4,), (4,), 1), ((8,), (4,), 2), ((12,), (4,), 3)]


def test_irregular_grid_is_refused_for_rowwise_state() -> None:
    # A shard spanning two column blocks leaves a hole in the row-wise state.
    weight = (_spec(0, (0, 0), (4, 2)), _spec(1, (0, 2), (4, 2)), _spec(0, (4, 0), (4, 4)))
    check_tiling(weight, (8, 4), "t")  # a valid weight tiling ...
    with pytest.raises(ValueError, match="table 't3' row-wise optimizer state: shards cover"):
        rowwise_state_layout(weight, (8, 4), "table 't3'")  # ... but no row-wise layout


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ((_spec(0, (0, 0), (4, 4)),), "cover 16 of the 32 elements"),
        ((_spec(0, (0, 0), (5, 4)), _spec(1, (4, 0), (4, 4))), "overlap"),
        ((_spec(0, (0, 0), (4, 4)), _spec(1, (4, 0), (5, 4))), "lies outside"),
        ((ShardSpec.on(0, "cpu", (0,), (8,)),), "has 1 dims"),
    ],
)
def test_bad_tilings_are_refused(specs: tuple[ShardSpec, ...], match: str) -> None:
    with pytest.raises(ValueError, match=f"table 'x' weight: .*{match}"):
        check_tiling(specs, (8, 4), "table 'x' weight")


def test_empty_shards_are_allowed() -> None:
    weight = (_spec(0, (0, 0), (8, 4)), _spec(1, (8, 0), (0, 4)))
    specs, size = rowwise_state_layout(weight, (8, 4))
    assert size == (8,) and _plain(specs)[1] == ((8,), (0,), 1)


def test_state_format_parse() -> None:
    assert StateFormat.parse("DTensor") is StateFormat.DTENSOR
    assert StateFormat.parse(StateFormat.TENSOR) is StateFormat.TENSOR
    with pytest.raises(ValueError, match="unknown StateFormat 'xla'"):
        StateFormat.parse("xla")
