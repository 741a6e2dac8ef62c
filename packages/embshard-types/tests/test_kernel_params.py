"""Kernel options carried by plans: enums, cache, key-value and prefetch parameters."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from plan_strategies import cache_params, key_value_params

from embshard_types.kernel_params import (
    BoundsCheckMode,
    CacheAlgorithm,
    CacheParams,
    KeyValueParams,
    MultiPassPrefetchConfig,
)
from embshard_types.vocab import DataType


def test_enum_names_match_fbgemm() -> None:
    assert [m.name for m in CacheAlgorithm] == ["LRU", "LFU"]
    assert [m.name for m in BoundsCheckMode] == [
        "FATAL",
        "WARNING",
        "IGNORE",
        "NONE",
        "V2_IGNORE",
        "V2_WARNING",
        "V2_FATAL",
    ]
    assert BoundsCheckMode.parse("V2_WARNING") is BoundsCheckMode.V2_WARNING


@settings(max_examples=60, deadline=None)
@given(cache_params)
def test_cache_params_round_trip(cp: CacheParams) -> None:
    assert CacheParams.from_dict(cp.to_dict()) == cp
    assert hash(CacheParams.from_dict(cp.to_dict())) == hash(cp)


@settings(max_examples=60, deadline=None)
@given(key_value_params)
def test_key_value_params_round_trip(kv: KeyValueParams) -> None:
    assert KeyValueParams.from_dict(kv.to_dict()) == kv
    assert hash(KeyValueParams.from_dict(kv.to_dict())) == hash(kv)


def test_cache_params_convert_strings_and_ints() -> None:
    raw: dict[str, Any] = {
        "algorithm": "lru",
        "load_factor": 1,
        "precision": "int8",
        "multipass_prefetch_config": {"num_passes": 2},
    }
    cp = CacheParams(**raw)
    assert cp.algorithm is CacheAlgorithm.LRU
    assert cp.load_factor == 1.0 and isinstance(cp.load_factor, float)
    assert cp.precision is DataType.INT8
    assert cp.multipass_prefetch_config == MultiPassPrefetchConfig(num_passes=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"load_factor": 0.0}, ValueError, r"load_factor must be in \(0, 1\], got 0.0"),
        ({"load_factor": 1.5}, ValueError, r"load_factor must be in \(0, 1\]"),
        ({"load_factor": float("nan")}, ValueError, r"load_factor must be in \(0, 1\]"),
        ({"load_factor": "0.2"}, ValueError, "load_factor must be a number"),
        ({"reserved_memory": -1}, ValueError, "reserved_memory must be >= 0"),
        ({"reserved_memory": float("inf")}, ValueError, "reserved_memory must be >= 0"),
        ({"algorithm": "fifo"}, ValueError, "unknown CacheAlgorithm 'fifo' for cache algorithm"),
        ({"precision": "fp8"}, ValueError, "unknown DataType 'fp8' for cache precision"),
        ({"prefetch_pipeline": 1}, ValueError, "prefetch_pipeline must be a bool"),
        ({"multipass_prefetch_config": 3}, TypeError, "must be a MultiPassPrefetchConfig"),
    ],
)
def test_cache_params_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        CacheParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_passes": 0}, "num_passes must be an int >= 1"),
        ({"min_splitable_pass_size": 1.5}, "min_splitable_pass_size must be an int >= 1"),
    ],
)
def test_multipass_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiPassPrefetchConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ssd_rocksdb_shards": 0}, "ssd_rocksdb_shards must be an int >= 1"),
        ({"l2_cache_size": -1}, "l2_cache_size must be an int >= 0"),
        ({"gather_ssd_cache_stats": "yes"}, "gather_ssd_cache_stats must be a bool"),
        ({"use_passed_in_path": None}, "use_passed_in_path must be a bool"),
        ({"ssd_storage_directory": 3}, "ssd_storage_directory must be a str"),
        ({"ps_hosts": (("::1",),)}, r"entry \('::1',\) is not a \(host, port\) pair"),
        ({"ps_hosts": (("", 1),)}, "host must be a non-empty str"),
        ({"ps_hosts": (("h", 70000),)}, r"port must be in \[0, 65535\]"),
    ],
)
def test_key_value_params_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyValueParams(**kwargs)


def test_key_value_ps_hosts_become_hashable_tuples() -> None:
    kv = KeyValueParams(ps_hosts=[["::1", 2000], ["::1", 2001]])  # type: ignore[arg-type]
    assert kv.ps_hosts == (("::1", 2000), ("::1", 2001))
    assert kv.to_dict()["ps_hosts"] == [["::1", 2000], ["::1", 2001]]
    hash(kv)


def test_from_dict_rejects_unknown_fields_and_non_mappings() -> None:
    with pytest.raises(ValueError, match=r"key-value params has unknown field\(s\) \['ssd_dir'\]"):
        KeyValueParams.from_dict({"ssd_dir": "/x"})
    with pytest.raises(TypeError, match="cache params must be a mapping"):
        CacheParams.from_dict([("load_factor", 0.1)])  # type: ignore[arg-type]
