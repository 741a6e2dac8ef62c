"""DMPCollectionConfig: its validation runs at construction and against a world size."""

from __future__ import annotations

from typing import Any

import pytest
from plan_strategies import make_sharding
from test_interfaces import ScaledSharded
from torch import nn

from embshard_types.plan import DMPCollectionConfig, ShardingPlan
from embshard_types.vocab import ShardingType


def _plan(world_size: int) -> ShardingPlan:
    return ShardingPlan({"ebc": {"t1": make_sharding(ShardingType.ROW_WISE, world_size)}})


def test_valid_config() -> None:
    cfg = DMPCollectionConfig(nn.EmbeddingBag, _plan(2), 2, node_group_size=2)
    assert cfg.num_sharding_groups(8) == 4
    cfg.check_world(2)
    assert "plan" not in repr(cfg)
    assert hash(cfg) == hash(DMPCollectionConfig(nn.EmbeddingBag, _plan(2), 2, node_group_size=2))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"module": nn.EmbeddingBag(2, 2)}, TypeError, "module must be an nn.Module class"),
        ({"module": int}, TypeError, "module must be an nn.Module class"),
        (
            {"module": ScaledSharded},
            ValueError,
            "unsharded module class, got the sharded ScaledSharded",
        ),
        ({"plan": {"ebc": {}}}, TypeError, "plan must be a ShardingPlan, got dict"),
        (
            {"sharding_group_size": 0},
            ValueError,
            "sharding_group_size must be a positive int, got 0",
        ),
        ({"sharding_group_size": 2.0}, ValueError, "sharding_group_size must be a positive int"),
        ({"node_group_size": -1}, ValueError, "node_group_size must be a positive int, got -1"),
        ({"use_inter_host_allreduce": 1}, ValueError, "use_inter_host_allreduce must be a bool"),
        (
            {"plan": _plan(4)},
            ValueError,
            r"sharding group of 2: rank 2 is outside the world of size 2 \(table 't1'\) "
            r"in module 'ebc'",
        ),
    ],
)
def test_invalid_config(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    base: dict[str, Any] = {"module": nn.EmbeddingBag, "plan": _plan(2), "sharding_group_size": 2}
    with pytest.raises(error, match=message):
        DMPCollectionConfig(**{**base, **kwargs})


def test_check_world() -> None:
    cfg = DMPCollectionConfig(nn.EmbeddingBag, _plan(2), 2, node_group_size=4)
    cfg.check_world(8)
    with pytest.raises(ValueError, match="sharding_group_size 2 does not divide the world size 5"):
        cfg.check_world(5)
    with pytest.raises(ValueError, match="node_group_size 4 does not divide the world size 6"):
        cfg.check_world(6)
    with pytest.raises(ValueError, match="must be a positive int, got 0"):
        cfg.num_sharding_groups(0)
