"""How one table is sharded: type, kernel, ranks, shard specs and kernel options.

``ParameterSharding`` is frozen and hashable, converts strings, lists and dicts to its field
types and checks ranks against shards (``ValueError``); ``from_dict(to_dict())`` equals the
original. ``ShardingBucketMetadata`` says which row buckets each shard holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

from embshard_types.kernel_params import (
    BoundsCheckMode,
    CacheParams,
    KeyValueParams,
    check_keys,
    dataclass_to_dict,
    error_context,
)
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, DataType, ShardingType

if TYPE_CHECKING:
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

__all__ = ["ParameterSharding", "ShardingBucketMetadata"]


def _as_shard(item: Any, index: int) -> ShardSpec:
    if isinstance(item, ShardSpec):
        return item
    if isinstance(item, Mapping):
        return ShardSpec.from_dict(item)
    if hasattr(item, "shard_offsets") and hasattr(item, "placement"):  # torch ShardMetadata
        return ShardSpec.from_torch(item)
    raise TypeError(f"shard {index} must be a ShardSpec, got {item!r}")


@dataclass(frozen=True)
class ParameterSharding:
    """How one parameter (usually a table) is sharded.

    Args:
        ranks: the rank of each shard (``shards[i]`` lives on ``ranks[i]``); for data-parallel,
            the ranks holding a replica (or ``None``).
        shards: offsets, sizes and placement of each shard (not for data-parallel tables).
        enforce_hbm: keep the weights in device memory.
        output_dtype: dtype of the looked-up embeddings.
    """

    sharding_type: ShardingType
    compute_kernel: ComputeKernel
    ranks: tuple[int, ...] | None = None
    shards: tuple[ShardSpec, ...] | None = None
    cache_params: CacheParams | None = None
    enforce_hbm: bool | None = None
    stochastic_rounding: bool | None = None
    bounds_check_mode: BoundsCheckMode | None = None
    output_dtype: DataType | None = None
    key_value_params: KeyValueParams | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        sharding_type = ShardingType.parse(self.sharding_type, what="sharding_type")
        set_(self, "sharding_type", sharding_type)
        set_(
            self, "compute_kernel", ComputeKernel.parse(self.compute_kernel, what="compute_kernel")
        )
        if self.bounds_check_mode is not None:
            set_(self, "bounds_check_mode", BoundsCheckMode.parse(self.bounds_check_mode))
        if self.output_dtype is not None:
            set_(self, "output_dtype", DataType.parse(self.output_dtype, what="output_dtype"))
        for name in ("enforce_hbm", "stochastic_rounding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
        if isinstance(self.cache_params, Mapping):
            set_(self, "cache_params", CacheParams.from_dict(self.cache_params))
        elif self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise TypeError(f"cache_params must be CacheParams, got {self.cache_params!r}")
        if isinstance(self.key_value_params, Mapping):
            set_(self, "key_value_params", KeyValueParams.from_dict(self.key_value_params))
        elif self.key_value_params is not None and not isinstance(
            self.key_value_params, KeyValueParams
        ):
            raise TypeError(
                f"key_value_params must be KeyValueParams, got {self.key_value_params!r}"
            )

        ranks = self.ranks
        if ranks is not None:
            if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
                raise ValueError(f"ranks must be a sequence of ints, got {ranks!r}")
            ranks = tuple(ranks)
            for r in ranks:
                if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                    raise ValueError(f"ranks must be non-negative ints, got {r!r} in {ranks}")
            if not ranks:
                raise ValueError("ranks is empty; give at least one rank, or None")
            set_(self, "ranks", ranks)
        shards: Any = self.shards
        if (
            shards is not None
            and not isinstance(shards, tuple | list)
            and hasattr(shards, "shards")
        ):
            shards = shards.shards  # a torch EnumerableShardingSpec
        if shards is not None:
            if isinstance(shards, str | bytes | Mapping) or not hasattr(shards, "__iter__"):
                raise ValueError(f"shards must be a sequence of ShardSpec, got {shards!r}")
            shards = tuple(_as_shard(s, i) for i, s in enumerate(shards))
            if not shards:
                raise ValueError("shards is empty; give at least one shard, or None")
            if len({len(s.sizes) for s in shards}) != 1:
                raise ValueError(f"shards have different numbers of dimensions: {shards}")
            set_(self, "shards", shards)
        self._check_layout(sharding_type, ranks, shards)

    @staticmethod
    def _check_layout(
        sharding_type: ShardingType,
        ranks: tuple[int, ...] | None,
        shards: tuple[ShardSpec, ...] | None,
    ) -> None:
        if sharding_type is ShardingType.DATA_PARALLEL and shards is not None:
            raise ValueError(
                "a data_parallel table is replicated whole and has no shards; set shards=None"
            )
        if sharding_type is ShardingType.TABLE_WISE and ranks is not None and len(ranks) != 1:
            raise ValueError(
                f"a table_wise table lives on one rank, got ranks {list(ranks)}; use column_wise "
                "or row_wise sharding to spread it"
            )
        if ranks is None or shards is None:
            return
        if len(ranks) != len(shards):
            raise ValueError(
                f"{len(shards)} shards but {len(ranks)} ranks; give one rank per shard"
            )
        for i, (rank, shard) in enumerate(zip(ranks, shards, strict=True)):
            if shard.rank != rank:
                raise ValueError(
                    f"shard {i} is placed on rank {shard.rank} ({shard.placement!r}) but "
                    f"ranks[{i}] is {rank}"
                )

    @property
    def sharding_spec(self) -> EnumerableShardingSpec | None:
        """The shards as a torch ``EnumerableShardingSpec`` (imported lazily), or ``None``."""
        if self.shards is None:
            return None
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

        return EnumerableShardingSpec([s.to_torch() for s in self.shards])

    def all_ranks(self) -> tuple[int, ...]:
        """Every rank the sharding names, in ``ranks`` then in the shard placements."""
        out = list(self.ranks or ())
        out.extend(s.rank for s in self.shards or ())
        return tuple(out)

    def check_world(self, world_size: int, table: str | None = None) -> None:
        """Raise ``ValueError`` unless every rank is in ``[0, world_size)`` (``table`` names it)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        where = f" (table {table!r})" if table is not None else ""
        for rank in self.all_ranks():
            if rank >= world_size:
                raise ValueError(
                    f"rank {rank} is outside the world of size {world_size}{where}; "
                    f"re-plan for {world_size} ranks or run on more"
                )

    def to_dict(self) -> dict[str, Any]:
        """The non-``None`` fields as a JSON-ready dict."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], table: str | None = None) -> Self:
        """Inverse of ``to_dict``; errors are prefixed with ``table``, if given."""
        prefix = f"table {table!r}" if table is not None else "parameter sharding"
        with error_context(prefix):
            check_keys(data, (f.name for f in fields(cls)), "parameter sharding")
            for required in ("sharding_type", "compute_kernel"):
                if required not in data:
                    raise ValueError(f"parameter sharding lacks field {required!r}")
            return cls(**data)


@dataclass(frozen=True)
class ShardingBucketMetadata:
    """How a row-wise table is cut into equal buckets of rows, and which buckets each shard has.

    Args:
        bucket_offsets_per_shard: index of each shard's first bucket (running sum of the counts).
        bucket_size: rows per bucket.
    """

    num_buckets_per_shard: tuple[int, ...]
    bucket_offsets_per_shard: tuple[int, ...]
    bucket_size: int

    def __post_init__(self) -> None:
        counts = tuple(self.num_buckets_per_shard)
        offsets = tuple(self.bucket_offsets_per_shard)
        for what, values in (
            ("num_buckets_per_shard", counts),
            ("bucket_offsets_per_shard", offsets),
        ):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"{what} must be non-negative ints, got {list(values)}")
        if len(counts) != len(offsets):
            raise ValueError(
                f"{len(counts)} bucket counts but {len(offsets)} bucket offsets; give one per shard"
            )
        expected = 0
        for i, (count, offset) in enumerate(zip(counts, offsets, strict=True)):
            if offset != expected:
                raise ValueError(
                    f"shard {i} starts at bucket {offset} but the shards before it hold "
                    f"{expected} buckets"
                )
            expected += count
        b = self.bucket_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"bucket_size must be a positive int, got {b!r}")
        object.__setattr__(self, "num_buckets_per_shard", counts)
        object.__setattr__(self, "bucket_offsets_per_shard", offsets)
