"""The ``planned`` row: each library on the plan its own planner picks.

embshard's plan is what ``DistributedModelParallel`` plans without a plan
(``EmbeddingShardingPlanner`` on ``runtime_topology``: the reference topology with this host's
memory); TorchRec's is what TorchRec 1.8.0's ``EmbeddingShardingPlanner`` picks on a CPU
topology. Both see the same tables, pooling factor, batch size and optimizer
(:mod:`benchmarks.plan_quality.tables`). The plans are made once, in the driver, and handed to
every rank; each library then gets its own plan as a neutral :data:`Plan`, which its side
translates and checks shard for shard as for any other row. The forward check still holds:
pooled outputs do not depend on the plan.

Guarantees: a plan's shards are kept as the planner placed them (offsets, sizes, ranks).
"""

from __future__ import annotations

from typing import Any

from benchmarks.compare.plans import Plan, Shard, TablePlan
from benchmarks.compare.workloads import Workload

PLANNED = "planned"


def to_neutral(plan: Any) -> Plan:
    """An embshard ``ShardingPlan`` of one module as the harness's neutral plan."""
    (module_plan,) = plan.values()
    out: Plan = {}
    for name, ps in module_plan.items():
        kind = ps.sharding_type.value
        ranks = tuple(ps.ranks or ())
        if kind == "data_parallel":
            out[name] = TablePlan(kind, ranks, None)
            continue
        shards = tuple(
            Shard(s.rank, s.offsets[0], s.offsets[1], s.sizes[0], s.sizes[1]) for s in ps.shards
        )
        out[name] = TablePlan(kind, ranks, shards)
    return out


def planned_plans(
    workload: Workload, world_size: int, local_size: int, contenders: tuple[str, ...]
) -> dict[str, Plan]:
    """Contender -> the plan its own planner picks for ``workload``."""
    from benchmarks.plan_quality.plans import embshard_planner_plan, torchrec_planner_plan

    out: dict[str, Plan] = {}
    if "embshard" in contenders:
        from embshard_dist.planner.auto import runtime_topology

        topology = runtime_topology(world_size, "cpu", local_world_size=local_size)
        out["embshard"] = to_neutral(embshard_planner_plan(workload, topology)[0])
    if "torchrec" in contenders:
        out["torchrec"] = to_neutral(torchrec_planner_plan(workload, world_size))
    return out
