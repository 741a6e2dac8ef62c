"""Table configurations: what a user declares about each embedding table.

The fields, their order and defaults are TorchRec's (``torchrec.modules.embedding_configs``), so
``EmbeddingBagConfig(num_embeddings=..., embedding_dim=..., name=..., feature_names=[...])``
ports unchanged. Configs are frozen and hashable and validated at construction (``ValueError``
naming the table and field); enum fields accept their strings. TorchRec fields embshard has no
use for (pruning, virtual tables) are accepted at their defaults and refused otherwise, never
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from embshard_types.vocab import DataType, PoolingType

InitFn = Callable[[Tensor], Tensor | None]
"""Fills a table's weight in place (or returns the values), like ``torch.nn.init.uniform_``."""

# TorchRec fields embshard accepts only at their default: field -> (default, why, what to do).
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "num_embeddings_post_pruning": (
        None,
        "embshard does not prune tables for inference; drop the field and size the table "
        "with num_embeddings",
    ),
    "input_dim": (None, "embshard tables take no separate input dimension; drop the field"),
    "total_num_buckets": (
        None,
        "embshard has no bucketised (virtual) tables; drop the field",
    ),
    "use_virtual_table": (
        False,
        "embshard has no virtual tables; for tables larger than memory use the key_value "
        "compute kernel (CUDA) or fused_uvm_caching",
    ),
    "virtual_table_eviction_policy": (
        None,
        "embshard has no virtual tables, so there is nothing to evict; drop the field",
    ),
    "enable_embedding_update": (
        False,
        "embshard has no embedding-update tables; drop the field",
    ),
    "stash_weights": (False, "embshard does not stash weights; drop the field"),
}


@dataclass(frozen=True)
class BaseEmbeddingConfig:
    """Fields shared by pooled and sequence tables (TorchRec's ``BaseEmbeddingConfig``).

    Args:
        num_embeddings, embedding_dim: rows and columns of the table.
        name: the table's name (required, unlike TorchRec's default ``""``).
        feature_names: the input features that read this table (default: the table's name).
        weight_init_min, weight_init_max: uniform initialisation bounds; ``None`` (the default)
            means ``-sqrt(1/num_embeddings)`` / ``sqrt(1/num_embeddings)``. Both always read back
            as floats.
        init_fn: fills a fresh weight instead of the uniform draw (see :meth:`initialize`).
        need_pos: whether the table needs positions of ids within a bag.
        init_range: embshard's spelling of ``(weight_init_min, weight_init_max)``, keyword only;
            give one spelling, or both agreeing.

    Raises:
        ValueError / TypeError: a bad value, naming the table and field; a TorchRec-only field
            (pruning, virtual tables) set to anything but its default.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: tuple[str, ...] = ()
    # None (TorchRec's default) resolves to +-sqrt(1/num_embeddings) in __post_init__.
    weight_init_max: float = None  # type: ignore[assignment]
    weight_init_min: float = None  # type: ignore[assignment]
    num_embeddings_post_pruning: int | None = None
    init_fn: InitFn | None = None
    need_pos: bool = False
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: Any = None
    enable_embedding_update: bool = False
    stash_weights: bool = False
    init_range: tuple[float, float] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        where = f"table {self.name!r}"
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: {attr} must be a positive int, got {value!r}")
        object.__setattr__(self, "feature_names", _features(self.feature_names, self.name))
        object.__setattr__(self, "data_type", DataType.parse(self.data_type, what=where))
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(
                f"{where}: init_fn must be a callable taking the weight tensor (e.g. "
                f"functools.partial(torch.nn.init.normal_, std=0.01)), got {self.init_fn!r}"
            )
        for name, (default, why) in _UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{where}: {name}={getattr(self, name)!r} is not supported: {why} "
                    f"(leave it at {default!r})"
                )
        low, high = _bounds(self, where)
        object.__setattr__(self, "weight_init_min", low)
        object.__setattr__(self, "weight_init_max", high)
        object.__setattr__(self, "init_range", (low, high))

    def get_weight_init_min(self) -> float:
        """The lower uniform bound (TorchRec's accessor; same as ``weight_init_min``)."""
        return self.weight_init_min

    def get_weight_init_max(self) -> float:
        """The upper uniform bound (TorchRec's accessor; same as ``weight_init_max``)."""
        return self.weight_init_max

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @torch.no_grad()
    def initialize(self, weight: Tensor, generator: torch.Generator | None = None) -> None:
        """Fill ``weight`` (the whole table) as TorchRec does: ``init_fn(weight)`` if set, else
        uniform in ``[weight_init_min, weight_init_max]`` (drawn from ``generator``).

        Raises:
            ValueError: ``init_fn`` returned a tensor of another shape.
        """
        if self.init_fn is None:
            weight.uniform_(self.weight_init_min, self.weight_init_max, generator=generator)
            return
        result = self.init_fn(weight)
        if result is not None and result is not weight:
            if tuple(result.shape) != tuple(weight.shape):
                raise ValueError(
                    f"table {self.name!r}: init_fn returned a tensor of shape "
                    f"{tuple(result.shape)} for a weight of shape {tuple(weight.shape)}; fill the "
                    "weight in place or return a tensor of its shape"
                )
            weight.copy_(result)


def _features(names: Any, table: str) -> tuple[str, ...]:
    where = f"table {table!r}"
    if isinstance(names, str):
        raise TypeError(
            f"{where}: feature_names must be a sequence of names, got the string "
            f"{names!r}; write feature_names=({names!r},)"
        )
    features = tuple(names) or (table,)
    for f in features:
        if not isinstance(f, str) or not f:
            raise ValueError(f"{where}: feature names must be non-empty strings, got {f!r}")
    if len(set(features)) != len(features):
        raise ValueError(f"{where}: feature names repeat: {list(features)}")
    return features


def _bounds(config: BaseEmbeddingConfig, where: str) -> tuple[float, float]:
    """``(min, max)`` from ``init_range`` or ``weight_init_min/max``, defaults filled in."""
    bound = math.sqrt(1.0 / config.num_embeddings)
    given = (config.weight_init_min, config.weight_init_max)
    if config.init_range is not None:
        bounds = tuple(config.init_range)
        if len(bounds) != 2:
            raise ValueError(f"{where}: init_range must be (min, max), got {config.init_range!r}")
        ranged = (float(bounds[0]), float(bounds[1]))
        for name, mine, other in zip(
            ("weight_init_min", "weight_init_max"), ranged, given, strict=True
        ):
            if other is not None and float(other) != mine:
                raise ValueError(
                    f"{where}: init_range {config.init_range} disagrees with {name}={other}; "
                    "give the bounds one way (weight_init_min/max, as in TorchRec)"
                )
        low, high = ranged
    else:
        low = -bound if given[0] is None else _number(given[0], "weight_init_min", where)
        high = bound if given[1] is None else _number(given[1], "weight_init_max", where)
    if not low <= high:
        raise ValueError(
            f"{where}: init_range ({low}, {high}) has min > max; weight_init_min must be at most "
            "weight_init_max"
        )
    return low, high


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each bag of ids becomes one row (summed or averaged)."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        pooling = PoolingType.parse(self.pooling, what=f"table {self.name!r}")
        if pooling is PoolingType.NONE:
            raise ValueError(
                f"table {self.name!r}: an EmbeddingBagConfig pools (SUM or MEAN); "
                "use EmbeddingConfig for one row per id"
            )
        object.__setattr__(self, "pooling", pooling)


@dataclass(frozen=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table: each id becomes its own row (no pooling)."""

    pooling: PoolingType = field(default=PoolingType.NONE, init=False)
