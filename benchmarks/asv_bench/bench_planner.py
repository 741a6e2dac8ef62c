"""asv: the sharding planner on 500 tables, 8 ranks in 2 nodes of 4 with 8 GiB each.

The tables are drawn with a fixed seed (rows 1,000 to 1,000,000, widths 16 to 128, pooling
factors 1 to 40), every sharding type allowed: the same problem as the ``nox -s bench``
planner benchmark, timed here per commit for each search strategy.
"""

from __future__ import annotations

import random
from typing import Any

TABLES = 500


class PlannerTime:
    params = ["greedy", "auto"]
    param_names = ["search"]
    timeout = 600
    number = 1
    repeat = (1, 3, 120.0)

    def setup(self, search: str) -> None:
        from embshard_dist.planner.constraints import ParameterConstraints
        from embshard_dist.planner.enumerate import DefaultCapabilities
        from embshard_dist.planner.planner import EmbeddingShardingPlanner
        from embshard_dist.planner.tables import PlannerTable
        from embshard_dist.planner.topology import Topology

        rng = random.Random(0)
        self.tables = [
            PlannerTable(
                f"t{i}",
                rng.choice([1_000, 10_000, 100_000, 1_000_000]),
                rng.choice([16, 32, 64, 128]),
            )
            for i in range(TABLES)
        ]
        cons = {
            t.name: ParameterConstraints(pooling_factors=(rng.uniform(1, 40),)) for t in self.tables
        }
        topo = Topology(world_size=8, local_world_size=4, memory_per_rank=8 << 30)
        planner_search: Any = search
        self.planner = EmbeddingShardingPlanner(topo, constraints=cons, search=planner_search)
        self.capabilities = [DefaultCapabilities()]

    def time_plan_500_tables(self, search: str) -> None:
        self.planner.plan(self.tables, self.capabilities)
