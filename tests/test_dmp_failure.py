"""A rank that dies in the middle of a training step: the other rank gets a CollectiveError in
time instead of hanging."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import Exited, run_ranks
from test_dmp_training import build_model, data

from embshard_dist.comm.timeouts import CollectiveError
from embshard_dist.dmp.model_parallel import DistributedModelParallel

LIMIT_S = 5.0


def _die_mid_step() -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert os.environ["EMBSHARD_COLLECTIVE_TIMEOUT_S"] == str(LIMIT_S)
    dmp = DistributedModelParallel(build_model(), optimizer="rowwise_adagrad")
    opt = dmp.optimizer()
    source = data()
    steps = {"n": 0}

    def die_in_step_two(module: Any, args: Any) -> None:
        # Inside DMP's forward: the dense part has run, the sparse part is about to.
        if rank == 1 and steps["n"] == 1:
            os._exit(3)

    dmp.sharded_modules["sparse_arch"].register_forward_pre_hook(die_in_step_two)
    start = time.monotonic()
    try:
        for step in range(3):
            steps["n"] = step
            start = time.monotonic()
            b = source.batch(step, rank, world)
            logits = dmp(b.dense, b.sparse)
            torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels).backward()
            opt.step()
            opt.zero_grad()
    except CollectiveError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.cpu_only("kills a rank; the time limit applies to CPU waits (NCCL's watchdog aborts)")
def test_a_rank_dying_mid_step_ends_the_other_with_collective_error() -> None:
    results = run_ranks(2, _die_mid_step, may_exit=[1], collective_timeout_s=LIMIT_S, timeout_s=60)
    assert results[1] == Exited(3)
    kind, message, elapsed = results[0]
    assert kind == "CollectiveError", message
    assert "on rank 0" in message
    assert elapsed < LIMIT_S + 5.0
