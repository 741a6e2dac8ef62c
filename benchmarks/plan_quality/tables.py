"""A workload (W1, W2, W4) as a planner sees it: tables, traffic, batch size and optimizer.

Both planners (embshard's and TorchRec's) are given the same facts: each table's shape, the
mean ids per bag of each table's feature (``(lo + hi) / 2`` for bag lengths uniform in
``[lo, hi]``), the samples per rank, and the optimizer (RowWiseAdagrad); embshard's also the
Zipf exponent of the ids (TorchRec's planner takes none). The tables sit in a module called
``ebc`` (:data:`MODULE`), as in the side-by-side harness.
"""

from __future__ import annotations

from typing import Any

from benchmarks.compare.common import EPS, LEARNING_RATE
from benchmarks.compare.workloads import Workload

MODULE = "ebc"


def pooling_factor(workload: Workload, index: int) -> float:
    """Mean ids per bag of table ``index``'s feature (its bag lengths are uniform)."""
    lo, hi = workload.bag_range(index)
    return (lo + hi) / 2


def optimizer_spec() -> Any:
    """The optimizer both sides train with (RowWiseAdagrad, the harness's lr and eps)."""
    from embshard_optim.specs import OptimizerSpec, OptimType

    return OptimizerSpec(OptimType.ROWWISE_ADAGRAD, learning_rate=LEARNING_RATE, eps=EPS)


def planner_tables(workload: Workload) -> list[Any]:
    """The workload's tables as embshard ``PlannerTable``s of module ``ebc``."""
    from embshard_dist.planner.tables import PlannerTable

    return [
        PlannerTable(t.name, t.rows, t.dim, path=MODULE, features=(t.feature,))
        for t in workload.tables
    ]


def planner_constraints(workload: Workload) -> dict[str, Any]:
    """Table name -> embshard ``ParameterConstraints``: the table's pooling factor and the
    skew of its ids (W2's Zipf exponent; embshard's planner counts the distinct rows a step
    touches with it, TorchRec's planner has no such input)."""
    from embshard_dist.planner.constraints import ParameterConstraints

    return {
        t.name: ParameterConstraints(
            pooling_factors=(pooling_factor(workload, i),), zipf_exponent=workload.zipf
        )
        for i, t in enumerate(workload.tables)
    }


def embedding_bag_configs(workload: Workload) -> list[Any]:
    """embshard ``EmbeddingBagConfig``s of the workload's tables, in order."""
    from embshard_types.configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=(t.feature,)
        )
        for t in workload.tables
    ]
