"""State of a ShardedEmbeddingBagCollection on real gloo ranks: initial weights, state dicts
(ShardedTensor and DTensor), loading, parameters, and plan errors raised alike on every rank.

One process launch per test checks several things, to keep the suite fast.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_sharded_ebc_training import (
    OPTIMIZERS,
    TABLES,
    global_batch,
    kjt_of,
    local_pieces,
    plan_for,
)

from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.init import draw_shard
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec

SPEC = OPTIMIZERS["adam"]
KEYS = [f for t in TABLES for f in t.feature_names]


def _shard(module: EmbeddingBagCollection, plan: str, *, dtensor: bool = False) -> Any:
    world = dist.get_world_size()
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=dtensor)
    return EmbeddingBagCollectionSharder().shard(module, plan_for(plan, world), env, test_device())


def _module(seed: int, device: str = "cpu") -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(list(TABLES), device=device, optimizer=SPEC)


def _train_step(module: Any, step: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = global_batch(list(TABLES), step, 2 * world)
    out = module(kjt_of(data, KEYS, 2 * rank, 2 * rank + 2, False).to(test_device())).values()
    out.sum().backward()
    return out.detach()


def _pieces_equal(a: Any, b: Any) -> None:
    for (x, ox), (y, oy) in zip(local_pieces(a), local_pieces(b), strict=True):
        assert ox == oy and torch.equal(x, y), (ox, oy)


def _whole(config: Any) -> torch.Tensor:
    spec = ShardSpec.on(0, "cpu", (0, 0), (config.num_embeddings, config.embedding_dim))
    return draw_shard(config, spec, torch.float32)


def _check_meta_init_and_loading() -> bool:
    configs = {t.name: t for t in TABLES}
    # Weights drawn for a meta module depend on the table only, not on the plan.
    for plan in ("mixed", "rw", "cw"):
        sharded = _shard(_module(0, "meta"), plan)
        for key, value in sharded.state_dict().items():
            whole = _whole(configs[key.split(".")[1]])
            for tensor, offsets in local_pieces(value):
                (r, c), (nr, nc) = offsets, tensor.shape
                assert torch.equal(tensor.cpu(), whole[r : r + nr, c : c + nc]), (plan, key)

    # A trained module's weights and optimizer state load into another one exactly.
    trained = _shard(_module(1), "mixed")
    _train_step(trained, 0)
    other = _shard(_module(2), "mixed")
    other.load_state_dict(trained.state_dict())
    other.fused_optimizer.load_state_dict(trained.fused_optimizer.state_dict())
    other.fused_optimizer.set_optimizer_step(1)  # Adam's step count is not part of the state
    assert torch.equal(_train_step(other, 1), _train_step(trained, 1))
    for key, value in other.state_dict().items():
        _pieces_equal(value, trained.state_dict()[key])

    # The unsharded module's plain state dict loads too (each rank takes its part).
    reference = _module(3)
    other.load_state_dict(reference.state_dict())
    for key, value in other.state_dict().items():
        for tensor, offsets in local_pieces(value):
            (r, c), (nr, nc) = offsets, tensor.shape
            expected = reference.state_dict()[key][r : r + nr, c : c + nc]
            assert torch.equal(tensor.cpu(), expected)

    # A tensor of the wrong shape is refused, naming the table, before anything is written.
    before = {k: [t.clone() for t, _ in local_pieces(v)] for k, v in other.state_dict().items()}
    bad = dict(reference.state_dict())
    bad["embedding_bags.t_sum.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="t_sum"):
        other.load_state_dict(bad)
    for key, value in other.state_dict().items():
        for (tensor, _), old in zip(local_pieces(value), before[key], strict=True):
            assert torch.equal(tensor, old)

    # Parameters are the local shards, under the unsharded module's names.
    names = {name for name, _ in other.named_parameters()}
    assert names == {f"embedding_bags.{t}.weight" for t in other._local}
    return True


def _check_dtensor() -> bool:
    from torch.distributed.tensor import DTensor

    sharded = _shard(_module(4), "mixed", dtensor=True)
    _train_step(sharded, 0)
    state = sharded.state_dict()
    assert not isinstance(state["embedding_bags.t_mean.weight"], DTensor)  # data-parallel
    for key in ("t_sum", "t_shared", "t_wide"):
        assert isinstance(state[f"embedding_bags.{key}.weight"], DTensor), key
    for param_state in sharded.fused_optimizer.state_dict()["state"].values():
        for name, value in param_state.items():
            assert isinstance(value, DTensor) or name.startswith("t_mean"), name

    # DTensor entries load back (into a ShardedTensor-exposing module too).
    copy = _shard(_module(5), "mixed")
    copy.load_state_dict(state)
    for key, value in copy.state_dict().items():
        expected = state[key].to_local() if isinstance(state[key], DTensor) else state[key]
        shards = expected.local_shards() if hasattr(expected, "local_shards") else [expected]
        got = [t for t, _ in local_pieces(value)]
        assert all(torch.equal(a, b) for a, b in zip(got, shards, strict=True)), key
    return True


@pytest.mark.parametrize("check", [_check_meta_init_and_loading, _check_dtensor])
def test_state(check: Any) -> None:
    assert run_on_ranks(2, check) == [True, True]


def _bad_plan_everywhere() -> str:
    """Shard with a plan naming a rank outside the world; return the error, then prove that
    no rank started a collective (a barrier still lines up)."""
    plan = dict(plan_for("tw", dist.get_world_size()))
    plan["t_wide"] = ParameterSharding("table_wise", "fused", ranks=[5])
    try:
        _shard_with(EmbeddingModuleShardingPlan(plan))
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    dist.barrier()
    return message


def _shard_with(plan: EmbeddingModuleShardingPlan) -> Any:
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return EmbeddingBagCollectionSharder().shard(_module(0), plan, env, test_device())


def test_bad_plan_raises_the_same_error_on_every_rank() -> None:
    messages = run_on_ranks(2, _bad_plan_everywhere)
    assert messages[0] == messages[1]
    assert "rank 5" in messages[0] and "t_wide" in messages[0], messages[0]
