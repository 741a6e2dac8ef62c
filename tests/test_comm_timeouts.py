"""Collective time limits: a dead or hung rank surfaces as CollectiveError, never as a hang."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _mp import Exited, run_ranks

from embshard_dist.comm.collectives import all_reduce
from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.comm.timeouts import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    ENV_TIMEOUT_VAR,
    CollectiveError,
    collective_timeout,
)
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

# ---- the policy ----------------------------------------------------------------------------


def test_timeout_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TIMEOUT_VAR, raising=False)
    assert collective_timeout() == timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    monkeypatch.setenv(ENV_TIMEOUT_VAR, "7.5")
    assert collective_timeout() == timedelta(seconds=7.5)
    assert collective_timeout(3) == timedelta(seconds=3)  # the call wins
    assert collective_timeout(timedelta(minutes=1)) == timedelta(seconds=60)
    monkeypatch.setenv(ENV_TIMEOUT_VAR, "soon")
    with pytest.raises(ValueError, match=f"{ENV_TIMEOUT_VAR}='soon' is not a number"):
        collective_timeout()
    with pytest.raises(ValueError, match="positive, finite"):
        collective_timeout(0)


def test_collective_error_message_and_pickling() -> None:
    err = CollectiveError(
        "kjt_all_to_all.values",
        rank=2,
        group="process group '0' with global ranks [0, 1, 2]",
        reason="Operation timed out!",
        timed_out=True,
        timeout_s=5.0,
    )
    text = str(err)
    assert "'kjt_all_to_all.values' on rank 2" in text
    assert "global ranks [0, 1, 2]" in text and "timed out after 5 s" in text
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, CollectiveError) and str(copy) == text
    assert (copy.collective, copy.rank, copy.timed_out) == ("kjt_all_to_all.values", 2, True)


# ---- dead and hung peers -------------------------------------------------------------------


def _outcome(fn: object) -> tuple[str, str, bool, float]:
    start = time.monotonic()
    try:
        assert callable(fn)
        fn()
    except CollectiveError as e:
        return e.collective, str(e), e.timed_out, time.monotonic() - start
    return "no error", "", False, time.monotonic() - start


def _pooled_with_dead_rank(limit_s: float) -> tuple[str, str, bool, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    a2a = PooledEmbeddingsAllToAll(None, [2] * world, timeout=limit_s)
    a2a(torch.ones(world, 2)).wait()  # a healthy round first
    if rank == 1:
        os._exit(7)
    return _outcome(lambda: a2a(torch.ones(world, 2)).wait())


@pytest.mark.cpu_only("kills a rank; the time limit applies to CPU waits (NCCL's watchdog aborts)")
def test_dead_rank_raises_collective_error_in_pooled_all_to_all() -> None:
    limit = 8.0
    results = run_ranks(3, _pooled_with_dead_rank, limit, may_exit=[1], timeout_s=60)
    assert results[1] == Exited(7)
    for rank in (0, 2):
        collective, message, _, elapsed = results[rank]
        assert collective == "pooled_all_to_all.forward", message
        assert f"on rank {rank}" in message and "global ranks [0, 1, 2]" in message
        assert elapsed < limit + 2.0


def _kjt_with_rank_dying_between_phases(limit_s: float) -> tuple[str, str, bool, float]:
    rank = dist.get_rank()
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(4), lengths=torch.tensor([1, 1, 2, 0])
    )
    a2a = KJTAllToAll(None, [1, 1], timeout=limit_s)
    splits = a2a(kjt)
    if rank == 1:
        # Phase 1 is in flight (gloo completes it in the background); die before phase 2.
        time.sleep(1.0)
        os._exit(3)
    return _outcome(lambda: splits.wait().wait())


@pytest.mark.cpu_only("kills a rank; the time limit applies to CPU waits (NCCL's watchdog aborts)")
def test_rank_dying_between_kjt_phases_raises_collective_error() -> None:
    limit = 8.0
    results = run_ranks(2, _kjt_with_rank_dying_between_phases, limit, may_exit=[1])
    assert results[1] == Exited(3)
    collective, message, _, elapsed = results[0]
    # Normally phase 2 fails; if rank 1's exit overtook its phase-1 message, phase 1 does.
    # (lengths and ids travel together when they share a dtype, as here)
    assert collective in ("kjt_all_to_all.lengths_and_values", "kjt_all_to_all.splits"), message
    assert elapsed < limit + 2.0


def _all_reduce_with_hung_rank(sleep_s: float) -> tuple[str, str, bool, float]:
    if dist.get_rank() == 1:
        # Never joins the collective; its process stays alive (and connected) afterwards.
        time.sleep(sleep_s)
        return "slept", "", False, sleep_s
    return _outcome(lambda: all_reduce(torch.ones(3), name="dense_grads"))


@pytest.mark.cpu_only("hangs a rank; the collective time limit applies to CPU waits only")
def test_hung_rank_times_out_with_the_environment_limit() -> None:
    # The harness sets EMBSHARD_COLLECTIVE_TIMEOUT_S on the ranks.
    results = run_ranks(2, _all_reduce_with_hung_rank, 0.5, collective_timeout_s=1.5)
    collective, message, timed_out, elapsed = results[0]
    assert collective == "dense_grads" and timed_out, message
    assert "timed out after 1.5 s" in message and ENV_TIMEOUT_VAR in message
    assert 1.4 <= elapsed < 5.0
