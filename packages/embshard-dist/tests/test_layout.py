"""Shard layout arithmetic and id bucketization, checked against plain-Python references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_dist.strategies.bucketize import bucketize_ids, bucketize_kjt
from embshard_dist.strategies.layout import (
    column_wise_dims,
    column_wise_specs,
    grid_specs,
    row_wise_block_size,
    row_wise_boundaries,
    row_wise_sizes,
    row_wise_specs,
    shard_specs,
    table_wise_specs,
)
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ShardingType

# ---- row-wise ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "world", "expected"),
    [
        (10, 3, [4, 4, 2]),
        (12, 3, [4, 4, 4]),
        (5, 4, [2, 2, 1, 0]),
        (2, 4, [1, 1, 0, 0]),
        (1, 3, [1, 0, 0]),
        (7, 1, [7]),
    ],
)
def test_row_wise_sizes_follow_ceil_blocks(rows: int, world: int, expected: list[int]) -> None:
    assert row_wise_sizes(rows, world) == expected
    assert row_wise_block_size(rows, world) == expected[0]
    assert row_wise_boundaries(rows, world)[-1] == rows


def test_row_wise_explicit_uneven_sizes() -> None:
    assert row_wise_sizes(10, 3, sizes=[1, 6, 3]) == [1, 6, 3]
    assert row_wise_boundaries(10, 3, sizes=[0, 7, 3]) == [0, 0, 7, 10]
    with pytest.raises(ValueError, match=r"table 't'.*adding up to its 10 rows"):
        row_wise_sizes(10, 3, sizes=[1, 2, 3], table_name="t")
    with pytest.raises(ValueError, match="num_rows must be a positive int"):
        row_wise_sizes(0, 3)


def _tiles(specs: list[ShardSpec], rows: int, dim: int) -> bool:
    covered = torch.zeros(rows, dim, dtype=torch.int64)
    for s in specs:
        (r0, c0), (nr, nc) = s.offsets, s.sizes
        covered[r0 : r0 + nr, c0 : c0 + nc] += 1
    return bool((covered == 1).all())


def test_row_wise_specs_tile_the_table_and_keep_empty_shards() -> None:
    specs = row_wise_specs(2, 8, [0, 1, 2, 3], "cuda")
    assert [s.sizes for s in specs] == [(1, 8), (1, 8), (0, 8), (0, 8)]
    assert [s.offsets for s in specs] == [(0, 0), (1, 0), (2, 0), (2, 0)]
    assert [s.placement for s in specs] == [f"rank:{r}/cuda:{r}" for r in range(4)]
    assert _tiles(specs, 2, 8)
    assert _tiles(row_wise_specs(11, 4, [3, 1, 0]), 11, 4)
    with pytest.raises(ValueError, match="repeat a rank"):
        row_wise_specs(4, 4, [0, 0])


# ---- column-wise ---------------------------------------------------------------------------


def test_column_wise_dims() -> None:
    assert column_wise_dims(16, 3) == [8, 4, 4]
    assert column_wise_dims(16, world_size=8) == [4, 4, 4, 4]  # min(world, dim // 4)
    assert column_wise_dims(64, world_size=2) == [32, 32]
    assert column_wise_dims(6, world_size=4) == [6]  # a single block may have any width
    assert column_wise_dims(12, shard_dims=[4, 8]) == [4, 8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"embedding_dim": 10, "num_shards": 2}, "10 is not a multiple of 4"),
        ({"embedding_dim": 8, "num_shards": 3}, "use at most 2 shards"),
        ({"embedding_dim": 12, "shard_dims": [4, 4]}, "add up to its embedding_dim 12"),
        ({"embedding_dim": 12, "shard_dims": [6, 6]}, "multiple of 4"),
        ({"embedding_dim": 12, "num_shards": 2, "shard_dims": [4, 4, 4]}, "for 2 shards"),
    ],
)
def test_column_wise_errors_name_the_table(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=rf"table 'big'.*{message}"):
        column_wise_dims(**kwargs, table_name="big")  # type: ignore[arg-type]


def test_column_wise_and_grid_specs_tile_the_table() -> None:
    specs = column_wise_specs(5, 16, [2, 0, 2])
    assert [(s.offsets, s.sizes, s.rank) for s in specs] == [
        ((0, 0), (5, 8), 2),
        ((0, 8), (5, 4), 0),
        ((0, 12), (5, 4), 2),
    ]
    grid = grid_specs(3, 8, [[0, 1], [2, 3]])
    assert [(s.offsets, s.sizes, s.rank) for s in grid] == [
        ((0, 0), (2, 4), 0),
        ((2, 0), (1, 4), 1),
        ((0, 4), (2, 4), 2),
        ((2, 4), (1, 4), 3),
    ]
    assert _tiles(grid, 3, 8)


def test_shard_specs_dispatch() -> None:
    assert shard_specs(ShardingType.DATA_PARALLEL, 10, 4, [0, 1]) is None
    assert shard_specs("table_wise", 10, 4, [1]) == table_wise_specs(10, 4, 1)
    assert shard_specs("row_wise", 10, 4, [0, 1]) == row_wise_specs(10, 4, [0, 1])
    assert shard_specs("table_row_wise", 10, 4, [2, 3]) == row_wise_specs(10, 4, [2, 3])
    assert shard_specs("column_wise", 10, 8, [0, 1]) == column_wise_specs(10, 8, [0, 1])
    grid = shard_specs("grid_shard", 10, 8, [0, 1, 2, 3], local_world_size=2)
    assert grid == grid_specs(10, 8, [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"table 't'.*one rank"):
        shard_specs("table_wise", 10, 4, [0, 1], table_name="t")
    with pytest.raises(ValueError, match="local_world_size"):
        shard_specs("grid_shard", 10, 8, [0, 1, 2])
    with pytest.raises(ValueError, match="unknown ShardingType"):
        shard_specs("diagonal", 10, 8, [0])


# ---- bucketization -------------------------------------------------------------------------


def _reference(
    values: list[int],
    lengths: list[int],
    bounds: list[list[int]],
    strides: list[int],
    weights: list[float] | None,
) -> tuple[list[int], list[int], list[float] | None, list[int]]:
    """Plain-Python bucketization: bags in (bucket, feature, sample) order, ids local."""
    num_buckets = len(bounds[0]) - 1 if bounds else 1
    bags = []
    pos = seg = 0
    for f, stride in enumerate(strides):
        for _ in range(stride):
            n = lengths[seg]
            bags.append((f, list(range(pos, pos + n))))
            pos += n
            seg += 1
    out_lengths: list[int] = []
    out_values: list[int] = []
    out_weights: list[float] = []
    new_position = [0] * len(values)
    for r in range(num_buckets):
        for f, idx in bags:
            lo, hi = bounds[f][r], bounds[f][r + 1]
            mine = [i for i in idx if lo <= values[i] < hi]
            out_lengths.append(len(mine))
            for i in mine:
                new_position[i] = len(out_values)
                out_values.append(values[i] - lo)
                if weights is not None:
                    out_weights.append(weights[i])
    return out_lengths, out_values, out_weights if weights is not None else None, new_position


@st.composite
def _sparse_batches(draw: st.DrawFn) -> tuple:
    world = draw(st.integers(1, 4))
    num_features = draw(st.integers(0, 3))
    rows = [draw(st.integers(1, 9)) for _ in range(num_features)]  # often fewer than ranks
    bounds = []
    for n in rows:
        if draw(st.booleans()):
            bounds.append(row_wise_boundaries(n, world))
        else:  # explicit uneven sizes
            cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
            bounds.append([0, *cuts, n])
    same_batch = draw(st.booleans())
    batch = draw(st.integers(0, 4))  # empty batches included
    strides = [batch if same_batch else draw(st.integers(0, 4)) for _ in range(num_features)]
    lengths = [draw(st.integers(0, 4)) for _ in range(sum(strides))]  # empty bags included
    values: list[int] = []
    seg = 0
    for f, stride in enumerate(strides):
        for _ in range(stride):
            values += draw(
                st.lists(st.integers(0, rows[f] - 1), min_size=lengths[seg], max_size=lengths[seg])
            )
            seg += 1
    weighted = draw(st.booleans())
    weights = [float(i) + 0.5 for i in range(len(values))] if weighted else None
    return values, lengths, bounds, strides, weights


@settings(max_examples=100, deadline=None)
@given(_sparse_batches())
def test_bucketize_ids_matches_reference(batch: tuple) -> None:
    values, lengths, bounds, strides, weights = batch
    out = bucketize_ids(
        torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int32),
        bounds,
        strides,
        weights=None if weights is None else torch.tensor(weights),
    )
    ref_lengths, ref_values, ref_weights, ref_position = _reference(
        values, lengths, bounds, strides, weights
    )
    assert out.lengths.dtype == torch.int32
    assert out.lengths.tolist() == ref_lengths
    assert out.values.tolist() == ref_values
    assert out.unbucketize_permute.tolist() == ref_position
    if weights is None:
        assert out.weights is None
    else:
        assert out.weights is not None and out.weights.tolist() == ref_weights
    # unbucketize_permute brings per-id results back to the original order
    global_ids = out.values.clone()
    num_buckets = len(bounds[0]) - 1 if bounds else 1
    seg_bucket = torch.arange(num_buckets).repeat_interleave(sum(strides))
    seg_feature = (
        torch.arange(len(strides))
        .repeat_interleave(torch.tensor(strides, dtype=torch.int64))
        .repeat(num_buckets)
    )
    per_value = torch.repeat_interleave(torch.arange(len(ref_lengths)), out.lengths.long())
    offsets = torch.tensor(bounds, dtype=torch.int64).reshape(len(strides), -1) if bounds else None
    if offsets is not None and per_value.numel():
        global_ids += offsets[seg_feature[per_value], seg_bucket[per_value]]
    assert global_ids[out.unbucketize_permute].tolist() == values


def test_bucketize_rejects_out_of_range_ids_naming_the_feature() -> None:
    with pytest.raises(ValueError, match=r"feature 'b', sample 1: id 5 is outside .*\[0, 5\)"):
        bucketize_ids(
            torch.tensor([0, 1, 5]),
            torch.tensor([1, 1, 0, 1]),
            [[0, 2, 4], [0, 3, 5]],
            [2, 2],
            feature_names=["a", "b"],
        )
    with pytest.raises(ValueError, match="lengths add up to 3 but there are 2 ids"):
        bucketize_ids(torch.tensor([0, 1]), torch.tensor([1, 2]), [[0, 1, 2]], [2])
    with pytest.raises(ValueError, match="different numbers of buckets"):
        bucketize_ids(torch.tensor([0]), torch.tensor([1, 0]), [[0, 2], [0, 1, 2]], [1, 1])


def test_bucketize_kjt_repeats_keys_per_bucket() -> None:
    kjt = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([3, 0, 1, 2, 4]),
        lengths=torch.tensor([2, 1, 2, 0]),
        weights=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
    )
    out, permute = bucketize_kjt(kjt, [row_wise_boundaries(4, 2), row_wise_boundaries(5, 2)])
    assert out.keys() == ["f", "g", "f", "g"]
    assert out.stride() == 2
    # bucket 0: f rows [0, 2), g rows [0, 3); bucket 1: f rows [2, 4), g rows [3, 5)
    assert out.lengths().tolist() == [1, 1, 1, 0, 1, 0, 1, 0]
    assert out.values().tolist() == [0, 1, 2, 1, 1]
    assert out.weights().tolist() == [2.0, 3.0, 4.0, 1.0, 5.0]
    assert permute.tolist() == [3, 0, 1, 2, 4]


def test_bucketize_kjt_with_variable_stride_per_key() -> None:
    kjt = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([0, 5, 1]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    out, _ = bucketize_kjt(kjt, [row_wise_boundaries(2, 2), row_wise_boundaries(6, 2)])
    assert out.stride_per_key() == [1, 2, 1, 2]
    assert out.lengths().tolist() == [1, 0, 1, 0, 1, 0]
    assert out.values().tolist() == [0, 1, 2]
