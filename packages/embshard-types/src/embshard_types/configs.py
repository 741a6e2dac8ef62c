"""Table configurations: what a user declares about each embedding table.

Configs are frozen and hashable and validated at construction (``ValueError`` naming the table
and field); enum fields accept their strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from embshard_types.vocab import DataType, PoolingType


@dataclass(frozen=True, kw_only=True)
class BaseEmbeddingConfig:
    """Fields shared by pooled and sequence tables.

    Args:
        feature_names: the input features that read this table (at least one).
        init_range: uniform initialisation bounds (default ``±sqrt(1/num_embeddings)``), read
            back as ``weight_init_min`` / ``weight_init_max``.
        need_pos: whether the table needs positions of ids within a bag.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = ()
    data_type: DataType = DataType.FP32
    init_range: tuple[float, float] | None = None
    need_pos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        where = f"table {self.name!r}"
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: {attr} must be a positive int, got {value!r}")
        if isinstance(self.feature_names, str):
            raise TypeError(
                f"{where}: feature_names must be a sequence of names, got the string "
                f"{self.feature_names!r}; write feature_names=({self.feature_names!r},)"
            )
        features = tuple(self.feature_names)
        if not features:
            features = (self.name,)
        for f in features:
            if not isinstance(f, str) or not f:
                raise ValueError(f"{where}: feature names must be non-empty strings, got {f!r}")
        if len(set(features)) != len(features):
            raise ValueError(f"{where}: feature names repeat: {list(features)}")
        object.__setattr__(self, "feature_names", features)
        object.__setattr__(self, "data_type", DataType.parse(self.data_type, what=where))
        if self.init_range is None:
            bound = math.sqrt(1.0 / self.num_embeddings)
            object.__setattr__(self, "init_range", (-bound, bound))
        else:
            bounds = tuple(self.init_range)
            if len(bounds) != 2:
                raise ValueError(f"{where}: init_range must be (min, max), got {self.init_range!r}")
            lo, hi = float(bounds[0]), float(bounds[1])
            if not lo <= hi:
                raise ValueError(f"{where}: init_range {self.init_range} has min > max")
            object.__setattr__(self, "init_range", (lo, hi))

    @property
    def weight_init_min(self) -> float:
        assert self.init_range is not None
        return self.init_range[0]

    @property
    def weight_init_max(self) -> float:
        assert self.init_range is not None
        return self.init_range[1]

    @property
    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table: each id becomes its own row (no pooling)."""

    pooling: PoolingType = field(default=PoolingType.NONE, init=False)
