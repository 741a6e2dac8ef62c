"""Planner benchmark (``nox -s bench``): 500 tables planned, and the issue's 10-second bound.

BENCHMARK, not a unit test: the wall-time assertion below is the issue's requirement ("the
planner handles 500 tables in under 10 seconds on this machine") and runs only in the bench
session. The tables are drawn with a fixed seed: rows from 1,000 to 1,000,000, widths 16 to 128,
pooling factors 1 to 40, on 8 ranks in 2 nodes of 4 with 8 GiB each, every sharding type allowed.
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("pytest_benchmark", reason="benchmarks need pytest-benchmark (nox -s bench)")

from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.enumerate import DefaultCapabilities
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology

TABLES = 500
LIMIT_S = 10.0


def _problem() -> tuple[list[PlannerTable], dict[str, ParameterConstraints]]:
    rng = random.Random(0)
    tables = [
        PlannerTable(
            f"t{i}", rng.choice([1_000, 10_000, 100_000, 1_000_000]), rng.choice([16, 32, 64, 128])
        )
        for i in range(TABLES)
    ]
    cons = {t.name: ParameterConstraints(pooling_factors=(rng.uniform(1, 40),)) for t in tables}
    return tables, cons


@pytest.mark.parametrize("search", ["greedy", "auto"])
def test_plan_500_tables(benchmark, search: str) -> None:  # type: ignore[no-untyped-def]
    tables, cons = _problem()
    topo = Topology(world_size=8, local_world_size=4, memory_per_rank=8 << 30)
    planner = EmbeddingShardingPlanner(topo, constraints=cons, search=search)  # type: ignore[arg-type]

    def plan() -> float:
        start = time.perf_counter()
        planner.plan(tables, [DefaultCapabilities()])
        return time.perf_counter() - start

    elapsed = benchmark.pedantic(plan, rounds=3, warmup_rounds=1, iterations=1)
    # The bound, asserted here in the benchmark only (never in a unit test).
    assert elapsed < LIMIT_S, f"planning {TABLES} tables took {elapsed:.1f} s (limit {LIMIT_S} s)"
