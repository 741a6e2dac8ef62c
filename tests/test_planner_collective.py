"""collective_plan on 2 real gloo ranks: rank 0 plans, every rank gets its plan (or its error)."""

from __future__ import annotations

import torch.distributed as dist
from _mp import run_on_ranks
from torch import nn

from embshard_dist.planner.calibration.calibrate import measure_comms
from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.stats import PlannerError
from embshard_dist.planner.topology import Topology
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.plan import ShardingPlan


def _model() -> nn.Module:
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=32)
            for i, rows in enumerate([50_000, 4_000, 300, 120_000])
        ],
        device="meta",
    )
    return model


def _collective_case() -> tuple[str, str]:
    rank = dist.get_rank()
    # Rank 1 is given other constraints: if it planned for itself it would get another plan.
    cons = (
        {"t0": ParameterConstraints(pooling_factors=(20.0,))}
        if rank == 0
        else {
            "t0": ParameterConstraints(sharding_types=("row_wise",)),
            "t1": ParameterConstraints(ranks=(1,)),
        }
    )
    planner = EmbeddingShardingPlanner(Topology(world_size=2), constraints=cons, batch_size=128)
    received = planner.collective_plan(_model())
    alone = planner.plan(_model())
    return received.to_json(), alone.to_json()


def test_collective_plan_gives_every_rank_rank_zeros_plan() -> None:
    (plan0, alone0), (plan1, alone1) = run_on_ranks(2, _collective_case)
    assert plan0 == plan1 == alone0
    assert alone1 != alone0
    assert isinstance(ShardingPlan.from_json(plan1), ShardingPlan)


def _failing_case() -> str:
    rank = dist.get_rank()
    # Only rank 0 plans; its topology leaves no room, rank 1's would fit.
    memory = 1 << 16 if rank == 0 else 1 << 32
    planner = EmbeddingShardingPlanner(Topology(world_size=2, memory_per_rank=memory))
    try:
        planner.collective_plan(_model())
    except PlannerError as e:
        return str(e)
    return "planned"


def test_a_planning_error_on_rank_zero_reaches_every_rank() -> None:
    message0, message1 = run_on_ranks(2, _failing_case)
    assert message0.startswith("no sharding plan fits")
    assert message1.startswith("planning failed on the planning rank (rank 0 of the group)")
    assert message0 in message1


def test_calibration_measures_collectives_between_two_processes() -> None:
    a2a_bw, rs_bw, latency = measure_comms("gloo", world=2, threads=1)
    assert a2a_bw > 1e6 and rs_bw > 1e6
    assert 0 < latency < 1.0
