"""The plans compared, all as embshard ``ShardingPlan``s of module ``ebc``.

* single sharding types: the side-by-side harness's library-neutral plans
  (``benchmarks.compare.plans.make_plan``: the same layouts TorchRec is timed with), translated
  shard for shard;
* ``embshard-planner``: ``EmbeddingShardingPlanner`` on the workload's tables, pooling factors
  and batch size, for a given topology;
* ``torchrec-planner``: TorchRec 1.8.0's ``EmbeddingShardingPlanner`` on the same tables,
  pooling factors and batch size, for ``Topology(world_size, compute_device="cpu")``, with the
  harness's sharder (RowWiseAdagrad fused in backward); its plan is translated shard for shard
  (its data-parallel tables get embshard's ``fused`` kernel: embshard updates data-parallel
  tables in the backward, which is the work TorchRec's dense optimizer does in the harness).

Guarantees: every translation keeps each shard's offsets, sizes and rank; ``describe`` gives the
number of tables per sharding type for the report.
"""

from __future__ import annotations

from typing import Any

from benchmarks.compare.plans import Plan, make_plan
from benchmarks.compare.workloads import Workload
from benchmarks.plan_quality.tables import (
    MODULE,
    optimizer_spec,
    planner_constraints,
    planner_tables,
    pooling_factor,
)

EMBSHARD_PLANNER = "embshard-planner"
TORCHREC_PLANNER = "torchrec-planner"


def _wrap(tables: dict[str, Any]) -> Any:
    from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

    return ShardingPlan({MODULE: EmbeddingModuleShardingPlan(tables)})


def from_neutral(plan: Plan, world_size: int) -> Any:
    """A library-neutral plan as an embshard ``ShardingPlan`` (shards kept as they are)."""
    from embshard_types.parameter_sharding import ParameterSharding
    from embshard_types.shard_spec import ShardSpec
    from embshard_types.vocab import ComputeKernel, ShardingType

    out = {}
    for name, tp in plan.items():
        kind = ShardingType.parse(tp.sharding_type)
        if tp.shards is None:
            out[name] = ParameterSharding(kind, ComputeKernel.FUSED, tuple(range(world_size)))
            continue
        specs = tuple(
            ShardSpec((s.row_offset, s.col_offset), (s.rows, s.cols), f"rank:{s.rank}/cpu")
            for s in tp.shards
        )
        ranks = tuple(s.rank for s in tp.shards)
        out[name] = ParameterSharding(kind, ComputeKernel.FUSED, ranks, specs)
    return _wrap(out)


def single_type_plan(kind: str, workload: Workload, world_size: int) -> Any:
    """Sharding type ``kind`` applied to every table (the harness's layout)."""
    return from_neutral(make_plan(kind, workload, world_size), world_size)


def embshard_planner_plan(workload: Workload, topology: Any) -> tuple[Any, Any]:
    """embshard's planner's plan for ``workload`` on ``topology``, with its ``PlannerResult``."""
    from embshard_dist.planner.planner import EmbeddingShardingPlanner

    planner = EmbeddingShardingPlanner(
        topology,
        constraints=planner_constraints(workload),
        batch_size=workload.batch_per_rank,
        optimizer=optimizer_spec(),
    )
    result = planner.propose(planner_tables(workload))
    return result.plan, result


def torchrec_available() -> str | None:
    """``None`` when TorchRec imports here, else why not."""
    try:
        import torchrec  # noqa: F401
    except Exception as e:  # ImportError, or FBGEMM's own import errors
        return f"TorchRec is not importable here ({type(e).__name__}: {e})"
    return None


def torchrec_planner_plan(workload: Workload, world_size: int) -> Any:
    """TorchRec's planner's plan for ``workload`` on a CPU topology, as an embshard plan."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from benchmarks.compare.common import EPS, LEARNING_RATE

    root = nn.Module()
    root.ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.feature]
            )
            for t in workload.tables
        ],
        device=torch.device("meta"),
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": LEARNING_RATE,
            "eps": EPS,
        }
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=workload.batch_per_rank,
        constraints={
            t.name: ParameterConstraints(pooling_factors=[pooling_factor(workload, i)])
            for i, t in enumerate(workload.tables)
        },
    )
    tr_plan = planner.plan(root, [sharder])
    return from_torchrec(tr_plan.plan[MODULE], world_size)


def from_torchrec(module_plan: Any, world_size: int) -> Any:
    """A TorchRec ``EmbeddingModuleShardingPlan`` as an embshard ``ShardingPlan``."""
    from embshard_types.parameter_sharding import ParameterSharding
    from embshard_types.vocab import ComputeKernel, ShardingType

    out = {}
    for name, ps in module_plan.items():
        kind = ShardingType.parse(ps.sharding_type)
        if kind is ShardingType.DATA_PARALLEL:
            out[name] = ParameterSharding(kind, ComputeKernel.FUSED, tuple(range(world_size)))
            continue
        shards = tuple(ps.sharding_spec.shards)
        out[name] = ParameterSharding(
            kind,
            ComputeKernel.parse(ps.compute_kernel),
            tuple(int(m.placement.rank()) for m in shards),
            shards,
        )
    return _wrap(out)


def describe(plan: Any) -> str:
    """``"table_wise 20, data_parallel 6"``: tables per sharding type."""
    counts: dict[str, int] = {}
    for module_plan in plan.values():
        for ps in module_plan.values():
            counts[ps.sharding_type.value] = counts.get(ps.sharding_type.value, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
