"""Module plans and sharding plans: mapping behaviour, printing, exact dict/JSON round trips,
format versions, world checks, object pools and bucket metadata."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from plan_strategies import make_sharding, sharding_plans

from embshard_types.kernel_params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    MultiPassPrefetchConfig,
)
from embshard_types.plan import (
    PLAN_FORMAT_VERSION,
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    ObjectPoolShardingPlan,
    ParameterSharding,
    ShardingBucketMetadata,
    ShardingPlan,
    validate_plan_for_world,
)
from embshard_types.vocab import ComputeKernel, DataType, ObjectPoolShardingType, ShardingType


def _full_sharding(sharding_type: ShardingType) -> ParameterSharding:
    """A sharding of the given type with every optional field set."""
    return make_sharding(
        sharding_type,
        kernel=ComputeKernel.FUSED_UVM_CACHING,
        device="cuda",
        cache_params=CacheParams(
            algorithm=CacheAlgorithm.LFU,
            load_factor=0.2,
            reserved_memory=1.5,
            precision=DataType.FP16,
            prefetch_pipeline=True,
            multipass_prefetch_config=MultiPassPrefetchConfig(num_passes=3),
        ),
        enforce_hbm=False,
        stochastic_rounding=True,
        bounds_check_mode=BoundsCheckMode.WARNING,
        output_dtype=DataType.BF16,
        key_value_params=KeyValueParams(
            ssd_storage_directory="/data@local_rank", ps_hosts=(("::1", 2000), ("::1", 2001))
        ),
    )


def _plan_of(shardings: dict[str, ParameterSharding]) -> ShardingPlan:
    return ShardingPlan(
        {
            "sparse.ebc": EmbeddingModuleShardingPlan(shardings),
            "pool": ObjectPoolShardingPlan(ObjectPoolShardingType.REPLICATED_ROW_WISE, True),
        }
    )


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding_type", list(ShardingType), ids=lambda t: t.value)
@pytest.mark.parametrize("full", [False, True], ids=["minimal", "all-fields"])
def test_round_trip_for_every_sharding_type(sharding_type: ShardingType, full: bool) -> None:
    ps = _full_sharding(sharding_type) if full else make_sharding(sharding_type)
    plan = _plan_of({"t1": ps, "t2": make_sharding(ShardingType.TABLE_WISE)})
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    assert ShardingPlan.from_json(plan.to_json()) == plan
    back = ShardingPlan.from_json(plan.to_json(indent=None))
    module = back["sparse.ebc"]
    assert isinstance(module, EmbeddingModuleShardingPlan)
    assert module["t1"].shards == ps.shards  # shard specs survive exactly
    assert list(module) == ["t1", "t2"]  # table order survives


@settings(max_examples=60, deadline=None)
@given(sharding_plans)
def test_round_trip_property(plan: ShardingPlan) -> None:
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    text = plan.to_json()
    assert ShardingPlan.from_json(text) == plan
    assert ShardingPlan.from_json(text).to_json() == text
    assert hash(ShardingPlan.from_json(text)) == hash(plan)


def test_dict_format_is_versioned_and_plain_json() -> None:
    plan = _plan_of({"t1": make_sharding(ShardingType.ROW_WISE, world_size=2)})
    data = plan.to_dict()
    assert data["version"] == PLAN_FORMAT_VERSION
    assert json.loads(json.dumps(data)) == data
    t1 = data["modules"]["sparse.ebc"]["tables"]["t1"]
    assert t1["sharding_type"] == "row_wise"
    assert t1["compute_kernel"] == "fused"
    assert t1["ranks"] == [0, 1]
    assert t1["shards"][1] == {"offsets": [50, 0], "sizes": [50, 16], "placement": "rank:1/cpu"}
    assert data["modules"]["pool"] == {
        "kind": "object_pool",
        "sharding_type": "replicated_row_wise",
        "inference": True,
    }


def test_object_pool_plan_round_trips_on_its_own() -> None:
    for st in ObjectPoolShardingType:
        for inference in (False, True):
            op = ObjectPoolShardingPlan(st, inference)
            assert ObjectPoolShardingPlan.from_dict(op.to_dict()) == op
            assert ModuleShardingPlan.parse(op.to_dict()) == op
    from_string = ObjectPoolShardingPlan("row_wise")  # type: ignore[arg-type]
    assert from_string.sharding_type is ObjectPoolShardingType.ROW_WISE


# --- reading errors -----------------------------------------------------------------------------


def test_newer_version_is_refused() -> None:
    data = _plan_of({"t1": make_sharding(ShardingType.TABLE_WISE)}).to_dict()
    data["version"] = PLAN_FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=r"version 2 is newer .* upgrade embshard-types"):
        ShardingPlan.from_dict(data)


@pytest.mark.parametrize("version", [None, 0, "1", True])
def test_missing_or_invalid_version_is_refused(version: object) -> None:
    data: dict[str, object] = {"modules": {}}
    if version is not None:
        data["version"] = version
    with pytest.raises(ValueError, match="'version'"):
        ShardingPlan.from_dict(data)


def _tables_data(table: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": 1,
        "modules": {"ebc": {"kind": "embedding", "tables": {"t1": table}}},
    }


def test_unknown_sharding_type_names_module_and_table() -> None:
    data = _tables_data({"sharding_type": "diagonal", "compute_kernel": "fused"})
    with pytest.raises(
        ValueError, match=r"module 'ebc': table 't1': unknown ShardingType 'diagonal'"
    ):
        ShardingPlan.from_dict(data)


def test_unknown_kernel_names_module_and_table() -> None:
    data = _tables_data({"sharding_type": "table_wise", "compute_kernel": "magic"})
    with pytest.raises(ValueError, match=r"table 't1': unknown ComputeKernel 'magic'"):
        ShardingPlan.from_dict(data)


def test_missing_and_unknown_fields_are_named() -> None:
    with pytest.raises(ValueError, match=r"table 't1': .*lacks field 'compute_kernel'"):
        ShardingPlan.from_dict(_tables_data({"sharding_type": "table_wise"}))
    bad = {"sharding_type": "table_wise", "compute_kernel": "fused", "rank": [0]}
    with pytest.raises(ValueError, match=r"table 't1': .*unknown field\(s\) \['rank'\]"):
        ShardingPlan.from_dict(_tables_data(bad))
    with pytest.raises(ValueError, match=r"sharding plan has unknown field\(s\) \['plan'\]"):
        ShardingPlan.from_dict({"version": 1, "plan": {}})


def test_invalid_nested_values_are_named() -> None:
    bad_shard = {
        "sharding_type": "table_wise",
        "compute_kernel": "fused",
        "ranks": [0],
        "shards": [{"offsets": [0, 0], "sizes": [4, 4], "placement": "gpu0"}],
    }
    with pytest.raises(ValueError, match=r"table 't1': shard placement 'gpu0'"):
        ShardingPlan.from_dict(_tables_data(bad_shard))
    bad_cache = {"sharding_type": "table_wise", "compute_kernel": "fused", "cache_params": {}}
    bad_cache["cache_params"] = {"load_factor": 2.0}
    with pytest.raises(
        ValueError, match=r"table 't1': CacheParams.load_factor must be in \(0, 1\]"
    ):
        ShardingPlan.from_dict(_tables_data(bad_cache))


def test_unknown_module_kind_and_bad_json() -> None:
    data = {"version": 1, "modules": {"m": {"kind": "hash_table"}}}
    with pytest.raises(ValueError, match=r"module 'm': unknown module plan kind 'hash_table'"):
        ShardingPlan.from_dict(data)
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardingPlan.from_json("{")
    with pytest.raises(TypeError, match="must be a mapping"):
        ShardingPlan.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="object pool plan lacks field 'sharding_type'"):
        ObjectPoolShardingPlan.from_dict({"kind": "object_pool"})


# --- mapping behaviour --------------------------------------------------------------------------


def test_module_plan_is_an_immutable_mapping() -> None:
    ps = make_sharding(ShardingType.TABLE_WISE)
    mp = EmbeddingModuleShardingPlan({"t1": ps})
    assert mp["t1"] is ps and len(mp) == 1 and "t1" in mp and list(mp.items()) == [("t1", ps)]
    assert mp == {"t1": ps}
    assert mp == EmbeddingModuleShardingPlan([("t1", ps)])
    assert hash(mp) == hash(EmbeddingModuleShardingPlan({"t1": ps}))
    with pytest.raises(TypeError):
        mp["t2"] = ps  # type: ignore[index]
    assert "EmbeddingModuleShardingPlan" in repr(mp)


def test_module_plan_rejects_bad_entries() -> None:
    with pytest.raises(TypeError, match="table 't1': expected a ParameterSharding"):
        EmbeddingModuleShardingPlan({"t1": {"sharding_type": "table_wise"}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="table names must be non-empty strings"):
        EmbeddingModuleShardingPlan({"": make_sharding(ShardingType.TABLE_WISE)})


def test_sharding_plan_mapping_and_get_plan_for_module() -> None:
    ps = make_sharding(ShardingType.ROW_WISE)
    plan = ShardingPlan({"ebc": {"t1": ps}})  # a plain dict becomes a module plan
    module = plan.get_plan_for_module("ebc")
    assert isinstance(module, EmbeddingModuleShardingPlan) and module["t1"] is ps
    assert plan.get_plan_for_module("missing") is None
    assert plan["ebc"] is plan.plan["ebc"] and list(plan) == ["ebc"] and len(plan) == 1
    with pytest.raises(TypeError):
        plan.plan["x"] = module  # type: ignore[index]
    assert ShardingPlan() == ShardingPlan({}) and len(ShardingPlan()) == 0
    assert "ShardingPlan" in repr(plan)


def test_sharding_plan_rejects_bad_modules() -> None:
    with pytest.raises(TypeError, match="module 'ebc': expected a ModuleShardingPlan"):
        ShardingPlan({"ebc": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="module 'ebc': table 't1'"):
        ShardingPlan({"ebc": {"t1": 3}})  # type: ignore[dict-item]


def test_equal_plans_differ_from_changed_ones() -> None:
    a = _plan_of({"t1": make_sharding(ShardingType.ROW_WISE)})
    b = _plan_of({"t1": make_sharding(ShardingType.ROW_WISE, kernel=ComputeKernel.DENSE)})
    assert a != b
    assert a == _plan_of({"t1": make_sharding(ShardingType.ROW_WISE)})


def test_module_plan_kinds_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="already registered"):

        class Again(ModuleShardingPlan, kind="embedding"):
            pass


# --- printing -----------------------------------------------------------------------------------


def test_printed_plan_is_a_readable_table() -> None:
    plan = _plan_of(
        {
            "user_table": make_sharding(ShardingType.COLUMN_WISE, world_size=2, dim=8),
            "item_table": make_sharding(ShardingType.DATA_PARALLEL, world_size=2),
        }
    )
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "module: sparse.ebc"
    assert "param" in text and "sharding type" in text and "compute kernel" in text
    assert "user_table | column_wise   | fused          | 0, 1" in text
    assert "item_table | data_parallel | fused          | 0, 1" in text
    assert "user_table | [0, 4]        | [100, 4]    | rank:1/cpu" in text
    assert "module: pool" in text and "replicated_row_wise | True" in text
    # every row of a table has the same width pattern: columns line up
    shard_rows = [line for line in lines if line.startswith("user_table | [")]
    assert len(shard_rows) == 2
    assert shard_rows[0].index("|") == shard_rows[1].index("|")


def test_printing_an_empty_module_plan() -> None:
    assert str(EmbeddingModuleShardingPlan()) == "no tables"  # no empty table


def test_a_replicated_only_plan_prints_no_empty_shard_table() -> None:
    text = str(
        EmbeddingModuleShardingPlan({"t": make_sharding(ShardingType.DATA_PARALLEL, world_size=2)})
    )
    assert "t     | data_parallel | fused          | 0, 1" in text
    assert "shard offsets" not in text
    assert text.endswith(
        "\n\nno sharded tables: every table is data-parallel (a copy on every rank)"
    )


# --- world checks -------------------------------------------------------------------------------


def test_validate_plan_for_world_names_rank_world_table_and_module() -> None:
    plan = _plan_of({"t0": make_sharding(ShardingType.ROW_WISE, world_size=2)})
    validate_plan_for_world(plan, 2)
    validate_plan_for_world(plan, 8)
    big = _plan_of({"t1": make_sharding(ShardingType.COLUMN_WISE, world_size=4)})
    with pytest.raises(
        ValueError,
        match=r"rank 2 is outside the world of size 2 \(table 't1'\) in module 'sparse.ebc'",
    ):
        validate_plan_for_world(big, 2)
    module = big["sparse.ebc"]
    assert isinstance(module, EmbeddingModuleShardingPlan)
    with pytest.raises(ValueError, match=r"rank 3 is outside the world of size 3 \(table 't1'\)"):
        module.check_world(3)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        validate_plan_for_world(plan, 0)


# --- bucket metadata ----------------------------------------------------------------------------


def test_bucket_metadata() -> None:
    md = ShardingBucketMetadata([2, 3, 0, 1], [0, 2, 5, 5], 16)
    assert md.num_buckets_per_shard == (2, 3, 0, 1)
    assert md.bucket_offsets_per_shard == (0, 2, 5, 5)
    assert hash(md) == hash(ShardingBucketMetadata((2, 3, 0, 1), (0, 2, 5, 5), 16))


@pytest.mark.parametrize(
    ("counts", "offsets", "size", "message"),
    [
        ([2, 3], [0], 4, "2 bucket counts but 1 bucket offsets"),
        ([2, 3], [0, 3], 4, "shard 1 starts at bucket 3 but the shards before it hold 2"),
        ([2, -1], [0, 2], 4, "num_buckets_per_shard must be non-negative ints"),
        ([2], [0], 0, "bucket_size must be a positive int"),
    ],
)
def test_bucket_metadata_errors(
    counts: list[int], offsets: list[int], size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingBucketMetadata(counts, offsets, size)  # type: ignore[arg-type]
