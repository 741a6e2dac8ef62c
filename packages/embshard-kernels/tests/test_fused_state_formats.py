"""A fused kernel's optimizer state is exposed per table as ShardedTensor / DTensor over its own storage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kernel_testing import random_kjt, table

from embshard_kernels.fused import BatchedFusedEmbeddingBag
from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_optim.specs import OptimizerSpec
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, DataType, PoolingType


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def _config(row_sharded: bool) -> GroupedEmbeddingConfig:
    """The whole table, or rows [0, 6) of it with a (virtual) rank 1 holding the rest."""
    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)
    if not row_sharded:
        t = table("t", 10, 8, ["f"], optimizer=spec)
        return GroupedEmbeddingConfig(
            DataType.FP32, PoolingType.SUM, False, ComputeKernel.FUSED, (t,), t.fused_params
        )
    mine = ShardSpec.on(0, "cpu", (0, 0), (6, 8))
    theirs = ShardSpec.on(1, "cpu", (6, 0), (4, 8))
    t = table(
        "t",
        10,
        8,
        ["f"],
        optimizer=spec,
        local_rows=6,
        local_metadata=mine,
        global_metadata=(mine, theirs),
    )
    return GroupedEmbeddingConfig(
        DataType.FP32, PoolingType.SUM, False, ComputeKernel.FUSED, (t,), t.fused_params
    )


@pytest.mark.parametrize("state_format,row_sharded", [(None, False), ("dtensor", True)])
def test_sharded_state_views_the_kernel(
    world_of_one: dist.ProcessGroup, state_format: str | None, row_sharded: bool
) -> None:
    config = _config(row_sharded)
    kernel = BatchedFusedEmbeddingBag(config, pg=world_of_one, state_format=state_format)
    kernel(random_kjt([("f", config.embedding_tables[0].rows)], 4, seed=1)).sum().backward()
    state = kernel.fused_optimizer.state_dict()["state"]["t.weight"]["t.momentum1"]
    local = kernel.emb_module.get_optimizer_state()[0]["momentum1"]
    assert local.abs().sum() > 0
    if state_format is None:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        assert isinstance(state, ShardedTensor) and state.size() == torch.Size([10])
        shard = state.local_shards()[0].tensor
    else:
        from torch.distributed.tensor import DTensor

        assert isinstance(state, DTensor) and state.shape == torch.Size([10])
        shard = state.to_local()
        shard = getattr(shard, "local_shards", lambda: [shard])()[0]
    assert shard.data_ptr() == local.data_ptr()  # no copy: the kernel's own storage


def test_whole_tables_without_a_group_use_plain_tensors() -> None:
    kernel = BatchedFusedEmbeddingBag(
        GroupedEmbeddingConfig(
            DataType.FP32,
            PoolingType.SUM,
            False,
            ComputeKernel.FUSED,
            (table("t", 10, 8, optimizer=OptimizerSpec.from_name("adagrad")),),
            table("t", 10, 8, optimizer=OptimizerSpec.from_name("adagrad")).fused_params,
        )
    )
    state = kernel.fused_optimizer.state_dict()["state"]["t.weight"]["t.momentum1"]
    assert type(state) is torch.Tensor and state.shape == (10, 8)
