"""SimplePlanner's rule-based plan: greedy byte balancing, requested types, shard specs, errors, determinism."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from embshard_dist.models.demo import DemoDLRM as DLRM
from embshard_dist.planner.requests import parse_sharding_request
from embshard_dist.planner.simple import SimplePlanner, shard_bytes
from embshard_dist.sharded.shardable import TableShape, find_shardable_modules
from embshard_dist.strategies.layout import shard_specs
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_optim.specs import OptimizerSpec
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.interfaces import ModuleSharder, ShardedModule
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType


class PlanningSharder(ModuleSharder[EmbeddingBagCollection]):
    """What the planner asks of a sharder (the types it supports); it shards nothing."""

    def __init__(self, types: list[ShardingType] | None = None) -> None:
        super().__init__()
        self._types = list(ShardingType) if types is None else types

    def shard(self, *args: Any, **kwargs: Any) -> ShardedModule[Any, Any, Any, Any]:
        raise AssertionError("the planner must not shard")

    @property
    def module_type(self) -> type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
        return self._types

    def compute_kernels(
        self, sharding_type: ShardingType | str, compute_device_type: str
    ) -> list[ComputeKernel]:
        if ShardingType.parse(sharding_type) is ShardingType.DATA_PARALLEL:
            return [ComputeKernel.DENSE]
        return [ComputeKernel.FUSED, ComputeKernel.DENSE]


SHARDERS: list[ModuleSharder[Any]] = [PlanningSharder()]


def _ebc(shapes: list[tuple[int, int]], device: str = "meta") -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim)
        for i, (rows, dim) in enumerate(shapes)
    ]
    return EmbeddingBagCollection(tables, device=device)


class Model(nn.Module):
    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.sparse = _ebc(shapes)


def _tables(plan: ShardingPlan, path: str = "sparse") -> EmbeddingModuleShardingPlan:
    module_plan = plan[path]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    return module_plan


def test_table_wise_greedy_largest_first_onto_least_loaded_rank() -> None:
    model = Model([(100, 8), (90, 8), (50, 8), (40, 8)])
    plan = SimplePlanner(2).plan(model, SHARDERS)
    tables = _tables(plan)
    assert {t: ps.sharding_type for t, ps in tables.items()} == dict.fromkeys(
        ["t0", "t1", "t2", "t3"], ShardingType.TABLE_WISE
    )
    # 100 -> r0, 90 -> r1, 50 -> r1 (90 < 100), 40 -> r0 (100 < 140)
    assert {t: ps.ranks for t, ps in tables.items()} == {
        "t0": (0,),
        "t1": (1,),
        "t2": (1,),
        "t3": (0,),
    }
    assert tables["t2"].shards == tuple(shard_specs("table_wise", 50, 8, [1]) or ())
    assert all(ps.compute_kernel is ComputeKernel.FUSED for ps in tables.values())
    assert list(tables) == ["t0", "t1", "t2", "t3"]  # the module's own table order


def test_optimizer_state_counts_towards_the_bytes() -> None:
    # weights only: t1 (100 x 96 = 9600) > t0 (2000 x 4 = 8000); with RowWiseAdagrad's one
    # state value per row: t0 (8000 + 2000) > t1 (9600 + 100). The first placed goes to rank 0.
    model = Model([(2000, 4), (100, 96)])
    plain = _tables(SimplePlanner(2).plan(model, SHARDERS))
    adagrad = OptimizerSpec.from_name("rowwise_adagrad")
    with_state = _tables(SimplePlanner(2, optimizer=adagrad).plan(model, SHARDERS))
    assert (plain["t1"].ranks, plain["t0"].ranks) == ((0,), (1,))
    assert (with_state["t0"].ranks, with_state["t1"].ranks) == ((0,), (1,))
    shape = TableShape("t", 10, 8)
    assert shard_bytes(shape, 10, 8, None) == 10 * 8 * 4
    assert shard_bytes(shape, 10, 8, adagrad) == 10 * 8 * 4 + 10 * 4
    assert shard_bytes(shape, 10, 8, OptimizerSpec.from_name("adam")) == 3 * 10 * 8 * 4


def test_requested_types_per_table_get_layout_specs() -> None:
    model = Model([(10, 16), (11, 16), (12, 16), (13, 16), (14, 16)])
    request = {"t0": "row_wise", "t1": "column_wise", "t2": "data_parallel", "sparse.t3": "tw"}
    tables = _tables(SimplePlanner(2, sharding=request).plan(model, SHARDERS))
    kinds = {t: ps.sharding_type.value for t, ps in tables.items()}
    assert kinds == {
        "t0": "row_wise",
        "t1": "column_wise",
        "t2": "data_parallel",
        "t3": "table_wise",
        "t4": "table_wise",
    }
    assert tables["t0"].ranks == (0, 1)
    assert tables["t0"].shards == tuple(shard_specs("row_wise", 10, 16, [0, 1]) or ())
    assert sorted(tables["t1"].ranks or ()) == [0, 1]  # column blocks on distinct ranks
    assert tables["t1"].shards == tuple(
        shard_specs("column_wise", 11, 16, list(tables["t1"].ranks or ())) or ()
    )
    assert tables["t2"].shards is None and tables["t2"].ranks == (0, 1)
    assert tables["t2"].compute_kernel is ComputeKernel.DENSE  # the sharder's only DP kernel
    # one type for every table
    everything = _tables(SimplePlanner(2, sharding="row_wise").plan(model, SHARDERS))
    assert {ps.sharding_type for ps in everything.values()} == {ShardingType.ROW_WISE}


def test_node_aware_types_use_the_least_loaded_node() -> None:
    model = Model([(64, 16), (32, 16), (16, 8)])
    request = {"t0": "table_row_wise", "t1": "table_column_wise", "t2": "grid_shard"}
    planner = SimplePlanner(4, sharding=request, local_world_size=2)
    tables = _tables(planner.plan(model, SHARDERS))
    assert tables["t0"].ranks == (0, 1)  # node 0, row blocks in rank order
    assert sorted(tables["t1"].ranks or ()) == [2, 3]  # node 1 was empty
    grid = tables["t2"]
    assert grid.shards is not None and len(grid.shards) == 4  # 2 column blocks x 2 ranks
    assert grid.shards == tuple(
        shard_specs("grid_shard", 16, 8, list(grid.ranks or ()), local_world_size=2) or ()
    )
    with pytest.raises(ValueError, match="does not divide world_size"):
        SimplePlanner(4, local_world_size=3)


def test_auto_rule() -> None:
    # t0: 4 KiB (small -> data-parallel); t1: 4 MiB, more than half of everything (row-wise);
    # t2, t3: 1.6 MiB each (table-wise).
    model = Model([(64, 16), (65536, 16), (25_000, 16), (25_000, 16)])
    tables = _tables(SimplePlanner(2, sharding="auto").plan(model, SHARDERS))
    kinds = {t: ps.sharding_type.value for t, ps in tables.items()}
    assert kinds == {
        "t0": "data_parallel",
        "t1": "row_wise",
        "t2": "table_wise",
        "t3": "table_wise",
    }
    assert {tables["t2"].ranks, tables["t3"].ranks} == {(0,), (1,)}
    # "auto" picks only types the sharder supports
    tw_only = [PlanningSharder([ShardingType.TABLE_WISE])]
    tables = _tables(SimplePlanner(2, sharding="auto").plan(model, tw_only))
    assert {ps.sharding_type for ps in tables.values()} == {ShardingType.TABLE_WISE}
    # on one rank everything is table-wise
    tables = _tables(SimplePlanner(1, sharding={"t0": "auto"}).plan(model, SHARDERS))
    assert tables["t0"].sharding_type is ShardingType.TABLE_WISE


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        ({"t9": "row_wise"}, ValueError, r"tables \['t9'\] that the model does not have"),
        ({"t0": "sideways"}, ValueError, r"unknown ShardingType 'sideways' for table 't0'"),
        ("sideways", ValueError, "unknown ShardingType 'sideways'"),
        ({"": "row_wise"}, ValueError, "keys must be table names"),
        (3, TypeError, "sharding must be a type name"),
    ],
)
def test_bad_requests(request_: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        SimplePlanner(2, sharding=request_).plan(Model([(8, 8)]), SHARDERS)


def test_unsupported_type_names_the_table() -> None:
    sharders: list[ModuleSharder[Any]] = [PlanningSharder([ShardingType.TABLE_WISE])]
    with pytest.raises(ValueError, match=r"table 't0' of module 'sparse'.*'row_wise' is not"):
        SimplePlanner(2, sharding="row_wise").plan(Model([(8, 8)]), sharders)


def test_dlrm_meta_and_materialised_give_one_plan_that_round_trips() -> None:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=100 * (i + 1), embedding_dim=8)
        for i in range(3)
    ]
    planner = SimplePlanner(2, sharding={"t2": "row_wise"})
    meta = planner.plan(DLRM(tables, device="meta"), SHARDERS)
    real = planner.plan(DLRM(tables), SHARDERS)
    assert meta == real and list(meta) == ["sparse_arch"]
    assert ShardingPlan.from_json(meta.to_json()) == meta
    text = str(meta)
    assert "module: sparse_arch" in text and "row_wise" in text and "t2" in text


def test_finds_modules_by_exact_type_and_skips_nested() -> None:
    class Sub(EmbeddingBagCollection):
        pass

    outer = nn.Module()
    outer.a = _ebc([(8, 8)])
    outer.b = nn.Sequential(_ebc([(8, 8)]))
    outer.c = Sub([EmbeddingBagConfig(name="x", num_embeddings=8, embedding_dim=8)], device="meta")
    assert list(find_shardable_modules(outer, SHARDERS)) == ["a", "b.0"]
    assert list(find_shardable_modules(_ebc([(8, 8)]), SHARDERS)) == [""]


def test_parse_sharding_request() -> None:
    assert parse_sharding_request("row_wise") == "row_wise"
    assert parse_sharding_request(" auto ") == "auto"
    assert parse_sharding_request("t0=row_wise, t1 = table_wise") == {
        "t0": "row_wise",
        "t1": "table_wise",
    }
    for bad, message in [("", "empty"), ("t0=", "TABLE=TYPE"), ("t0=rw,t0=tw", "twice")]:
        with pytest.raises(ValueError, match=message):
            parse_sharding_request(bad)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
    world=st.integers(1, 5),
)
def test_greedy_balance_bound_and_determinism(rows: list[int], world: int) -> None:
    """Largest-first greedy: the spread of rank loads is at most the largest table."""
    model = Model([(r, 8) for r in rows])
    planner = SimplePlanner(world)
    plan = planner.plan(model, SHARDERS)
    assert plan == planner.plan(model, SHARDERS)
    loads = [0] * world
    for table, ps in _tables(plan).items():
        assert ps.ranks is not None and len(ps.ranks) == 1
        loads[ps.ranks[0]] += rows[int(table[1:])] * 8 * 4
    assert max(loads) - min(loads) <= max(rows) * 8 * 4


def test_plan_uses_the_device_in_placements() -> None:
    plan = SimplePlanner(2, device_type="cuda").plan(Model([(8, 8), (8, 8)]), SHARDERS)
    placements = {s.placement for ps in _tables(plan).values() for s in ps.shards or ()}
    assert placements == {"rank:0/cuda:0", "rank:1/cuda:1"}


def test_plans_pass_the_real_sharders_checks() -> None:
    from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
    from embshard_types.env import ShardingEnv

    sharder = EmbeddingBagCollectionSharder()
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=16)
        for i, rows in enumerate([64, 65536, 25_000, 25_000])
    ]
    model = DLRM(tables, device="meta")
    requests = (None, "auto", "row_wise", "column_wise", "data_parallel")
    node_aware = ("table_row_wise", "table_column_wise", "grid_shard")
    for request in requests + node_aware:
        plan = SimplePlanner(2, sharding=request).plan(model, [sharder])
        sharder.check_plan(
            model.sparse_arch, plan["sparse_arch"], ShardingEnv.from_local(2, 0), "cpu"
        )
