"""The vocabulary enums: TorchRec's string values and forgiving, clear parsing."""

from __future__ import annotations

import pytest

from embshard_types.vocab import (
    CommOp,
    ComputeKernel,
    DataType,
    EmbeddingEvent,
    ObjectPoolShardingType,
    ParameterStorage,
    PipelineType,
    PoolingType,
    ShardingType,
)

ENUMS = [
    ShardingType,
    ComputeKernel,
    EmbeddingEvent,
    PipelineType,
    ParameterStorage,
    CommOp,
    ObjectPoolShardingType,
    PoolingType,
    DataType,
]


def test_torchrec_values() -> None:
    assert [t.value for t in ShardingType] == [
        "data_parallel",
        "table_wise",
        "column_wise",
        "row_wise",
        "table_row_wise",
        "table_column_wise",
        "grid_shard",
    ]
    assert ComputeKernel.FUSED_UVM_CACHING.value == "fused_uvm_caching"
    assert ParameterStorage.HBM.value == "hbm" and ParameterStorage.DDR.value == "ddr"
    assert CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value == "pooled_embeddings_reduce_scatter"


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
def test_parse_accepts_members_values_and_names_in_any_case(enum: type) -> None:
    for member in enum:
        assert enum.parse(member) is member
        assert enum.parse(member.value) is member
        assert enum.parse(member.value.upper()) is member
        assert enum.parse(member.name) is member
        assert str(member) == member.value


@pytest.mark.parametrize("bad", ["nope", 3, None, ComputeKernel.FUSED])
def test_parse_errors_list_the_choices_and_the_place(bad: object) -> None:
    with pytest.raises(
        ValueError, match=r"unknown ShardingType .* for table 't1'; expected one of "
    ):
        ShardingType.parse(bad, what="table 't1'")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'data_parallel', 'table_wise'"):
        ShardingType.parse(bad)  # type: ignore[arg-type]


def test_data_type_bits() -> None:
    assert [d.bits for d in DataType] == [32, 16, 16, 8, 4, 2]
    assert [d for d in DataType if d.is_quantized] == [DataType.INT8, DataType.INT4, DataType.INT2]
