"""EmbeddingFusedOptimizer in one process (plain-tensor state), and the fused-optimizer basics."""

from __future__ import annotations

import pytest
import torch
from _optim_helpers import FakeKernel

from embshard_optim.combined import CombinedOptimizer
from embshard_optim.embedding_fused import (
    EmbeddingFusedOptimizer,
    FusedKernelLike,
    TableShardInfo,
)
from embshard_optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
from embshard_optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from embshard_optim.sparse_rules import rule_for
from embshard_optim.specs import OptimizerSpec
from embshard_types.shard_spec import ShardSpec


def _kernel(fill: float = 1.0, optimizer: str = "partial_rowwise_adam") -> FakeKernel:
    rule = rule_for(OptimizerSpec.from_name(optimizer))
    weights = [torch.full((5, 3), fill), torch.full((4, 2), fill)]
    states = [rule.init_state(*w.shape) for w in weights]
    for state in states:
        for tensor in state.values():
            tensor.fill_(fill)
    return FakeKernel(weights, states if states[0] else [])


TABLES = [TableShardInfo.whole("a", 5, 3), TableShardInfo.whole("b", 4, 2)]


def _optimizer(kernel: FakeKernel, **kwargs: object) -> EmbeddingFusedOptimizer:
    return EmbeddingFusedOptimizer(
        kernel, TABLES, learning_rate=0.1, state_format="tensor", **kwargs
    )


def test_state_is_the_kernels_own_tensors_by_table_and_name() -> None:
    kernel = _kernel()
    assert isinstance(kernel, FusedKernelLike)
    opt = _optimizer(kernel)
    assert sorted(opt.params) == ["a.weight", "b.weight"]
    weight = opt.params["a.weight"]
    assert weight is kernel.weights[0]
    assert sorted(opt.state[weight]) == ["a.momentum1", "a.momentum2"]
    assert opt.state[weight]["a.momentum2"] is kernel.states[0]["momentum2"]
    sd = opt.state_dict()
    assert sorted(sd["state"]) == ["a.weight", "b.weight"]
    assert sd["param_groups"] == [{"params": ["a.weight", "b.weight"], "lr": 0.1}]


def test_learning_rate_changes_reach_the_kernel() -> None:
    kernel = _kernel()
    opt = _optimizer(kernel)
    opt.param_groups[0]["lr"] = 0.3
    opt.zero_grad()
    assert kernel.learning_rates == [0.3]
    opt.param_groups[0]["lr"] = 0.2
    opt.step()
    assert kernel.learning_rates == [0.3, 0.2]
    opt.set_optimizer_step(7)
    assert kernel.optimizer_step == 7


def test_round_trip_with_a_dense_optimizer_writes_into_the_new_kernel() -> None:
    dense = torch.nn.Linear(2, 2)
    old = _kernel(fill=2.0)
    combined = CombinedOptimizer(
        [
            ("ebc", _optimizer(old)),
            (
                "dense",
                KeyedOptimizerWrapper.from_class(
                    dict(dense.named_parameters()), torch.optim.SGD, lr=0.1
                ),
            ),
        ]
    )
    combined.param_groups[0]["lr"] = 0.7
    saved = combined.state_dict()
    assert sorted(saved["state"]) == ["ebc.a.weight", "ebc.b.weight"]  # SGD keeps no state

    new = _kernel(fill=0.0)
    fresh_combined = CombinedOptimizer(
        [
            ("ebc", _optimizer(new)),
            (
                "dense",
                KeyedOptimizerWrapper.from_class(
                    dict(dense.named_parameters()), torch.optim.SGD, lr=0.1
                ),
            ),
        ]
    )
    fresh_combined.init_state()
    fresh_combined.load_state_dict(saved)
    for before, after in zip(old.states, new.states, strict=True):
        for key in before:
            assert torch.equal(before[key], after[key])
    assert new.learning_rates[-1] == 0.7


def test_misshaped_fused_state_is_refused_before_writing() -> None:
    opt = _optimizer(_kernel(fill=0.0))
    saved = _optimizer(_kernel(fill=3.0)).state_dict()
    saved["state"]["b.weight"]["b.momentum2"] = torch.ones(5)
    with pytest.raises(ValueError, match=r"\['b.momentum2'\]: shape \[5\] does not match \[4\]"):
        opt.load_state_dict(saved)
    assert all(float(t.sum()) == 0 for t in opt.state[opt.params["a.weight"]].values())


