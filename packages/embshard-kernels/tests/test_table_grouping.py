"""Table configs and their grouping into one TBE each; fused params."""

from __future__ import annotations

import pytest
from kernel_testing import table

from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import GroupedEmbeddingConfig, ShardedTableConfig, group_tables
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.kernel_params import BoundsCheckMode
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, DataType, PoolingType


def test_defaults_cover_the_whole_table() -> None:
    t = table("t", 10, 8, ["a", "b"])
    assert (t.rows, t.cols) == (10, 8)
    assert t.local_metadata == ShardSpec((0, 0), (10, 8), "rank:0/cpu")
    assert t.global_metadata == (t.local_metadata,)
    assert t.init_range == pytest.approx((-(0.1**0.5), 0.1**0.5))


def test_from_config_keeps_the_users_settings() -> None:
    cfg = EmbeddingBagConfig(
        name="t", num_embeddings=10, embedding_dim=8, pooling="mean", init_range=(-1, 1)
    )
    shard = ShardSpec.on(1, "cpu", (5, 0), (5, 8))
    t = ShardedTableConfig.from_config(
        cfg,
        compute_kernel=ComputeKernel.DENSE,
        local_metadata=shard,
        global_metadata=[ShardSpec.on(0, "cpu", (0, 0), (5, 8)), shard],
    )
    assert (t.rows, t.cols, t.pooling, t.init_range) == (5, 8, PoolingType.MEAN, (-1.0, 1.0))
    seq = ShardedTableConfig.from_config(
        EmbeddingConfig(name="s", num_embeddings=4, embedding_dim=4)
    )
    assert seq.pooling is PoolingType.NONE and seq.feature_names == ("s",)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "a.b"}, "may not contain '.'"),
        ({"num_embeddings": 0}, "num_embeddings must be a positive int"),
        ({"local_rows": 11}, "does not fit the table"),
        ({"is_weighted": True, "pooling": "mean"}, "per-id weights need SUM"),
        ({"local_metadata": ShardSpec((0, 0), (3, 8), "rank:0/cpu")}, "disagree with local_rows"),
    ],
)
def test_invalid_tables_are_named(kwargs: dict, match: str) -> None:
    base = {"name": "t", "num_embeddings": 10, "embedding_dim": 8}
    with pytest.raises(ValueError, match=match):
        ShardedTableConfig(**{**base, **kwargs})


def test_grouping_by_type_pooling_weightedness_kernel_and_params() -> None:
    adam = FusedParams(optimizer=OptimizerSpec(OptimType.ADAM))
    tables = [
        table("a", 10, 8),
        table("b", 10, 4, pooling="mean"),
        table("c", 10, 4),
        table("d", 10, 4, weighted=True),
        table("e", 10, 4, kernel="dense"),
        table("f", 10, 4, data_type=DataType.FP16),
        ShardedTableConfig(name="g", num_embeddings=10, embedding_dim=4, fused_params=adam),
        table("h", 10, 4, pooling="mean"),
    ]
    groups = group_tables(tables)
    assert [g.table_names() for g in groups] == [["a", "c"], ["b", "h"], ["d"], ["e"], ["f"], ["g"]]
    assert groups[0].feature_table_map() == [0, 1]
    assert groups[0].dim_sum() == 12


def test_sequence_groups_share_one_width() -> None:
    tables = [
        table("a", 10, 8, pooling="none"),
        table("b", 10, 4, pooling="none"),
        table("c", 10, 8, pooling="none"),
    ]
    assert [g.table_names() for g in group_tables(tables)] == [["a", "c"], ["b"]]


def test_two_shards_of_one_table_go_to_different_groups() -> None:
    left = table("t", 10, 8, local_cols=4, local_metadata=ShardSpec((0, 0), (10, 4), "rank:0/cpu"))
    right = table("t", 10, 8, local_cols=4, local_metadata=ShardSpec((0, 4), (10, 4), "rank:0/cpu"))
    groups = group_tables([left, right, table("u", 10, 4)])
    assert [g.table_names() for g in groups] == [["t", "u"], ["t"]]


def test_a_group_refuses_mismatched_tables() -> None:
    with pytest.raises(ValueError, match="its pooling differs"):
        GroupedEmbeddingConfig(
            DataType.FP32,
            PoolingType.SUM,
            False,
            ComputeKernel.FUSED,
            (table("a", 10, 8), table("b", 10, 8, pooling="mean")),
        )


def test_fused_params_from_torchrec_dict() -> None:
    params = FusedParams.from_dict(
        {
            "optimizer": "exact_row_wise_adagrad",
            "learning_rate": 0.05,
            "eps": 1e-3,
            "output_dtype": "fp16",
            "bounds_check_mode": "fatal",
            "cache_load_factor": 0.3,
        }
    )
    assert params.optimizer.optim_type is OptimType.ROWWISE_ADAGRAD
    assert params.optimizer.learning_rate == 0.05
    assert params.output_dtype is DataType.FP16
    assert params.bounds_check_mode is BoundsCheckMode.FATAL
    assert params.cache_params is not None and params.cache_params.load_factor == 0.3
    with pytest.raises(ValueError, match=r"unknown fused_params key\(s\) \['learningrate'\]"):
        FusedParams.from_dict({"learningrate": 0.1})
    assert hash(params) == hash(
        FusedParams.from_dict(
            {
                "optimizer": "exact_row_wise_adagrad",
                "learning_rate": 0.05,
                "eps": 1e-3,
                "output_dtype": "fp16",
                "bounds_check_mode": "fatal",
                "cache_load_factor": 0.3,
            }
        )
    )
