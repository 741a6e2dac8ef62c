"""ParameterSharding: conversion of strings, validation errors, world checks, torch specs."""

from __future__ import annotations

from typing import Any

import pytest
from plan_strategies import layout, make_sharding

from embshard_types.kernel_params import BoundsCheckMode, CacheParams, KeyValueParams
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, DataType, ShardingType


def test_strings_are_converted_to_enums_and_lists_to_tuples() -> None:
    ps = ParameterSharding(
        "row_wise",  # type: ignore[arg-type]
        "FUSED",  # type: ignore[arg-type]
        ranks=[0, 1],  # type: ignore[arg-type]
        shards=[  # type: ignore[arg-type]
            {"offsets": [0, 0], "sizes": [5, 4], "placement": "rank:0/cpu"},
            ShardSpec.on(1, "cpu", (5, 0), (5, 4)),
        ],
        bounds_check_mode="fatal",  # type: ignore[arg-type]
        output_dtype="fp16",  # type: ignore[arg-type]
        cache_params={"load_factor": 0.5},  # type: ignore[arg-type]
        key_value_params={"l2_cache_size": 4},  # type: ignore[arg-type]
    )
    assert ps.sharding_type is ShardingType.ROW_WISE
    assert ps.compute_kernel is ComputeKernel.FUSED
    assert ps.ranks == (0, 1)
    assert ps.shards is not None and ps.shards[0] == ShardSpec.on(0, "cpu", (0, 0), (5, 4))
    assert ps.bounds_check_mode is BoundsCheckMode.FATAL
    assert ps.output_dtype is DataType.FP16
    assert ps.cache_params == CacheParams(load_factor=0.5)
    assert ps.key_value_params == KeyValueParams(l2_cache_size=4)


def test_frozen_and_hashable() -> None:
    ps = make_sharding(ShardingType.COLUMN_WISE)
    assert hash(ps) == hash(make_sharding(ShardingType.COLUMN_WISE))
    with pytest.raises(AttributeError):
        ps.ranks = (0,)  # type: ignore[misc]


