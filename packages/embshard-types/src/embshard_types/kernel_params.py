"""Per-table kernel options a plan can carry: caching, key-value storage, bounds checks.

embshard's own mirrors of FBGEMM's options, so plans need no FBGEMM (the kernels package maps
them by name). Every class is frozen, hashable, validated at construction (enum values may be
strings) and round-trips exactly through ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import unique
from typing import Any, Self

from embshard_types.vocab import DataType, ParsableEnum

__all__ = [
    "BoundsCheckMode",
    "CacheAlgorithm",
    "CacheParams",
    "KeyValueParams",
    "MultiPassPrefetchConfig",
]


@unique
class CacheAlgorithm(ParsableEnum):
    """Eviction policy of a device cache of hot rows (FBGEMM's ``CacheAlgorithm``)."""

    LRU = "lru"
    LFU = "lfu"


@unique
class BoundsCheckMode(ParsableEnum):
    """What a kernel does with out-of-range ids (FBGEMM's ``BoundsCheckMode``, by name)."""

    FATAL = "fatal"
    WARNING = "warning"
    IGNORE = "ignore"
    NONE = "none"
    V2_IGNORE = "v2_ignore"
    V2_WARNING = "v2_warning"
    V2_FATAL = "v2_fatal"


def check_keys(data: Any, allowed: Iterable[str], what: str) -> None:
    """Raise unless ``data`` is a mapping whose keys are all in ``allowed`` (``what`` names it)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, got {data!r}")
    allowed = set(allowed)
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {unknown}; known: {sorted(allowed)}")


@contextmanager
def error_context(prefix: str) -> Iterator[None]:
    """Prefix the message of a ``ValueError`` / ``TypeError`` raised inside with ``prefix``."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from e
    except TypeError as e:
        raise TypeError(f"{prefix}: {e}") from e


def _optional_int(owner: object, name: str, *, minimum: int) -> None:
    value = getattr(owner, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{type(owner).__name__}.{name} must be an int >= {minimum} or None, got {value!r}"
        )


def _optional_bool(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{type(owner).__name__}.{name} must be a bool or None, got {value!r}")


def _to_plain(value: Any) -> Any:
    if isinstance(value, ParsableEnum):
        return value.value
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


def dataclass_to_dict(obj: Any) -> dict[str, Any]:
    """The non-``None`` fields of ``obj`` as JSON-ready values."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = _to_plain(value)
    return out


@dataclass(frozen=True)
class MultiPassPrefetchConfig:
    """Split a cache prefetch into several passes to bound its memory.

    Args:
        num_passes: passes to split the ids into (fewer if there are too few ids).
        min_splitable_pass_size: fewest ids a pass must have for a further split.
    """

    num_passes: int = 12
    min_splitable_pass_size: int = 6 * 1024 * 1024

    def __post_init__(self) -> None:
        _optional_int(self, "num_passes", minimum=1)
        _optional_int(self, "min_splitable_pass_size", minimum=1)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of ``to_dict``."""
        check_keys(data, (f.name for f in fields(cls)), cls.__name__)
        return cls(**data)


@dataclass(frozen=True)
class CacheParams:
    """How a table's device cache of hot rows is set up (UVM caching kernels).

    Args:
        load_factor: the fraction of the table's rows the cache holds, in ``(0, 1]``.
        reserved_memory: memory (GB) kept free of cache on the device, ``>= 0``.
        prefetch_pipeline: whether a pipeline prefetches rows into the cache ahead of lookups.
    """

    algorithm: CacheAlgorithm | None = None
    load_factor: float | None = None
    reserved_memory: float | None = None
    precision: DataType | None = None
    prefetch_pipeline: bool | None = None
    multipass_prefetch_config: MultiPassPrefetchConfig | None = None

    def __post_init__(self) -> None:
        if self.algorithm is not None:
            algorithm = CacheAlgorithm.parse(self.algorithm, what="cache algorithm")
            object.__setattr__(self, "algorithm", algorithm)
        if self.precision is not None:
            object.__setattr__(
                self, "precision", DataType.parse(self.precision, what="cache precision")
            )
        for name, low, low_ok in (("load_factor", 0.0, False), ("reserved_memory", 0.0, True)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"CacheParams.{name} must be a number or None, got {value!r}")
            value = float(value)
            too_low = value < low if low_ok else value <= low
            if not math.isfinite(value) or too_low or (name == "load_factor" and value > 1.0):
                bound = "in (0, 1]" if name == "load_factor" else ">= 0"
                raise ValueError(f"CacheParams.{name} must be {bound}, got {value!r}")
            object.__setattr__(self, name, value)
        _optional_bool(self, "prefetch_pipeline")
        mp = self.multipass_prefetch_config
        if isinstance(mp, Mapping):
            object.__setattr__(
                self, "multipass_prefetch_config", MultiPassPrefetchConfig.from_dict(mp)
            )
        elif mp is not None and not isinstance(mp, MultiPassPrefetchConfig):
            raise TypeError(
                f"CacheParams.multipass_prefetch_config must be a MultiPassPrefetchConfig, got {mp!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The non-``None`` fields as a JSON-ready dict."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of ``to_dict``."""
        check_keys(data, (f.name for f in fields(cls)), "cache params")
        return cls(**data)


_POSITIVE_KV_INTS = (
    "ssd_rocksdb_write_buffer_size",
    "ssd_rocksdb_shards",
    "stats_report_interval",
    "bulk_init_chunk_size",
    "res_store_shards",
    "ps_client_thread_num",
    "ps_max_key_per_request",
    "ps_max_local_index_length",
)
_NON_NEGATIVE_KV_INTS = ("l2_cache_size", "max_l1_cache_size", "kvzch_eviction_trigger_mode")
_KV_BOOLS = (
    "gather_ssd_cache_stats",
    "use_passed_in_path",
    "enable_async_update",
    "lazy_bulk_init_enabled",
    "enable_raw_embedding_streaming",
)


@dataclass(frozen=True)
class KeyValueParams:
    """Options of a key-value (SSD or parameter-server backed) table.

    Field names and meanings are FBGEMM's / TorchRec's.

    Args:
        ssd_storage_directory: directory of the SSD store; ``"@local_rank"`` in it is replaced
            by the local rank.
        use_passed_in_path: use ``ssd_storage_directory`` rather than the default mount path.
        l2_cache_size: L2 cache size per kernel, in GB.
        max_l1_cache_size: largest L1 cache per kernel, in MB.
        ps_hosts: parameter-server ``(host, port)`` pairs.
    """

    ssd_storage_directory: str | None = None
    ssd_rocksdb_write_buffer_size: int | None = None
    ssd_rocksdb_shards: int | None = None
    gather_ssd_cache_stats: bool | None = None
    stats_report_interval: int | None = None
    use_passed_in_path: bool = True
    l2_cache_size: int | None = None
    max_l1_cache_size: int | None = None
    enable_async_update: bool | None = None
    bulk_init_chunk_size: int | None = None
    lazy_bulk_init_enabled: bool | None = None
    enable_raw_embedding_streaming: bool | None = None
    res_store_shards: int | None = None
    kvzch_eviction_trigger_mode: int | None = None
    ps_hosts: tuple[tuple[str, int], ...] | None = None
    ps_client_thread_num: int | None = None
    ps_max_key_per_request: int | None = None
    ps_max_local_index_length: int | None = None

    def __post_init__(self) -> None:
        if self.ssd_storage_directory is not None and not isinstance(
            self.ssd_storage_directory, str
        ):
            raise ValueError(
                "KeyValueParams.ssd_storage_directory must be a str or None, "
                f"got {self.ssd_storage_directory!r}"
            )
        for name in _POSITIVE_KV_INTS:
            _optional_int(self, name, minimum=1)
        for name in _NON_NEGATIVE_KV_INTS:
            _optional_int(self, name, minimum=0)
        for name in _KV_BOOLS:
            _optional_bool(self, name)
        if self.use_passed_in_path is None:
            raise ValueError("KeyValueParams.use_passed_in_path must be a bool, got None")
        if self.ps_hosts is not None:
            object.__setattr__(self, "ps_hosts", tuple(_host(h) for h in self.ps_hosts))

    def to_dict(self) -> dict[str, Any]:
        """The non-``None`` fields as a JSON-ready dict."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of ``to_dict``."""
        check_keys(data, (f.name for f in fields(cls)), "key-value params")
        return cls(**data)


def _host(entry: Any) -> tuple[str, int]:
    try:
        host, port = entry
    except (TypeError, ValueError):
        raise ValueError(
            f"KeyValueParams.ps_hosts entry {entry!r} is not a (host, port) pair"
        ) from None
    if not isinstance(host, str) or not host:
        raise ValueError(f"KeyValueParams.ps_hosts entry {entry!r}: host must be a non-empty str")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"KeyValueParams.ps_hosts entry {entry!r}: port must be in [0, 65535]")
    return host, port
