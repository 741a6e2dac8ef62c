"""A plan that does not fit the model or the world: every rank raises the same ValueError.

Each case runs on two real ranks; each rank returns the error it got. The checks run before any
collective (or, for cross-rank disagreements, after collectives every rank takes part in), so
no rank is left waiting and the rank pool stays usable from one case to the next.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_dmp_training import build_model

from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.planner.simple import SimplePlanner
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_optim.specs import OptimizerSpec
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.shard_spec import ShardSpec

WORLD = 2
SPEC = OptimizerSpec.from_name("rowwise_adagrad", lr=0.1)


def _table_wise(rank: int, rows: int) -> ParameterSharding:
    spec = ShardSpec.on(rank, test_device().type, (0, 0), (rows, 8))
    return ParameterSharding("table_wise", "fused", ranks=(rank,), shards=(spec,))


def _plan_case(case: str) -> ShardingPlan:
    rank = dist.get_rank()
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=SPEC)]
    planner = SimplePlanner(WORLD, device_type=test_device().type, optimizer=SPEC)
    good = planner.plan(build_model(device="meta"), sharders)
    module_plan = dict(good["sparse_arch"])  # type: ignore[call-overload]
    if case == "unknown_table":
        module_plan["t9"] = _table_wise(0, 10)
    elif case == "rank_outside_world":
        module_plan["t1"] = _table_wise(5, 50)
    elif case == "unknown_path":
        return ShardingPlan({"sparse_arch": module_plan, "towers.ebc": module_plan})
    elif case == "plans_differ":
        module_plan["t0"] = _table_wise(rank, 40)  # valid on each rank, but not the same
    return ShardingPlan({"sparse_arch": EmbeddingModuleShardingPlan(module_plan)})


def _construct(case: str) -> tuple[str, str]:
    model = build_model()
    if case == "weights_differ" and dist.get_rank() == 1:
        with torch.no_grad():
            model.sparse_arch.embedding_bags["t3"].weight[7, 2] += 1e-3
    plan = None if case == "weights_differ" else _plan_case(case)
    try:
        DistributedModelParallel(model, plan=plan, optimizer=SPEC)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown_table", r"names table 't9' in module 'sparse_arch', which has no such table"),
        ("unknown_path", r"names module path 'towers.ebc', which the model does not have"),
        ("rank_outside_world", r"rank 5 is outside the world of size 2 \(table 't1'\)"),
        ("plans_differ", r"the ranks hold different sharding plans"),
        ("weights_differ", r"different source weights for table 't3'"),
    ],
)
def test_every_rank_raises_the_same_error(case: str, message: str) -> None:
    results = run_on_ranks(WORLD, _construct, case)
    assert results[0] == results[1], results
    kind, text = results[0]
    assert kind == "ValueError" and re.search(message, text), results[0]


def _agreement() -> tuple[str, str]:
    model = build_model(device="meta")
    sharders: list[Any] = [EmbeddingBagCollectionSharder(optimizer=SPEC)]
    planner = SimplePlanner(WORLD, sharding={"t2": "row_wise"}, optimizer=SPEC)
    same = planner.collective_plan(model, sharders)
    try:
        sharding = "row_wise" if dist.get_rank() == 0 else "table_wise"
        SimplePlanner(WORLD, sharding=sharding).collective_plan(model, sharders)
    except ValueError as e:
        return str(same["sparse_arch"]["t2"].sharding_type), str(e)  # type: ignore[index]
    return "", "no error"


def test_collective_plan_agrees_or_says_which_ranks_differ() -> None:
    for kind, error in run_on_ranks(WORLD, _agreement):
        assert kind == "row_wise"
        assert "different sharding plans (2 distinct: ranks [0]; ranks [1])" in error
