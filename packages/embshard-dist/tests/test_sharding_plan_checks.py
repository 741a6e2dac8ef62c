"""EmbeddingBagCollectionSharder.check_plan: every bad plan is a clear error naming the table.

Single process (no process group: checking a plan needs none). The multi-process test that
every rank raises the same error before any collective is in
``tests/test_sharded_ebc_state.py``.
"""

from __future__ import annotations

import pytest

from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ComputeKernel, ShardingType

TABLES = [
    EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=8, feature_names=("f1",)),
    EmbeddingBagConfig(name="t2", num_embeddings=6, embedding_dim=12, feature_names=("f2",)),
]
WORLD = 2


@pytest.fixture(scope="module")
def module() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(TABLES, device="meta", optimizer=OptimizerSpec.from_name("sgd"))


def _ps(kind: str, kernel: str = "fused", **kw: object) -> ParameterSharding:
    return ParameterSharding(kind, kernel, **kw)  # type: ignore[arg-type]


def _cw(widths: list[int], ranks: list[int], rows: int, device: str = "cpu") -> ParameterSharding:
    specs, at = [], 0
    for width, rank in zip(widths, ranks, strict=True):
        specs.append(ShardSpec.on(rank, device, (0, at), (rows, width)))
        at += width
    return ParameterSharding("column_wise", "fused", ranks=ranks, shards=specs)


GOOD = {"t1": _ps("table_wise", ranks=[1]), "t2": _ps("row_wise")}


def _check(module: EmbeddingBagCollection, tables: dict, device: str = "cpu") -> None:
    plan = EmbeddingModuleShardingPlan(tables)
    EmbeddingBagCollectionSharder().check_plan(
        module, plan, ShardingEnv.from_local(WORLD, 0), device, path="model.ebc"
    )


def test_a_good_plan_passes(module: EmbeddingBagCollection) -> None:
    _check(module, GOOD)
    _check(module, {"t1": _ps("data_parallel"), "t2": _cw([4, 8], [1, 0], 6)})


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        ({**GOOD, "ghost": _ps("row_wise")}, r"'model.ebc'.*table 'ghost'.*does not have"),
        ({"t1": GOOD["t1"]}, r"table 't2' has no entry in the plan"),
        (
            {**GOOD, "t1": _ps("table_wise", ranks=[5])},
            r"rank 5 is outside the world of size 2.*t1",
        ),
        ({**GOOD, "t1": _ps("data_parallel", "dense")}, r"t1.*'dense' is not supported for data"),
        ({**GOOD, "t1": _ps("table_wise", "fused_uvm", ranks=[0])}, r"t1.*'fused_uvm'.*on cpu"),
        ({**GOOD, "t1": _ps("table_wise")}, r"t1.*needs ranks"),
        ({**GOOD, "t1": _ps("data_parallel", ranks=[0])}, r"t1.*replicated on every rank"),
        ({**GOOD, "t2": _ps("row_wise", ranks=[1, 0])}, r"t2.*block r on rank r"),
        ({**GOOD, "t2": _ps("row_wise", ranks=[0])}, r"t2.*one row block per rank"),
        ({**GOOD, "t2": _cw([4, 4], [0, 1], 6)}, r"t2.*cover 48 of the 72 elements"),
        ({**GOOD, "t2": _cw([4, 12], [0, 1], 6)}, r"t2.*lies outside the tensor"),
        (
            {**GOOD, "t2": _cw([6, 6], [0, 1], 6)},
            r"t2.*widths \[6, 6\] must each be a multiple of 4",
        ),
        ({**GOOD, "t2": _cw([4, 8], [1, 1], 6)}, r"t2.*rank 1 holds several column blocks"),
        ({**GOOD, "t2": _cw([4, 8], [0, 1], 6, "cuda")}, r"t2.*placed on 'rank:0/cuda:0'.*on cpu"),
    ],
)
def test_bad_plans_name_the_table(module: EmbeddingBagCollection, tables: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _check(module, tables)


def test_fused_kernels_need_widths_in_multiples_of_four() -> None:
    odd = [EmbeddingBagConfig(name="t6", num_embeddings=4, embedding_dim=6)]
    module = EmbeddingBagCollection(odd, device="meta")
    with pytest.raises(ValueError, match=r"t6.*multiples of 4.*6 columns.*'dense'"):
        _check(module, {"t6": _ps("table_wise", ranks=[0])})
    _check(module, {"t6": _ps("table_wise", "dense", ranks=[0])})


def test_plan_must_be_an_embedding_plan(module: EmbeddingBagCollection) -> None:
    with pytest.raises(TypeError, match="EmbeddingModuleShardingPlan"):
        EmbeddingBagCollectionSharder().check_plan(
            module, GOOD, ShardingEnv.from_local(WORLD, 0), "cpu"
        )


def test_sharder_vocabulary_is_honest_per_device(module: EmbeddingBagCollection) -> None:
    sharder = EmbeddingBagCollectionSharder()
    assert set(sharder.sharding_types("cpu")) == set(ShardingType)
    assert sharder.compute_kernels("data_parallel", "cpu") == [ComputeKernel.FUSED]
    assert sharder.compute_kernels(ShardingType.ROW_WISE, "cpu") == [
        ComputeKernel.FUSED,
        ComputeKernel.DENSE,
    ]
    assert ComputeKernel.FUSED_UVM_CACHING in sharder.compute_kernels("table_wise", "cuda")
    with pytest.raises(ValueError, match="unknown compute device type 'tpu'"):
        sharder.sharding_types("tpu")
    assert sharder.module_type is EmbeddingBagCollection
    assert sorted(sharder.shardable_parameters(module)) == ["t1", "t2"]


def test_sharder_refuses_foreign_options() -> None:
    with pytest.raises(TypeError, match="OptimizerSpec"):
        EmbeddingBagCollectionSharder(optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FusedParams"):
        EmbeddingBagCollectionSharder(fused_params={"optimizer": "sgd"})  # type: ignore[arg-type]
