"""Run a function on N real processes joined by a process group, for tests.

The backend comes from ``EMBSHARD_TEST_BACKEND``: ``gloo`` (the default; every rank on the CPU)
or ``nccl`` (rank ``r`` on GPU ``r % torch.cuda.device_count()``, set before the group starts).
Tests put their tensors and sharded modules on :func:`test_device` so the same test runs on
either; under ``nccl`` a call needing more ranks than visible GPUs is skipped (``pytest.skip``,
decided in the parent before any process starts). ``EMBSHARD_TEST_DEVICE`` may restate the
device type (``cpu`` / ``cuda``); it must agree with the backend.

Two ways:

* ``run_on_ranks(world_size, fn, *args)`` reuses a pool of ranks kept alive for the test
  session (one per world size), so a test costs milliseconds rather than a process start;
  a pool that saw any failure is killed and replaced on next use;
* ``run_ranks(world_size, fn, *args, may_exit=...)`` starts fresh processes for one call and
  kills them afterwards: use it for tests that kill or hang a rank.

``fn(*args)`` runs on every rank (it can read ``torch.distributed.get_rank()``); it must be a
module-level function of an importable module (a test module is: pytest puts its folder on
``sys.path`` and spawned children inherit it). The call returns the ranks' return values in
rank order. An exception on any rank becomes ``RankError`` carrying the rank and its traceback;
a rank that dies, or a call that exceeds ``timeout_s``, too. Each rank uses one thread
(``torch.set_num_threads(1)``) and ``EMBSHARD_COLLECTIVE_TIMEOUT_S`` is set to
``collective_timeout_s`` there, so a collective bug fails fast instead of hanging. Return CPU
values from ``fn`` (``.cpu()`` a tensor that lives on a GPU): results travel through a queue.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 20.0
PROCESS_GROUP_TIMEOUT_S = 30.0
BACKEND_VAR = "EMBSHARD_TEST_BACKEND"
DEVICE_VAR = "EMBSHARD_TEST_DEVICE"
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


def selected_backend() -> str:
    """The backend the test ranks join: ``EMBSHARD_TEST_BACKEND`` (default ``gloo``).

    Raises:
        ValueError: an unknown backend, or an ``EMBSHARD_TEST_DEVICE`` that does not go with it.
    """
    backend = os.environ.get(BACKEND_VAR, "").strip().lower() or "gloo"
    if backend not in _DEVICE_OF_BACKEND:
        raise ValueError(
            f"{BACKEND_VAR}={backend!r} is not a test backend; use 'gloo' (CPU) or 'nccl' (GPUs)"
        )
    device = os.environ.get(DEVICE_VAR, "").strip().lower()
    if device and device != _DEVICE_OF_BACKEND[backend]:
        raise ValueError(
            f"{DEVICE_VAR}={device!r} does not go with {BACKEND_VAR}={backend!r}: the "
            f"{backend} ranks run on {_DEVICE_OF_BACKEND[backend]!r}; unset {DEVICE_VAR} or set "
            f"{BACKEND_VAR}={'nccl' if device == 'cuda' else 'gloo'}"
        )
    return backend


def gpu_index(rank: int) -> int:
    """The GPU rank ``rank`` uses under ``nccl``: ``rank % torch.cuda.device_count()``."""
    count = torch.cuda.device_count()
    return rank % count if count else rank


def test_device(rank: int | None = None) -> torch.device:
    """Where a test rank keeps its tensors and sharded modules: CPU (gloo) or its GPU (nccl).

    Args:
        rank: the rank (default: this process's rank in the default group, else 0).
    """
    if selected_backend() == "gloo":
        return torch.device("cpu")
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.device("cuda", gpu_index(rank))


test_device.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test to collect


def require_devices(world_size: int) -> None:
    """Skip the calling test unless ``world_size`` ranks can each have a device of their own."""
    if selected_backend() != "nccl":
        return
    count = torch.cuda.device_count()
    if count < world_size:
        pytest.skip(
            f"{BACKEND_VAR}=nccl: this test runs {world_size} ranks, one per GPU, but only "
            f"{count} CUDA device(s) are visible"
        )


class RankError(AssertionError):
    """A rank raised, died, or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Exited:
    """The result of a rank that left with ``os._exit`` (allowed by ``may_exit``)."""

    exitcode: int


def free_port() -> int:
    """A TCP port free on this host now (for a process group a test starts itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    torch.set_num_threads(1)
    os.environ["EMBSHARD_COLLECTIVE_TIMEOUT_S"] = str(collective_timeout_s)
    try:
        backend = selected_backend()
        if backend == "nccl":
            torch.cuda.set_device(gpu_index(rank))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
    except BaseException:
        results.put((-1, rank, "error", traceback.format_exc()))
        return
    results.put((-1, rank, "ok", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args = task
        try:
            value = fn(*args)
        except BaseException:
            results.put((task_id, rank, "error", traceback.format_exc()))
        else:
            results.put((task_id, rank, "ok", value))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` processes in one process group, running submitted functions together.

    Under ``nccl`` with fewer visible GPUs than ``world_size`` it skips the test (see
    :func:`require_devices`) before starting any process.
    """

    def __init__(
        self,
        world_size: int,
        *,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        require_devices(world_size)
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.broken = False
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._next_id = 0
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, collective_timeout_s, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(-1, start_timeout_s, may_exit=())

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        may_exit: Sequence[int] = (),
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank and return the results in rank order.

        Args:
            fn: a module-level function.
            args: picklable arguments, the same on every rank.
            timeout_s: limit for the whole call.
            may_exit: ranks allowed to end their process (their result is ``Exited``).
        """
        if self.broken:
            raise RankError("this rank pool already failed; start a new one")
        self._next_id += 1
        for q in self._tasks:
            q.put((self._next_id, fn, args))
        return self._collect(self._next_id, timeout_s, may_exit=may_exit)

    def _collect(self, task_id: int, timeout_s: float, *, may_exit: Sequence[int]) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        done: dict[int, Any] = {}
        while len(done) < self.world_size:
            try:
                tid, rank, status, value = self._results.get(timeout=0.1)
            except queue.Empty:
                self._check_alive(done, may_exit, task_id)
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in done]
                    self.close(kill=True)
                    raise RankError(
                        f"ranks {missing} did not finish within {timeout_s:g} s "
                        f"(finished: {sorted(done)})"
                    ) from None
                continue
            if tid != task_id:
                continue
            if status == "error":
                self.close(kill=True)
                raise RankError(f"rank {rank} raised:\n{value}", rank)
            done[rank] = value
        if any(isinstance(v, Exited) for v in done.values()):
            self.close(kill=True)
        return [done[r] for r in range(self.world_size)]

    def _check_alive(self, done: dict[int, Any], may_exit: Sequence[int], task_id: int) -> None:
        for rank, p in enumerate(self._procs):
            if rank in done or p.exitcode is None:
                continue
            if rank in may_exit:
                done[rank] = Exited(p.exitcode)
                continue
            time.sleep(0.2)  # let a traceback that was already sent arrive
            try:
                while True:
                    tid, r, status, value = self._results.get_nowait()
                    if tid == task_id and status == "error":
                        self.close(kill=True)
                        raise RankError(f"rank {r} raised:\n{value}", r)
            except queue.Empty:
                pass
            self.close(kill=True)
            raise RankError(f"rank {rank} died with exit code {p.exitcode}", rank)

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks: politely (they leave the group), or by killing them."""
        if not kill and not self.broken:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        self.broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


_POOLS: dict[int, RankPool] = {}


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args)`` on the session's pool of ``world_size`` ranks (see ``RankPool.run``)."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool.run(fn, *args, **kwargs)


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    may_exit: Sequence[int] = (),
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` once on ``world_size`` fresh processes, then kill them."""
    pool = RankPool(world_size, collective_timeout_s=collective_timeout_s)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, may_exit=may_exit)
    finally:
        pool.close(kill=True)


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
