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


def test_torchrec_fields_order_and_defaults() -> None:
    cfg = EmbeddingBagConfig(16, 4, "t", "fp16", ["a"])  # TorchRec's positional order
    assert (cfg.num_embeddings, cfg.embedding_dim, cfg.name) == (16, 4, "t")
    assert cfg.data_type is DataType.FP16 and cfg.feature_names == ("a",)
    assert (cfg.weight_init_min, cfg.weight_init_max) == (-0.25, 0.25)
    assert (cfg.get_weight_init_min(), cfg.get_weight_init_max()) == (-0.25, 0.25)
    assert cfg.init_fn is None and cfg.num_embeddings_post_pruning is None
    assert cfg.use_virtual_table is False and cfg.stash_weights is False


def test_weight_init_bounds_and_init_range_are_one_setting() -> None:
    cfg = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, weight_init_min=-2)
    assert (cfg.weight_init_min, cfg.weight_init_max) == (-2.0, 0.5)
    assert cfg.init_range == (-2.0, 0.5)
    ranged = EmbeddingConfig(name="s", num_embeddings=4, embedding_dim=2, init_range=(0.0, 1.0))
    assert (ranged.weight_init_min, ranged.weight_init_max) == (0.0, 1.0)
    same = EmbeddingConfig(
        name="s", num_embeddings=4, embedding_dim=2, weight_init_min=0.0, weight_init_max=1.0
    )
    assert same == ranged and hash(same) == hash(ranged)
    with pytest.raises(ValueError, match="disagrees with weight_init_max=3"):
        EmbeddingConfig(
            name="s", num_embeddings=4, embedding_dim=2, init_range=(0, 1), weight_init_max=3
        )
    with pytest.raises(ValueError, match="weight_init_min must be at most weight_init_max"):
        EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, weight_init_min=1.0)


def test_initialize_uses_init_fn_else_uniform_bounds() -> None:
    import functools

    import torch

    filled = EmbeddingBagConfig(
        name="t",
        num_embeddings=3,
        embedding_dim=2,
        init_fn=functools.partial(torch.nn.init.constant_, val=0.5),
    )
    weight = torch.empty(3, 2)
    filled.initialize(weight)
    assert torch.equal(weight, torch.full((3, 2), 0.5))
    returned = EmbeddingBagConfig(
        name="r", num_embeddings=3, embedding_dim=2, init_fn=lambda w: torch.ones_like(w)
    )
    returned.initialize(weight)
    assert torch.equal(weight, torch.ones(3, 2))
    bounded = EmbeddingBagConfig(
        name="u", num_embeddings=300, embedding_dim=8, weight_init_min=2.0, weight_init_max=3.0
    )
    weight = torch.empty(300, 8)
    bounded.initialize(weight, generator=torch.Generator().manual_seed(0))
    assert float(weight.min()) >= 2.0 and float(weight.max()) <= 3.0
    assert float(weight.max()) - float(weight.min()) > 0.9
    with pytest.raises(TypeError, match="init_fn must be a callable"):
        EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, init_fn=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field_name", "value", "message"),
    [
        ("num_embeddings_post_pruning", 2, "does not prune"),
        ("use_virtual_table", True, "no virtual tables"),
        ("total_num_buckets", 4, "no bucketised"),
        ("stash_weights", True, "does not stash"),
    ],
)
def test_torchrec_only_fields_are_refused_unless_default(
    field_name: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=f"table 't': {field_name}={value!r} is not supported.*"):
        EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, **{field_name: value})
    with pytest.raises(ValueError, match=message):
        EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, **{field_name: value})
