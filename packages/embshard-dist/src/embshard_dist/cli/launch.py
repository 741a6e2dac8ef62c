"""Run a function on N local processes joined by one process group, or join torchrun's.

The local processes are started and watched by ``torch.multiprocessing.start_processes``
(spawn): when one ends with a non-zero code it gives the others ``grace_s`` to end, then
SIGTERM, another ``grace_s``, then SIGKILL, and reaps them all.

Guarantees: a failing rank prints its traceback prefixed by its rank; ``launch`` then names
the failed rank and the ranks it stopped, and returns 0 or the first failing rank's exit code
(``128 + S`` for a rank killed by signal S); no rank outlives ``launch``.
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "DEFAULT_PROCESS_GROUP_TIMEOUT_S",
    "default_backend",
    "launch",
    "launched_by_torchrun",
    "run_rank",
]

DEFAULT_PROCESS_GROUP_TIMEOUT_S = 300.0
"""Time limit of the process group's own operations (its setup, NCCL's watchdog)."""


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend(nproc: int) -> str:
    """``nccl`` when there is a CUDA GPU for each of ``nproc`` local processes, else ``gloo``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc:
        return "nccl"
    return "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(
    fn: Callable[..., int | None],
    args: Sequence[Any],
    backend: str,
    *,
    pg_timeout_s: float = DEFAULT_PROCESS_GROUP_TIMEOUT_S,
    threads: int | None = None,
) -> int:
    """Join the process group the environment describes, run ``fn(*args)``, leave the group.

    Args:
        fn: the rank's work; its integer result (``None``: 0) is the exit code.
        pg_timeout_s: the process group's own time limit.
        threads: torch intra-op threads for this rank (``None``: leave as is).

    Returns:
        The exit code: ``fn``'s result, a ``SystemExit``'s code, or 1 after an exception.
    """
    rank = os.environ.get("RANK", "?")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group(
                backend, init_method="env://", timeout=datetime.timedelta(seconds=pg_timeout_s)
            )
        result = fn(*args)
        return int(result or 0)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        text = traceback.format_exc().rstrip("\n")
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.flush()
        return 1
    finally:
        sys.stdout.flush()
        # modules holding the group in reference cycles go now, while the interpreter is whole
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _child(
    rank: int,
    env: dict[str, str],
    fn: Callable[..., int | None],
    args: Sequence[Any],
    backend: str,
    pg_timeout_s: float,
    threads: int | None,
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    code = run_rank(fn, args, backend, pg_timeout_s=pg_timeout_s, threads=threads)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (atexit handlers of torch's libraries can block on a dead peer).
    os._exit(code)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(
    fn: Callable[..., int | None],
    args: Sequence[Any] = (),
    *,
    nproc: int = 2,
    backend: str | None = None,
    pg_timeout_s: float = DEFAULT_PROCESS_GROUP_TIMEOUT_S,
    grace_s: float = 10.0,
    threads: int | None = None,
) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks, or as torchrun's rank under torchrun.

    Each spawned rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and a free ``MASTER_PORT``.

    Args:
        fn: a module-level (picklable) function; its integer result is the rank's exit code.
        args: picklable arguments, the same for every rank.
        backend: ``gloo`` or ``nccl`` (default: :func:`default_backend`).
        grace_s: after the first failure, how long the other ranks may take to end before
            SIGTERM (and again before SIGKILL).
        threads: torch threads per rank (default: the CPU count shared out, at least 1).

    Returns:
        0 when every rank succeeded, else the first failing rank's exit code.

    Raises:
        ValueError: ``nproc`` is not positive, or the backend is unknown.
    """
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        return run_rank(fn, args, backend, pg_timeout_s=pg_timeout_s, threads=threads)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    backend = backend or default_backend(nproc)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPUs)")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    context = mp.start_processes(
        _child,
        args=(env, fn, tuple(args), backend, pg_timeout_s, threads),
        nprocs=nproc,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join(grace_period=grace_s):
            pass
    except mp.ProcessExitedException as e:
        return _report(context.processes, e.error_index, _exit_code(e.exit_code), grace_s)
    except mp.ProcessRaisedException as e:  # _child failed before run_rank could report
        sys.stderr.write("".join(f"[rank {e.error_index}] {line}\n" for line in e.msg.splitlines()))
        return _report(context.processes, e.error_index, 1, grace_s)
    except KeyboardInterrupt:
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join()
        return 130
    return 0


def _report(procs: Sequence[Any], failed: int, code: int, grace_s: float) -> int:
    """Name the failed rank and the ranks the launcher stopped; returns ``code``."""
    print(f"embshard: rank {failed} failed with exit code {code}", file=sys.stderr, flush=True)
    stop_codes = (-signal.SIGTERM, -signal.SIGKILL)
    stopped = [r for r, p in enumerate(procs) if r != failed and p.exitcode in stop_codes]
    if stopped:
        print(
            f"embshard: stopped ranks {stopped} (still running {grace_s:g} s after the failure)",
            file=sys.stderr,
            flush=True,
        )
    return code
