"""State and plan checks of a ShardedEmbeddingCollection.

On 2 gloo ranks with a plan mixing the four types: ``state_dict()`` holds
``embeddings.{table}.weight`` for every table (``ShardedTensor`` for table-, row- and
column-wise tables, ``DTensor`` when the environment asks, the plain tensor for data-parallel
ones) whose local shards are the live weights; loading the unsharded collection's whole tensors
puts every shard's rows and columns in place (the outputs then equal the unsharded ones);
a state dict round-trips between two sharded collections; a collection built on ``meta`` gets
the deterministic per-table initial weights; the fused optimizer's parameters are named
``embeddings.{table}.weight``. In one process: the sharder's plan checks name the table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_sharded_ec_training import KEYS, OPTIMIZERS, TABLES, global_batch, kjt_of, plan_for

from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.init import draw_shard
from embshard_kernels.collections import EmbeddingCollection
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

SPEC = OPTIMIZERS["rowwise_adagrad"]


def _module(seed: int, device: str = "cpu") -> EmbeddingCollection:
    torch.manual_seed(seed)
    return EmbeddingCollection(list(TABLES), device=device, optimizer=SPEC)


def _shard(module: EmbeddingCollection, *, dtensor: bool = False) -> Any:
    world = dist.get_world_size()
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=dtensor)
    return EmbeddingCollectionSharder().shard(module, plan_for("mixed", world), env, test_device())


def _outputs(module: Any, lo: int, hi: int) -> list[torch.Tensor]:
    data = global_batch(0, 2 * dist.get_world_size())
    out = module(kjt_of(data, KEYS, lo, hi).to(test_device()))
    out = out.wait() if hasattr(out, "wait") else out
    return [out[k].values().detach().cpu() for k in KEYS]


def _pieces(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    if hasattr(value, "local_shards"):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    inner = value.to_local() if hasattr(value, "to_local") else value
    if hasattr(inner, "local_shards"):  # a DTensor over a LocalShardsWrapper
        offsets = inner.local_offsets()
        return [(t, tuple(o)) for t, o in zip(inner.local_shards(), offsets, strict=True)]
    return [(value, (0, 0))]


def _state_case() -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _module(1)
    sharded = _shard(_module(2))
    state = sharded.state_dict()
    assert sorted(state) == sorted(f"embeddings.{t.name}.weight" for t in TABLES)
    kinds = {k: type(v).__name__ for k, v in state.items()}
    assert kinds["embeddings.t_small.weight"] == "Tensor"  # data-parallel
    for key in ("embeddings.t_a.weight", "embeddings.t_shared.weight", "embeddings.t_wide.weight"):
        assert kinds[key] == "ShardedTensor", kinds

    # loading whole tensors puts every shard's rows and columns in place
    sharded.load_state_dict(reference.state_dict())
    lo, hi = 2 * rank, 2 * rank + 2
    whole = _outputs(reference, 0, 2 * world)
    data = global_batch(0, 2 * world)
    for got, want, key in zip(_outputs(sharded, lo, hi), whole, KEYS, strict=True):
        lengths = data[key][0]
        start = int(lengths[:lo].sum())
        assert torch.equal(got, want[start : start + int(lengths[lo:hi].sum())]), key

    # a state dict round-trips into another sharded collection (live weights, no copies)
    other = _shard(_module(3))
    other.load_state_dict(sharded.state_dict())
    for key, value in other.state_dict().items():
        for (a, oa), (b, ob) in zip(_pieces(value), _pieces(state[key]), strict=True):
            assert oa == ob and torch.equal(a, b), key
    params = dict(sharded.named_parameters())
    for key, value in state.items():
        for tensor, _ in _pieces(value):
            assert tensor.data_ptr() == params[key].data_ptr(), key

    # DTensor entries when the environment asks for them
    dtensors = _shard(_module(2), dtensor=True).state_dict()
    assert type(dtensors["embeddings.t_shared.weight"]).__name__ == "DTensor"

    # built on meta: the deterministic per-table draw
    drawn = _shard(_module(0, device="meta"))
    for name, (weight, spec) in drawn._local.items():
        config = next(t for t in TABLES if t.name == name)
        assert torch.equal(weight.detach().cpu(), draw_shard(config, spec, torch.float32)), name
    names = sorted(drawn.fused_optimizer.state_dict()["state"])
    return {"kinds": kinds, "optimizer_params": names}


def test_sharded_ec_state_dicts() -> None:
    results = run_on_ranks(2, _state_case)
    names = results[0]["optimizer_params"]
    assert "embeddings.t_small.weight" in names  # data-parallel tables are trained too
    assert all(n.startswith("embeddings.") and n.endswith(".weight") for n in names)


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        ({"t_a": ParameterSharding(ShardingType.TABLE_WISE, "fused", ranks=[0])}, "'t_shared'"),
        (
            {
                **{t.name: ParameterSharding(ShardingType.ROW_WISE, "fused") for t in TABLES},
                "t_a": ParameterSharding(ShardingType.TABLE_ROW_WISE, "fused", ranks=[0, 1]),
            },
            r"t_a.*'table_row_wise' is not supported by the EmbeddingCollection sharder",
        ),
        (
            {
                **{t.name: ParameterSharding(ShardingType.ROW_WISE, "fused") for t in TABLES},
                "t_a": ParameterSharding(ShardingType.TABLE_WISE, "fused", ranks=[5]),
            },
            "t_a",
        ),
        (
            {
                **{t.name: ParameterSharding(ShardingType.ROW_WISE, "fused") for t in TABLES},
                "t_shared": ParameterSharding(
                    ShardingType.COLUMN_WISE,
                    "fused",
                    ranks=[0, 1],
                    shards=[
                        ShardSpec.on(0, "cpu", (0, 0), (11, 6)),
                        ShardSpec.on(1, "cpu", (0, 6), (11, 6)),
                    ],
                ),
            },
            r"t_shared.*multiple of 4",
        ),
    ],
    ids=["missing_table", "node_aware_type", "rank_outside_world", "odd_column_split"],
)
def test_plan_checks_name_the_table(tables: dict[str, Any], match: str) -> None:
    module = EmbeddingCollection(list(TABLES), device="meta")
    sharder = EmbeddingCollectionSharder()
    plan = EmbeddingModuleShardingPlan(tables)
    with pytest.raises(ValueError, match=match):
        sharder.check_plan(module, plan, ShardingEnv.from_local(2, 0), "cpu", "ec")
    assert ShardingType.TABLE_ROW_WISE not in sharder.sharding_types("cpu")
    assert sharder.compute_kernels("data_parallel", "cpu") == [ComputeKernel.FUSED]