@pytest.mark.parametrize("sharding_type", list(ShardingType), ids=lambda t: t.value)
def test_every_type_round_trips_through_its_dict(sharding_type: ShardingType) -> None:
    ps = make_sharding(sharding_type, world_size=3, rows=10, dim=7)
    assert ParameterSharding.from_dict(ps.to_dict()) == ps


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_type": "bogus"}, ValueError, "unknown ShardingType 'bogus' for sharding_type"),
        ({"compute_kernel": "gpu"}, ValueError, "unknown ComputeKernel 'gpu' for compute_kernel"),
        ({"ranks": (0, -1)}, ValueError, r"ranks must be non-negative ints, got -1"),
        ({"ranks": (0, True)}, ValueError, r"ranks must be non-negative ints, got True"),
        ({"ranks": ()}, ValueError, "ranks is empty"),
        ({"ranks": "01"}, ValueError, "ranks must be a sequence of ints"),
        ({"shards": ()}, ValueError, "shards is empty"),
        ({"shards": (3,)}, TypeError, "shard 0 must be a ShardSpec"),
        ({"enforce_hbm": "yes"}, ValueError, "enforce_hbm must be a bool"),
        ({"output_dtype": "fp64"}, ValueError, "unknown DataType 'fp64'"),
        ({"bounds_check_mode": "loud"}, ValueError, "unknown BoundsCheckMode 'loud'"),
        ({"cache_params": 0.2}, TypeError, "cache_params must be CacheParams"),
        ({"key_value_params": "ssd"}, TypeError, "key_value_params must be KeyValueParams"),
    ],
)
def test_invalid_fields(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    base: dict[str, Any] = {"sharding_type": "row_wise", "compute_kernel": "fused", "ranks": (0,)}
    with pytest.raises(error, match=message):
        ParameterSharding(**{**base, **kwargs})


def test_shards_and_ranks_must_agree() -> None:
    _, shards = layout(ShardingType.ROW_WISE, 10, 4, [0, 1])
    assert shards is not None
    with pytest.raises(ValueError, match="2 shards but 3 ranks; give one rank per shard"):
        ParameterSharding(ShardingType.ROW_WISE, ComputeKernel.FUSED, (0, 1, 2), shards)
    with pytest.raises(
        ValueError, match=r"shard 1 is placed on rank 1 \('rank:1/cpu'\) but ranks\[1\] is 3"
    ):
        ParameterSharding(ShardingType.ROW_WISE, ComputeKernel.FUSED, (0, 3), shards)
    mixed = (shards[0], ShardSpec.on(1, "cpu", (5,), (5,)))
    with pytest.raises(ValueError, match="different numbers of dimensions"):
        ParameterSharding(ShardingType.ROW_WISE, ComputeKernel.FUSED, (0, 1), mixed)


def test_layout_rules_of_table_wise_and_data_parallel() -> None:
    with pytest.raises(ValueError, match=r"table_wise table lives on one rank, got ranks \[0, 1\]"):
        ParameterSharding(ShardingType.TABLE_WISE, ComputeKernel.FUSED, (0, 1))
    shard = (ShardSpec.on(0, "cpu", (0, 0), (4, 4)),)
    with pytest.raises(ValueError, match=r"data_parallel table .* has no shards"):
        ParameterSharding(ShardingType.DATA_PARALLEL, ComputeKernel.DENSE, (0,), shard)


def test_shards_without_ranks_and_ranks_without_shards_are_allowed() -> None:
    shard = (ShardSpec.on(2, "cpu", (0, 0), (4, 4)),)
    assert (
        ParameterSharding(ShardingType.TABLE_WISE, ComputeKernel.FUSED, None, shard).ranks is None
    )
    assert ParameterSharding(ShardingType.ROW_WISE, ComputeKernel.FUSED).shards is None


def test_check_world() -> None:
    ps = make_sharding(ShardingType.ROW_WISE, world_size=4)
    ps.check_world(4)
    with pytest.raises(ValueError, match=r"^rank 3 is outside the world of size 3 \(table 't1'\)"):
        ps.check_world(3, table="t1")
    with pytest.raises(ValueError, match=r"^rank 2 is outside the world of size 2;"):
        ps.check_world(2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        ps.check_world(0)
    shard_only = ParameterSharding(
        ShardingType.TABLE_WISE, ComputeKernel.FUSED, None, (ShardSpec.on(5, "cpu", (0,), (3,)),)
    )
    assert shard_only.all_ranks() == (5,)
    with pytest.raises(ValueError, match=r"rank 5 is outside the world of size 4 \(table 'x'\)"):
        shard_only.check_world(4, table="x")


def test_from_dict_errors_name_the_table() -> None:
    with pytest.raises(ValueError, match=r"^table 'ads': unknown ShardingType 'rows'"):
        ParameterSharding.from_dict({"sharding_type": "rows", "compute_kernel": "fused"}, "ads")
    with pytest.raises(ValueError, match=r"^parameter sharding: .*lacks field 'sharding_type'"):
        ParameterSharding.from_dict({"compute_kernel": "fused"})


def test_torch_sharding_spec_conversions() -> None:
    ps = make_sharding(ShardingType.COLUMN_WISE, world_size=2, rows=6, dim=4)
    spec = ps.sharding_spec
    assert spec is not None
    assert [md.shard_offsets for md in spec.shards] == [[0, 0], [0, 2]]
    assert [str(md.placement) for md in spec.shards] == ["rank:0/cpu", "rank:1/cpu"]
    # a torch EnumerableShardingSpec, or a list of ShardMetadata, is accepted as shards
    assert ParameterSharding(ps.sharding_type, ps.compute_kernel, ps.ranks, spec) == ps  # type: ignore[arg-type]
    assert (
        ParameterSharding(ps.sharding_type, ps.compute_kernel, ps.ranks, list(spec.shards))  # type: ignore[arg-type]
        == ps
    )
    assert make_sharding(ShardingType.DATA_PARALLEL).sharding_spec is None
