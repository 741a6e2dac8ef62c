"""The partitioner: greedy, beam and exact searches, determinism, scale."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.cost_model import CostModel, load_tables
from embshard_dist.planner.enumerate import DefaultCapabilities, enumerate_options
from embshard_dist.planner.loads import LoadState, PartitionContext
from embshard_dist.planner.partition import greedy, improve, partition
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.search import _placements, beam_search, exact_search
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_optim.specs import OptimizerSpec, OptimType

SPEC = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)


def _context(
    tables: list[PlannerTable],
    world: int,
    *,
    pooling: dict[str, float] | None = None,
    types: tuple[str, ...] | None = None,
    usable: int = 1 << 40,
) -> PartitionContext:
    topo = Topology(world_size=world)
    model = CostModel(topo, SPEC)
    cons = {
        t.name: ParameterConstraints(
            pooling_factors=((pooling or {}).get(t.name, 4.0),), sharding_types=types
        )
        for t in tables
    }
    loaded = load_tables(tables, cons, 256)
    options = enumerate_options(loaded, [DefaultCapabilities()] * len(tables), model)
    return PartitionContext(options, model, usable)


def _brute_force(ctx: PartitionContext) -> float:
    """The smallest slowest-rank time over every option and placement of every table."""
    best = float("inf")

    def rec(i: int, st: LoadState) -> None:
        nonlocal best
        if i == len(ctx.options):
            best = min(best, st.max_s)
            return
        for opt in ctx.options[i]:
            for p in list(_placements(opt, st, ctx, symmetric=False)):
                st.apply(p, ctx)
                rec(i + 1, st)
                st.remove(p, ctx)

    rec(0, LoadState(ctx.n))
    return best


def test_exact_search_finds_the_brute_force_optimum() -> None:
    tables = [
        PlannerTable(f"t{i}", rows, 16) for i, rows in enumerate([50_000, 20_000, 8_000, 3_000])
    ]
    ctx = _context(
        tables,
        3,
        pooling={"t0": 30.0, "t1": 10.0, "t2": 5.0, "t3": 40.0},
        types=("table_wise", "row_wise", "data_parallel"),
    )
    optimum = _brute_force(ctx)
    found = exact_search(ctx, None, 1_000_000)
    assert found is not None and found.complete
    assert found.state.max_s == pytest.approx(optimum, rel=1e-9)
    first = greedy(ctx)
    assert first.state.max_s >= optimum - 1e-12
    result = partition(ctx, search="auto")
    assert result.optimal
    assert result.max_s == pytest.approx(optimum, rel=1e-9)


def test_searches_improve_on_greedy_and_keep_choices_consistent() -> None:
    rng = random.Random(3)
    tables = [
        PlannerTable(f"t{i}", rng.choice([1_000, 30_000, 200_000]), rng.choice([16, 64]))
        for i in range(30)
    ]
    ctx = _context(tables, 4, pooling={t.name: rng.uniform(1, 30) for t in tables})
    first = greedy(ctx)
    better = improve(ctx, first)
    beam = beam_search(ctx, 8)
    assert beam is not None
    assert better.state.max_s <= first.state.max_s + 1e-12
    for result in (first, better, beam):
        st = LoadState(ctx.n)
        for p in result.choices:
            st.apply(p, ctx)
        assert st.time == pytest.approx(result.state.time)
        assert st.mem == result.state.mem
        assert [p.option.table_index for p in result.choices] == list(range(len(tables)))


def test_memory_limits_are_respected_when_tight() -> None:
    # Four equal table-wise tables on 2 ranks with room for two each: two per rank.
    tables = [PlannerTable(f"t{i}", 16_000, 16) for i in range(4)]
    loose = _context(tables, 2, types=("table_wise",))
    opt = loose.options[0][0]
    base, unit = opt.base_storage[0], opt.units[0].storage[0]
    tight = _context(tables, 2, types=("table_wise",), usable=4 * base + 2 * unit + unit // 20)
    result = partition(tight)
    ranks = sorted(p.placement[0] for p in result.choices)
    assert ranks == [0, 0, 1, 1]


def _plan_json(tables: list[PlannerTable], constraints: dict[str, ParameterConstraints]) -> str:
    planner = EmbeddingShardingPlanner(
        Topology(world_size=4, local_world_size=2), constraints=constraints, batch_size=256
    )
    return planner.plan(tables, [DefaultCapabilities()]).to_json()


def test_planning_is_deterministic() -> None:
    rng = random.Random(7)
    tables = [
        PlannerTable(f"t{i}", rng.randint(10, 300_000), 4 * rng.randint(1, 32)) for i in range(40)
    ]
    cons = {t.name: ParameterConstraints(pooling_factors=(rng.uniform(1, 50),)) for t in tables}
    first = _plan_json(tables, cons)
    assert _plan_json(tables, cons) == first
    shuffled = dict(sorted(cons.items(), reverse=True))
    assert _plan_json(tables, shuffled) == first


def test_five_hundred_tables() -> None:
    """Plans 500 tables; the wall time is printed, asserted only by benchmarks/test_bench_planner."""
    rng = random.Random(0)
    tables = [
        PlannerTable(
            f"t{i}", rng.choice([1_000, 10_000, 100_000, 1_000_000]), rng.choice([16, 32, 64, 128])
        )
        for i in range(500)
    ]
    cons = {t.name: ParameterConstraints(pooling_factors=(rng.uniform(1, 40),)) for t in tables}
    topo = Topology(world_size=8, local_world_size=4, memory_per_rank=8 << 30)
    planner = EmbeddingShardingPlanner(topo, constraints=cons)
    start = time.perf_counter()
    result = planner.propose(tables, [DefaultCapabilities()])
    elapsed = time.perf_counter() - start
    print(f"500 tables on 8 ranks planned in {elapsed:.2f} s ({result.method})")
    assert len(result.estimate.tables) == 500
    assert all(r.storage <= r.usable for r in result.estimate.ranks)
    assert result.estimate.imbalance < 1.05


def test_exact_search_budget_stops_cleanly() -> None:
    tables = [PlannerTable(f"t{i}", 10_000 * (i + 1), 32) for i in range(6)]
    ctx = _context(tables, 4)
    incumbent = improve(ctx, greedy(ctx))
    stopped = exact_search(ctx, incumbent, 50)
    assert stopped is not None and not stopped.complete
    assert stopped.state.max_s <= incumbent.state.max_s + 1e-12


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_table_gets_a_choice(world: int) -> None:
    tables = [
        PlannerTable(f"t{i}", r, d)
        for i, (r, d) in enumerate(itertools.product([7, 5000], [6, 64]))
    ]
    ctx = _context(tables, world)
    result = partition(ctx)
    assert [p.option.table_index for p in result.choices] == list(range(len(tables)))
