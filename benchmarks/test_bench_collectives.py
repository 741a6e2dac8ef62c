"""embshard_dist's collectives on 2 real gloo processes, W1-sized payloads (``nox -s bench``).

The pytest process is rank 0 and times each call with ``benchmark.pedantic`` (fixed rounds and
warm-up rounds, one call per round); a spawned process is rank 1 and makes exactly as many calls
of the same collective with its own payload, so both ranks run in lockstep. One rank 1 serves
the whole module: it gets each collective's name and call count from a queue, says ready (or
sends its traceback), makes the calls, and reports done. One thread per process; every wait has
a time limit (``TIMEOUT_S``), rank 1 is joined with a limit and killed if it does not leave.

Payloads (W1: 4 features, 64 wide, batch 1,024 per rank, 10-30 uniform ids per bag; table-wise:
rank ``r`` owns features ``2r`` and ``2r+1``; each rank's batch comes from
``compare/workloads.py``):

- ``kjt_all_to_all``: ``KJTAllToAll`` with splits ``[2, 2]``, both phases (sizes, then ids);
- ``pooled_all_to_all`` (+ ``_fp16``, ``_int8`` codecs): ``PooledEmbeddingsAllToAll`` of
  ``[2,048, 128]`` per rank into ``[1,024, 256]``;
- ``reduce_scatter`` (+ ``_fp16``): ``PooledEmbeddingsReduceScatter`` of ``[2,048, 256]`` partial
  sums into ``[1,024, 256]`` (row-wise output);
- ``sequence_all_to_all``: ``SequenceEmbeddingsAllToAll`` of one 64-wide row per id of the
  features a rank owns, back to the rank whose sample it is (about 41,000 rows each way);
- ``all_gather_v``: the gradient rows of one data-parallel table (one per distinct id of feature
  ``f0`` on this rank, about 18,000 x 64);
- ``sparse_all_reduce``: the same rows and ids, summed over ranks (the data-parallel update).

Forward only; no timed work but the collective and its codec.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("pytest_benchmark", reason="benchmarks need pytest-benchmark (nox -s bench)")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compare.workloads import Batch, w1

from embshard_dist.comm.collectives import all_gather_v, sparse_all_reduce
from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.comm.qcomms import get_qcomm_codecs
from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_dist.comm.sequence_all_to_all import SequenceEmbeddingsAllToAll
from embshard_dist.comm.timeouts import ENV_TIMEOUT_VAR
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

WORLD = 2
ROUNDS, WARMUP = 20, 3
TIMEOUT_S = 60.0
"""Limit of every wait: process group start, each collective, each message between the ranks."""
IDLE_S = 600.0
"""Rank 1 leaves if no task arrives for this long (the pytest process is gone)."""


def _batches() -> list[Batch]:
    workload = w1()
    return [workload.batches(rank, WORLD, 1)[0] for rank in range(WORLD)]


def _owned(rank: int) -> list[int]:
    """Feature indices rank ``rank`` owns (table-wise: two consecutive features)."""
    return [2 * rank, 2 * rank + 1]


def _collective(op: str, rank: int) -> Callable[[], object]:
    """One blocking call of collective ``op`` with ``rank``'s payload (both ranks build it)."""
    batches = _batches()
    mine = batches[rank]
    b = mine.batch_size
    gen = torch.Generator().manual_seed(100 + rank)
    codecs = None
    for precision in ("fp16", "int8"):
        if op.endswith("_" + precision):
            codecs = get_qcomm_codecs(precision, precision)
    if op == "kjt_all_to_all":
        kjt = KeyedJaggedTensor(keys=list(mine.keys), values=mine.values, lengths=mine.lengths)
        kjt_a2a = KJTAllToAll(None, [2] * WORLD, timeout=TIMEOUT_S)
        return lambda: kjt_a2a(kjt).wait().wait()
    if op.startswith("pooled_all_to_all"):
        local = torch.randn(WORLD * b, 2 * 64, generator=gen)
        pooled = PooledEmbeddingsAllToAll(None, [2 * 64] * WORLD, codecs=codecs, timeout=TIMEOUT_S)
        return lambda: pooled(local).wait()
    if op.startswith("reduce_scatter"):
        partial = torch.randn(WORLD * b, 4 * 64, generator=gen)
        rs = PooledEmbeddingsReduceScatter(None, codecs=codecs, timeout=TIMEOUT_S)
        return lambda: rs(partial).wait()
    if op == "sequence_all_to_all":
        ids = [x.lengths.view(len(x.keys), x.batch_size).sum(1) for x in batches]
        sends = [int(ids[r][_owned(rank)].sum()) for r in range(WORLD)]
        recvs = [int(ids[rank][_owned(r)].sum()) for r in range(WORLD)]
        rows = torch.randn(sum(sends), 64, generator=gen)
        seq = SequenceEmbeddingsAllToAll(None, timeout=TIMEOUT_S)
        return lambda: seq(rows, sends, recvs).wait()
    if op in ("all_gather_v", "sparse_all_reduce"):
        first = int(mine.lengths[:b].sum())
        touched = torch.unique(mine.values[:first])
        grads = torch.randn(touched.numel(), 64, generator=gen)
        if op == "all_gather_v":
            return lambda: all_gather_v(grads, timeout=TIMEOUT_S)
        return lambda: sparse_all_reduce(touched, grads, timeout=TIMEOUT_S)
    raise ValueError(f"unknown collective {op!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def _rank1(port: int, tasks: Any, results: Any) -> None:
    """Rank 1: run each task's collective the given number of times, until told to stop."""
    torch.set_num_threads(1)
    os.environ[ENV_TIMEOUT_VAR] = str(TIMEOUT_S)
    try:
        _init(1, port)
    except BaseException:
        results.put(("error", traceback.format_exc()))
        return
    try:
        while True:
            task = tasks.get(timeout=IDLE_S)
            if task is None:
                break
            op, calls = task
            fn = _collective(op, 1)
            results.put(("ready", op))
            for _ in range(calls):
                fn()
            results.put(("done", op))
    except BaseException:
        # Leaving closes rank 1's sockets, so a rank 0 waiting in a collective fails at once.
        results.put(("error", traceback.format_exc()))
        return
    dist.destroy_process_group()


@dataclass
class Peer:
    """Rank 1's process and the queues to it."""

    process: Any
    tasks: Any
    results: Any
    broken: bool = False

    def expect(self, state: str, op: str) -> None:
        """Wait for rank 1's report ``state`` on ``op``; fail at once if rank 1 died."""
        waited = 0.0
        while True:
            try:
                got, detail = self.results.get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if waited >= TIMEOUT_S or not self.process.is_alive():
                    self.broken = True
                    raise AssertionError(
                        f"rank 1 did not report {state!r} for {op} within {waited:.0f} s "
                        f"(alive: {self.process.is_alive()}, exit code {self.process.exitcode})"
                    ) from None
        if got != state:
            self.broken = True
            raise AssertionError(f"rank 1 failed during {op}:\n{detail}")


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """A 2-rank gloo group: this process is rank 0, a spawned process rank 1."""
    if dist.is_initialized():
        pytest.skip("this process already holds a default process group; run this file alone")
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    port = _free_port()
    process = ctx.Process(target=_rank1, args=(port, tasks, results), daemon=True)
    process.start()
    try:
        _init(0, port)
    except BaseException:
        process.kill()
        process.join(TIMEOUT_S)
        raise
    peer = Peer(process, tasks, results)
    try:
        yield peer
    finally:
        if not peer.broken:
            tasks.put(None)
        dist.destroy_process_group()
        process.join(5.0 if peer.broken else TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(TIMEOUT_S)


OPS = [
    "kjt_all_to_all",
    "pooled_all_to_all",
    "pooled_all_to_all_fp16",
    "pooled_all_to_all_int8",
    "reduce_scatter",
    "reduce_scatter_fp16",
    "sequence_all_to_all",
    "all_gather_v",
    "sparse_all_reduce",
]


@pytest.mark.parametrize("op", OPS)
def test_collective(benchmark, peer: Peer, op: str) -> None:  # type: ignore[no-untyped-def]
    if peer.broken:
        pytest.skip("rank 1 failed in an earlier benchmark of this module")
    if benchmark.cprofile:
        pytest.skip("--benchmark-cprofile makes extra calls that rank 1 cannot follow")
    calls = 1 if benchmark.disabled else ROUNDS + WARMUP
    fn = _collective(op, 0)
    peer.tasks.put((op, calls))
    peer.expect("ready", op)
    made = 0

    def call() -> None:
        nonlocal made
        made += 1
        fn()

    # two ranks and their comm threads share the reference machine's two cores: rounds move
    # by up to ~20% from one run to the next, so the bench gate allows 25% here
    benchmark.extra_info["threshold"] = 0.25
    try:
        benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        for _ in range(calls - made):  # keep in lockstep should pytest-benchmark call fewer times
            fn()
    except BaseException:
        peer.broken = True
        raise
    peer.expect("done", op)
