"""The pieces the sharding strategies are built from, in one process: feature selection, wire
KJTs, the 1/N gradient scale, deterministic initial weights, state-dict entries and loading.

The strategies themselves run on real ranks in ``tests/test_sharded_ebc_*.py``; here a
one-rank gloo group runs the whole sharded collection for each strategy as a smoke test.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from embshard_dist.sharded import init as init_module
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.init import draw_shard, fill_shard
from embshard_dist.sharded.state import check_entry, local_part
from embshard_dist.strategies.base import FeatureSelector, scale_grad, to_wire
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

TABLES = {"f1": "t1", "f2": "t2"}


def _kjt(weighted: bool = True) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        ["f2", "x", "f1"],
        torch.tensor([1, 2, 3, 4, 5]),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]) if weighted else None,
        lengths=torch.tensor([2, 0, 1, 1, 0, 1]),
    )


def test_feature_selector_permutes_once_and_drops_unused_weights() -> None:
    select = FeatureSelector(["f1", "f2", "f1"], TABLES, is_weighted=False)
    out = select(_kjt())
    assert out.keys() == ["f1", "f2", "f1"]
    assert out.weights_or_none() is None
    assert out.values().tolist() == [5, 1, 2, 5]
    assert out.lengths().tolist() == [0, 1, 2, 0, 0, 1]
    assert len(select._cache) == 1
    select(_kjt())
    assert len(select._cache) == 1  # the permutation is cached per key order


def test_feature_selector_errors_name_feature_and_table() -> None:
    with pytest.raises(ValueError, match=r"feature 'f3' \(table 't3'\) is missing"):
        FeatureSelector(["f3"], {"f3": "t3"}, is_weighted=False)(_kjt())
    with pytest.raises(ValueError, match=r"weighted.*no weights"):
        FeatureSelector(["f1"], TABLES, is_weighted=True)(_kjt(weighted=False))
    variable = KeyedJaggedTensor(
        ["f1", "f2"],
        torch.tensor([1, 2]),
        lengths=torch.tensor([1, 1, 0]),
        stride_per_key_per_rank=[[1], [2]],
    )
    # batch sizes that vary per feature pass through (the sharded collections check them)
    selected = FeatureSelector(["f2"], TABLES, is_weighted=False)(variable)
    assert selected.stride_per_key_per_rank() == [[2]]
    assert to_wire(selected).stride_per_key_per_rank() == [[2]]


def test_to_wire_states_the_batch_size_per_key() -> None:
    wired = to_wire(_kjt())
    assert wired.stride_per_key_per_rank() == [[2], [2], [2]]
    assert torch.equal(wired.values(), _kjt().values())


def test_scale_grad_is_identity_forward_and_one_over_n_backward() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    y = scale_grad(x, 4)
    assert torch.equal(y, x)
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((2, 3), 0.25))
    z = torch.ones(2)
    assert scale_grad(z, 4) is z  # nothing to scale without autograd


def test_drawn_weights_depend_on_the_table_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_module, "ROWS_PER_DRAW", 3)  # several draws per table
    config = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, init_range=(-1, 2))
    whole = draw_shard(config, ShardSpec.on(0, "cpu", (0, 0), (10, 8)), torch.float32)
    assert whole.shape == (10, 8) and whole.min() >= -1 and whole.max() <= 2
    part = draw_shard(config, ShardSpec.on(1, "cpu", (2, 4), (5, 4)), torch.float32)
    assert torch.equal(part, whole[2:7, 4:8])
    empty = draw_shard(config, ShardSpec.on(1, "cpu", (10, 0), (0, 8)), torch.float32)
    assert empty.shape == (0, 8)
    state = torch.random.get_rng_state()
    draw_shard(config, ShardSpec.on(0, "cpu", (0, 0), (10, 8)), torch.float32)
    assert torch.equal(state, torch.random.get_rng_state())  # torch's global RNG untouched
    renamed = EmbeddingBagConfig(name="u", num_embeddings=10, embedding_dim=8, init_range=(-1, 2))
    assert not torch.equal(
        draw_shard(renamed, ShardSpec.on(0, "cpu", (0, 0), (10, 8)), torch.float32), whole
    )


def test_shards_are_drawn_in_place_into_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_module, "ROWS_PER_DRAW", 3)
    config = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, init_range=(-1, 2))
    spec = ShardSpec.on(1, "cpu", (2, 4), (5, 4))
    buffer = torch.zeros(5, 6, dtype=torch.float16)  # the shard lives in columns 1..4
    fill_shard(config, spec, buffer[:, 1:5])
    assert torch.equal(buffer[:, 1:5], draw_shard(config, spec, torch.float16))
    assert not buffer[:, 0].any() and not buffer[:, 5].any()
    with pytest.raises(ValueError, match=r"'t'.*5 x 4.*\(5, 6\)"):
        fill_shard(config, spec, buffer)


def test_loading_takes_the_local_part_or_refuses_naming_the_table() -> None:
    full = torch.arange(24.0).view(6, 4)
    spec = ShardSpec.on(1, "cpu", (2, 0), (3, 4))
    assert torch.equal(local_part(full, spec, (6, 4), "t"), full[2:5])
    assert torch.equal(local_part(full[2:5], spec, (6, 4), "t"), full[2:5])
    with pytest.raises(ValueError, match=r"table 't'.*shape \[5, 4\]"):
        local_part(torch.zeros(5, 4), spec, (6, 4), "t")
    with pytest.raises(ValueError, match=r"table 't'.*got list"):
        local_part([1, 2], spec, (6, 4), "t")
    check_entry(full, (6, 4), "t")
    with pytest.raises(ValueError, match=r"table 't'.*the table is \[6, 4\]"):
        check_entry(torch.zeros(3, 4), (6, 4), "t")


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group in this process (unless the session already has one)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_one_rank_sharding_matches_unsharded(one_rank_group: None, kind: str) -> None:
    tables = [
        EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=8, feature_names=("f1",)),
        EmbeddingBagConfig(
            name="t2", num_embeddings=4, embedding_dim=4, feature_names=("f2",), pooling="mean"
        ),
    ]
    spec = OptimizerSpec.from_name("rowwise_adagrad", lr=0.5)
    torch.manual_seed(0)
    reference = EmbeddingBagCollection(tables, optimizer=spec)
    torch.manual_seed(0)
    source = EmbeddingBagCollection(tables, optimizer=spec)
    ranks = None if kind in ("row_wise", "data_parallel") else [0]
    plan = EmbeddingModuleShardingPlan(
        {t.name: ParameterSharding(kind, "fused", ranks=ranks) for t in tables}
    )
    sharded = EmbeddingBagCollectionSharder().shard(
        source, plan, ShardingEnv.from_process_group(dist.group.WORLD)
    )
    kjt = _kjt(weighted=False)
    for _ in range(2):
        out = sharded(kjt)
        expected = reference(kjt)
        torch.testing.assert_close(out.values(), expected.values(), atol=1e-6, rtol=1e-6)
        out.values().pow(2).sum().backward()
        expected.values().pow(2).sum().backward()
    for key, value in sharded.state_dict().items():
        local = value.local_shards()[0].tensor if hasattr(value, "local_shards") else value
        torch.testing.assert_close(local, reference.state_dict()[key], atol=1e-6, rtol=1e-6)
