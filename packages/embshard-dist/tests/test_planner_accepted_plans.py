"""The planner emits only plans the sharders accept: every plan it returns passes
``EmbeddingBagCollectionSharder.check_plan`` (the check DMP runs), or it refuses with a clear error.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.enumerate import SHARDING_TYPE_ORDER
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.stats import PlannerError
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.env import ShardingEnv
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType

Problem = tuple[Topology, list[PlannerTable], dict[str, ParameterConstraints], str]


def _check(plan: ShardingPlan, tables: list[PlannerTable], topo: Topology) -> None:
    """Run the sharders' own plan check on ``plan`` for an EBC holding ``tables``."""
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=t.features
            )
            for t in tables
        ],
        device="meta",
    )
    module_plan = plan[""]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    sharder = EmbeddingBagCollectionSharder(local_world_size=topo.ranks_per_node)
    env = ShardingEnv.from_local(topo.world_size, 0)
    sharder.check_plan(ebc, module_plan, env, topo.compute_device)


@st.composite
def _problems(draw: st.DrawFn) -> Problem:
    world = draw(st.integers(1, 4))
    local = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    topo = Topology(world_size=world, local_world_size=local, memory_per_rank=1 << 30)
    tables, constraints = [], {}
    for i in range(draw(st.integers(1, 4))):
        name = f"t{i}"
        rows = draw(st.sampled_from([1, 3, 64, 1_000, 50_000]))
        dim = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 32, 64]))
        tables.append(PlannerTable(name, rows, dim, features=(f"f{i}",)))
        kinds = draw(
            st.one_of(
                st.none(),
                st.lists(st.sampled_from(SHARDING_TYPE_ORDER), min_size=1, max_size=2, unique=True),
            )
        )
        fused, dense = ComputeKernel.FUSED, ComputeKernel.DENSE
        kernels = draw(st.sampled_from([None, None, (fused,), (dense,), (fused, dense)]))
        ranks = draw(
            st.one_of(
                st.none(), st.lists(st.integers(0, world - 1), min_size=1, max_size=3, unique=True)
            )
        )
        constraints[name] = ParameterConstraints(
            sharding_types=tuple(kinds) if kinds else None,
            compute_kernels=kernels,
            pooling_factors=(draw(st.sampled_from([1.0, 8.0, 40.0])),),
            ranks=tuple(ranks) if ranks else None,
        )
    return topo, tables, constraints, draw(st.sampled_from(["greedy", "beam", "auto"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_every_plan_passes_the_sharders_check(problem: Problem) -> None:
    topo, tables, constraints, search = problem
    planner = EmbeddingShardingPlanner(topo, constraints=constraints, batch_size=64, search=search)  # type: ignore[arg-type]
    try:
        result = planner.propose(tables)
    except PlannerError as e:
        event("refused: does not fit")
        assert str(e).startswith(("no sharding plan fits", "no memory is left")), e
        return
    except ValueError as e:
        event("refused: no option")
        message = str(e)
        assert "has no sharding option" in message and "Relax the table's constraints" in message
        assert any(f"table {t.name!r}" in message for t in tables), message
        return
    event("planned")
    _check(result.plan, tables, topo)
    for t in tables:
        kinds = constraints[t.name].sharding_types
        if kinds:
            assert result.plan[""][t.name].sharding_type in kinds  # type: ignore[index]


def _pinned(kinds: list[ShardingType], dim: int = 16) -> tuple[list[PlannerTable], dict[str, ParameterConstraints]]:  # fmt: skip
    tables = [PlannerTable(f"t{i}", 10_000, dim, features=(f"f{i}",)) for i in range(len(kinds))]
    constraints = {
        f"t{i}": ParameterConstraints(sharding_types=(k,), pooling_factors=(5.5,), zipf_exponent=1.05)
        for i, k in enumerate(kinds)
    }  # fmt: skip
    return tables, constraints


@pytest.mark.parametrize(
    ("world", "kinds"),
    [
        # The pins of `embshard train --sharding t0=table_wise,t1=row_wise,t2=column_wise,
        # t3=data_parallel` on 2 ranks, and on 3 ranks with two tables table-wise.
        (2, ["table_wise", "row_wise", "column_wise", "data_parallel"]),
        (3, ["table_wise", "table_wise", "column_wise", "data_parallel"]),
    ],
)
@pytest.mark.parametrize("search", ["greedy", "beam", "exact"])
def test_column_blocks_of_a_table_go_to_distinct_ranks(
    world: int, kinds: list[str], search: str
) -> None:
    tables, constraints = _pinned([ShardingType.parse(k) for k in kinds])
    topo = Topology(world_size=world, memory_per_rank=1 << 30)
    planner = EmbeddingShardingPlanner(topo, constraints=constraints, batch_size=256, search=search)  # type: ignore[arg-type]
    plan = planner.propose(tables).plan
    _check(plan, tables, topo)
    column = plan[""]["t2"]  # type: ignore[index]
    ranks = [spec.rank for spec in column.shards]
    assert len(ranks) >= 2 and len(set(ranks)) == len(ranks)


def test_column_wise_on_one_allowed_rank_is_one_block() -> None:
    tables = [PlannerTable("t", 1_000, 32)]
    constraints = {
        "t": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,), ranks=(2,))
    }
    topo = Topology(world_size=4, memory_per_rank=1 << 30)
    plan = EmbeddingShardingPlanner(topo, constraints=constraints).propose(tables).plan
    _check(plan, tables, topo)
    assert [spec.rank for spec in plan[""]["t"].shards] == [2]  # type: ignore[index]


def test_grid_column_blocks_go_to_distinct_nodes() -> None:
    tables = [PlannerTable("t", 1_000, 32)]
    constraints = {
        "t": ParameterConstraints(sharding_types=(ShardingType.GRID_SHARD,), ranks=(0, 1, 2, 3))
    }
    topo = Topology(world_size=6, local_world_size=2, memory_per_rank=1 << 30)
    plan = EmbeddingShardingPlanner(topo, constraints=constraints).propose(tables).plan
    _check(plan, tables, topo)
    shards = plan[""]["t"].shards  # type: ignore[index]
    nodes_per_block: dict[int, set[int]] = {}
    for spec in shards:
        nodes_per_block.setdefault(spec.offsets[1], set()).add(spec.rank // 2)
    assert len(nodes_per_block) == 2  # two column blocks, one per allowed node
    assert sorted(n for ns in nodes_per_block.values() for n in ns) == [0, 1]


@pytest.mark.parametrize("kind", ["column_wise", "table_column_wise", "grid_shard"])
def test_a_dim_that_cannot_be_cut_is_refused_naming_the_table(kind: str) -> None:
    tables = [PlannerTable("wide", 100, 16), PlannerTable("odd", 100, 10, path="ebc")]
    constraints = {"ebc.odd": ParameterConstraints(sharding_types=(ShardingType.parse(kind),))}
    planner = EmbeddingShardingPlanner(world_size=2, constraints=constraints)
    with pytest.raises(ValueError, match="module 'ebc': table 'odd' has no sharding option") as e:
        planner.propose(tables)
    assert f"{kind} cannot cut dim 10 into column blocks" in str(e.value)


def test_a_width_no_fused_kernel_takes_gets_the_dense_kernel_or_is_refused() -> None:
    tables = [PlannerTable("t", 100, 6)]
    topo = Topology(world_size=2, memory_per_rank=1 << 30)
    plan = EmbeddingShardingPlanner(topo).propose(tables).plan
    _check(plan, tables, topo)
    assert plan[""]["t"].compute_kernel is ComputeKernel.DENSE  # type: ignore[index]
    for constraints in (
        ParameterConstraints(compute_kernels=(ComputeKernel.FUSED,)),
        ParameterConstraints(sharding_types=(ShardingType.DATA_PARALLEL,)),
    ):
        planner = EmbeddingShardingPlanner(topo, constraints={"t": constraints})
        with pytest.raises(ValueError, match="table 't' has no sharding option") as e:
            planner.propose(tables)
        assert "fused kernel needs shards whose width is a multiple of 4" in str(e.value)
        assert "dim is 6" in str(e.value)
