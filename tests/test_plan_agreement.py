"""A plan refused on one rank, or plans that differ: every rank raises the same ValueError, fast.

DistributedModelParallel runs on 2 real ranks with a collective limit of a few seconds; each
rank returns the error it got and how long construction took. Before the agreement carried the
verdict, the rank whose check passed waited in the agreement until that limit ran out.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch.distributed as dist
from _mp import run_on_ranks
from test_dmp_checks import SPEC, _plan_case, _table_wise
from test_dmp_training import build_model

from embshard_dist.comm.timeouts import ENV_TIMEOUT_VAR
from embshard_dist.dmp.model_parallel import DistributedModelParallel
from embshard_dist.planner.agreement import agree_on_plan
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan

WORLD = 2
LIMIT_S = 6.0
"""The collective limit set on the ranks: any error that took this long came from a timeout."""


def _plan(case: str) -> ShardingPlan:
    """Rank 0 gets the good plan; rank 1 gets ``case`` (``both:...``: every rank gets it)."""
    rank = dist.get_rank()
    if case.startswith("both:"):
        return _plan_case(case.removeprefix("both:"))
    if case == "plans_differ":  # each rank a valid plan of its own
        return _plan_case(case)
    if case == "each_rank_its_own_error":
        plan = dict(_plan_case("good")["sparse_arch"])  # type: ignore[call-overload]
        plan["t9" if rank == 0 else "t1"] = _table_wise(0 if rank == 0 else 7, 50)
        return ShardingPlan({"sparse_arch": EmbeddingModuleShardingPlan(plan)})
    return _plan_case(case if rank == 1 else "good")


def _construct(case: str) -> tuple[str, str, float]:
    model = build_model()
    plan = _plan(case)
    before = os.environ.get(ENV_TIMEOUT_VAR)
    os.environ[ENV_TIMEOUT_VAR] = str(LIMIT_S)
    dist.barrier()
    start = time.monotonic()
    try:
        DistributedModelParallel(model, plan=plan, optimizer=SPEC)
        outcome = ("no error", "")
    except Exception as e:
        outcome = (type(e).__name__, str(e))
    finally:
        if before is None:
            del os.environ[ENV_TIMEOUT_VAR]
        else:
            os.environ[ENV_TIMEOUT_VAR] = before
    return outcome[0], outcome[1], time.monotonic() - start


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        (
            "rank_outside_world",
            [
                "check failed on rank(s) [1] and passed on rank(s) [0]",
                "rank 1: ValueError:",
                "rank 5 is outside the world of size 2 (table 't1')",
                "different sharding plans (2 distinct: ranks [0]; ranks [1])",
            ],
        ),
        (
            "unknown_table",
            [
                "check failed on rank(s) [1] and passed on rank(s) [0]",
                "names table 't9' in module 'sparse_arch', which has no such table",
            ],
        ),
        (
            "unknown_path",
            ["check failed on rank(s) [1]", "names module path 'towers.ebc'"],
        ),
        (
            "each_rank_its_own_error",
            [
                "check failed on rank(s) [0, 1]",
                "rank 0: ValueError:",
                "table 't9'",
                "rank 1: ValueError:",
                "rank 7 is outside the world of size 2",
            ],
        ),
        ("plans_differ", ["the ranks hold different sharding plans (2 distinct"]),
        ("both:rank_outside_world", ["rank 5 is outside the world of size 2 (table 't1')"]),
    ],
)
def test_a_plan_refused_anywhere_gives_every_rank_the_same_error(
    case: str, fragments: list[str]
) -> None:
    (kind0, text0, took0), (kind1, text1, took1) = run_on_ranks(WORLD, _construct, case)
    assert (kind0, text0) == (kind1, text1), (text0, text1)
    assert kind0 == "ValueError", (kind0, text0)
    for fragment in fragments:
        assert fragment in text0, (fragment, text0)
    assert "timed out" not in text0
    assert max(took0, took1) < LIMIT_S / 2, (took0, took1)


def test_both_ranks_failing_alike_raise_their_own_error_unwrapped() -> None:
    (_, text, _), _ = run_on_ranks(WORLD, _construct, "both:unknown_table")
    assert "check failed on rank" not in text
    assert "names table 't9'" in text


def _agree_returns_check_result() -> Any:
    return agree_on_plan(_plan_case("good"), lambda: ("checked", dist.get_rank()))


def test_agreement_returns_each_ranks_own_check_result() -> None:
    assert run_on_ranks(WORLD, _agree_returns_check_result) == [("checked", 0), ("checked", 1)]
