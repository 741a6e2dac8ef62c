"""Table configs: defaults, conversion and validation."""

from __future__ import annotations

import math
from typing import Any

import pytest

from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.vocab import DataType, PoolingType


def test_defaults() -> None:
    cfg = EmbeddingBagConfig(name="t1", num_embeddings=100, embedding_dim=8)
    assert cfg.feature_names == ("t1",)
    assert cfg.data_type is DataType.FP32 and cfg.pooling is PoolingType.SUM
    assert cfg.init_range == (-0.1, 0.1)
    assert (cfg.weight_init_min, cfg.weight_init_max) == (-0.1, 0.1)
    assert cfg.num_features == 1 and cfg.need_pos is False


def test_conversions_and_hashability() -> None:
    cfg = EmbeddingBagConfig(
        name="t",
        num_embeddings=4,
        embedding_dim=2,
        feature_names=["a", "b"],  # type: ignore[arg-type]
        data_type="fp16",  # type: ignore[arg-type]
        pooling="MEAN",  # type: ignore[arg-type]
        init_range=(-1, 2),  # type: ignore[arg-type]
    )
    assert cfg.feature_names == ("a", "b") and cfg.num_features == 2
    assert cfg.data_type is DataType.FP16 and cfg.pooling is PoolingType.MEAN
    assert cfg.init_range == (-1.0, 2.0)
    assert hash(cfg) == hash(EmbeddingBagConfig(**{**cfg.__dict__}))


def test_sequence_config_does_not_pool() -> None:
    cfg = EmbeddingConfig(name="seq", num_embeddings=9, embedding_dim=4)
    assert cfg.pooling is PoolingType.NONE
    assert cfg.init_range == (-math.sqrt(1 / 9), math.sqrt(1 / 9))
    with pytest.raises(TypeError):
        EmbeddingConfig(name="seq", num_embeddings=9, embedding_dim=4, pooling=PoolingType.SUM)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": ""}, ValueError, "table name must be a non-empty string"),
        (
            {"num_embeddings": 0},
            ValueError,
            "table 't': num_embeddings must be a positive int, got 0",
        ),
        ({"num_embeddings": True}, ValueError, "num_embeddings must be a positive int, got True"),
        ({"embedding_dim": 2.5}, ValueError, "table 't': embedding_dim must be a positive int"),
        ({"feature_names": "f1"}, TypeError, r"write feature_names=\('f1',\)"),
        ({"feature_names": ("a", "")}, ValueError, "feature names must be non-empty strings"),
        ({"feature_names": ("a", "a")}, ValueError, r"feature names repeat: \['a', 'a'\]"),
        ({"data_type": "fp64"}, ValueError, "unknown DataType 'fp64' for table 't'"),
        ({"init_range": (1.0, 0.0)}, ValueError, "has min > max"),
        ({"init_range": (0.0,)}, ValueError, r"init_range must be \(min, max\)"),
        ({"init_range": (0.0, float("nan"))}, ValueError, "has min > max"),
        ({"pooling": PoolingType.NONE}, ValueError, "use EmbeddingConfig for one row per id"),
        ({"pooling": "max"}, ValueError, "unknown PoolingType 'max' for table 't'"),
    ],
)
def test_invalid_configs(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    base: dict[str, Any] = {"name": "t", "num_embeddings": 4, "embedding_dim": 2}
    with pytest.raises(error, match=message):
        EmbeddingBagConfig(**{**base, **kwargs})