def test_stateless_optimizer_exposes_weights_only() -> None:
    kernel = _kernel(optimizer="sgd")
    assert kernel.states == []
    opt = _optimizer(kernel)
    assert opt.state[opt.params["a.weight"]] == {}
    assert opt.state_dict()["state"] == {}


def test_one_table_optimizer_is_named_by_its_prefix() -> None:
    kernel = _kernel()
    table_param = torch.nn.Parameter(torch.zeros(5, 3))
    one = _optimizer(kernel, create_for_table="a", param_weight_for_table=table_param)
    assert list(one.params) == [""]
    combined = CombinedOptimizer([("a", one)])
    assert list(combined.params) == ["a"]
    assert sorted(combined.state_dict()["state"]["a"]) == ["a.momentum1", "a.momentum2"]
    with pytest.raises(ValueError, match="go together"):
        _optimizer(kernel, create_for_table="a")
    with pytest.raises(ValueError, match=r"create_for_table='z' is not among .*\['a', 'b'\]"):
        _optimizer(kernel, create_for_table="z", param_weight_for_table=table_param)


def test_sharded_tables_need_a_distributed_format() -> None:
    kernel = _kernel()
    half = [ShardSpec.on(0, "cpu", (0, 0), (5, 3)), ShardSpec.on(1, "cpu", (5, 0), (5, 3))]
    sharded = TableShardInfo(
        name="a", num_embeddings=10, embedding_dim=3, local_shard=half[0], all_shards=tuple(half)
    )
    with pytest.raises(ValueError, match=r"StateFormat\.TENSOR is for unsharded tables"):
        EmbeddingFusedOptimizer(
            kernel, [sharded, TABLES[1]], learning_rate=0.1, state_format="tensor"
        )


@pytest.mark.parametrize(
    ("weights", "states", "tables", "match"),
    [
        ([torch.zeros(5, 3)], [], TABLES, r"holds 1 weights .* 2 table shards"),
        (
            [torch.zeros(5, 3), torch.zeros(4, 3)],
            [],
            TABLES,
            r"'b' \(kernel table 1\): .*\[4, 3\].*\[4, 2\]",
        ),
        (
            [torch.zeros(5, 3), torch.zeros(4, 2)],
            [{"sum": torch.zeros(5)}, {"sum": torch.zeros(4), "iter": torch.zeros(())}],
            TABLES,
            r"state 'iter' is \[\]; expected \[4\] \(row-wise\) or \[4, 2\]",
        ),
        (
            [torch.zeros(5, 3), torch.zeros(5, 3)],
            [],
            [TABLES[0], TABLES[0]],
            "is given twice",
        ),
    ],
)
def test_kernel_and_metadata_must_agree(weights, states, tables, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        EmbeddingFusedOptimizer(
            FakeKernel(weights, states), tables, learning_rate=0.1, state_format="tensor"
        )


def test_table_shard_info_validates() -> None:
    spec = ShardSpec.on(0, "cpu", (0, 0), (4, 2))
    with pytest.raises(ValueError, match="table 't' weight: shards cover 8 of the 16"):
        TableShardInfo(
            name="t", num_embeddings=4, embedding_dim=4, local_shard=spec, all_shards=(spec,)
        )
    other = ShardSpec.on(1, "cpu", (0, 2), (4, 2))
    with pytest.raises(ValueError, match="is not among the table's shards"):
        TableShardInfo(
            name="t",
            num_embeddings=4,
            embedding_dim=4,
            local_shard=ShardSpec.on(0, "cpu", (0, 0), (2, 2)),
            all_shards=(spec, other),
        )


def test_empty_fused_optimizer_and_module_protocol() -> None:
    empty = EmptyFusedOptimizer()
    empty.step()
    empty.zero_grad()
    empty.init_state()
    assert empty.state_dict() == {"state": {}, "param_groups": [{"params": []}]}

    class Module:
        @property
        def fused_optimizer(self) -> KeyedOptimizer:
            return empty

    assert isinstance(Module(), FusedOptimizerModule)
    assert not isinstance(object(), FusedOptimizerModule)
