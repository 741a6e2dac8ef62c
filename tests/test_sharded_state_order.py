"""Sharded state-dict keys come in the collection's config order on every rank, whichever tables
a rank holds shards of; the state dict still loads back. Also: ``CollectionSharder.with_optimizer``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device

from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.plan_helpers import construct_module_sharding_plan, table_wise
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.env import ShardingEnv

# Table-wise on alternating ranks, the first table on rank 1: rank 0 holds t1, t3; rank 1 t0, t2.
NAMES = ["t0", "t1", "t2", "t3"]
RANKS = {"t0": 1, "t1": 0, "t2": 1, "t3": 0}


def _sharded(kind: str, seed: int, optimizer: OptimizerSpec | None = None) -> Any:
    torch.manual_seed(seed)
    world = dist.get_world_size()
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD)
    module: Any
    sharder: Any
    if kind == "bag":
        bags = [EmbeddingBagConfig(20 + i, 4, n) for i, n in enumerate(NAMES)]
        module = EmbeddingBagCollection(bags, optimizer=OptimizerSpec.from_name("sgd", lr=0.1))
        sharder = EmbeddingBagCollectionSharder()
    else:
        seqs = [EmbeddingConfig(20 + i, 4, n) for i, n in enumerate(NAMES)]
        module = EmbeddingCollection(seqs, optimizer=OptimizerSpec.from_name("sgd", lr=0.1))
        sharder = EmbeddingCollectionSharder()
    if optimizer is not None:
        sharder = sharder.with_optimizer(optimizer)
    device = test_device()
    plan = construct_module_sharding_plan(
        module,
        {n: table_wise(rank=r) for n, r in RANKS.items()},
        sharder=sharder,
        world_size=world,
        device_type=device.type,
    )
    return sharder.shard(module, plan, env, device)


def _keys_and_round_trip(kind: str) -> list[str]:
    sharded = _sharded(kind, 0)
    attr = "embedding_bags" if kind == "bag" else "embeddings"
    held = sorted(n for n, r in RANKS.items() if r == dist.get_rank())
    assert sorted(name for name, _ in sharded.named_parameters()) == [
        f"{attr}.{n}.weight" for n in held
    ]
    state = sharded.state_dict()
    keys = list(state)
    assert keys == [f"{attr}.{n}.weight" for n in NAMES], keys

    other = _sharded(kind, 1)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    other.load_state_dict(state)
    for name, param in other.named_parameters():
        expected = dict(sharded.named_parameters())[name]
        assert torch.equal(param.detach(), expected.detach()), name
        assert not torch.equal(param.detach(), before[name]), name
    assert list(other.state_dict()) == keys
    return keys


def _with_optimizer_lr() -> list[float]:
    sharded = _sharded("bag", 0, OptimizerSpec.from_name("rowwise_adagrad", lr=0.25))
    state = sharded.fused_optimizer.state_dict()
    return sorted({float(g["lr"]) for g in state["param_groups"]})


def test_state_dict_keys_in_config_order_on_every_rank() -> None:
    bag_keys = run_on_ranks(2, _keys_and_round_trip, "bag")
    assert bag_keys[0] == bag_keys[1]
    seq_keys = run_on_ranks(2, _keys_and_round_trip, "seq")
    assert seq_keys[0] == seq_keys[1]


def test_with_optimizer_gives_the_sharded_module_that_optimizer() -> None:
    sharder = EmbeddingBagCollectionSharder(local_world_size=1)
    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.25)
    clone = sharder.with_optimizer(spec)
    assert type(clone) is EmbeddingBagCollectionSharder
    assert clone.optimizer == spec and sharder.optimizer is None
    assert clone._local_world_size == 1
    assert run_on_ranks(2, _with_optimizer_lr) == [[0.25], [0.25]]
