"""One rank of W2-DLRM: both libraries' plain loops and pipelines, timed interleaved.

Protocol on every rank (all ranks run the same sequence of collectives):

1. build every mode of the job (``dlrm_sides.MODES``) on the same tables, plan, initial weights,
   dense parameters and batches; a mode that cannot be built is reported with its error;
2. check: embshard's and TorchRec's logits on the first batch (plain models, nothing trained);
   the largest absolute difference over the ranks must be at most ``tolerance``, otherwise
   nothing is timed;
3. time: ``warmup + steps`` rounds; in each round every mode does one step of its loop, the
   order rotating between rounds, each step started after a barrier; besides its time, each
   step's wait on embshard's collectives (``comm.timeouts.waited_seconds``: input dist, output
   dist and gradient all-to-alls; not DDP's all-reduce) is recorded. A mode whose step raises
   (e.g. a pipeline that cannot run on the CPU) is dropped with its error on every rank;
4. after the timed rounds, embshard's pipelined and plain models have trained on the same
   batches: their logits on the first batch must be equal (reported);
5. write this rank's step times, waits, errors and diffs as JSON.

A pipelined mode keeps the next batch's input dist in flight between its steps, as in a real
loop; the barrier before every step lets that traffic finish before the clock starts.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.compare.common import join_group
from benchmarks.compare.dlrm_sides import DlrmContender, build, dense_batches
from benchmarks.compare.plans import make_plan
from benchmarks.compare.workloads import get

DLRM_WORKLOADS = {"W2-DLRM": "W2"}
"""A DLRM workload -> the workload whose tables, plans and sparse batches it uses."""


@dataclass(frozen=True)
class DlrmJob:
    """What every rank of one W2-DLRM run does."""

    workload: str
    plan: str
    modes: tuple[str, ...]
    steps: int
    warmup: int
    threads: int
    num_batches: int
    tolerance: float
    seed: int
    out_dir: str
    local_size: int = 0


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _agreed_failure(failed: bool) -> bool:
    """Whether any rank failed (so that every rank drops the mode together)."""
    return _all_max(1.0 if failed else 0.0) > 0


def _diff(a: DlrmContender, b: DlrmContender) -> float:
    return _all_max(float((a.logits(0) - b.logits(0)).abs().max()))


def run_rank(rank: int, world: int, port: int, job: DlrmJob) -> None:
    """Entry point of one spawned rank (``torch.multiprocessing.spawn``)."""
    from benchmarks.compare.worker import _quiet
    from embshard_dist.comm.timeouts import waited_seconds

    _quiet()
    join_group(rank, world, port, job.threads, job.local_size)
    result: dict[str, object] = {"rank": rank}
    errors: dict[str, str] = {}
    result["errors"] = errors
    try:
        workload = get(DLRM_WORKLOADS[job.workload], job.seed)
        batches = workload.batches(rank, world, job.num_batches)
        dense = dense_batches(workload, rank, world, job.num_batches)
        plan = make_plan(job.plan, workload, world, job.local_size or None)
        sides: dict[str, DlrmContender] = {}
        for mode in job.modes:
            built: DlrmContender | None = None
            try:
                built = build(mode, workload, plan, batches, dense, world, job.local_size)
            except Exception as e:
                errors[mode] = _error(e)
            if _agreed_failure(built is None):
                errors.setdefault(mode, "failed on another rank")
            elif built is not None:
                sides[mode] = built
        if "embshard-plain" in sides and "torchrec-plain" in sides:
            diff = _diff(sides["embshard-plain"], sides["torchrec-plain"])
            result["check_max_abs_diff"] = diff
            if diff > job.tolerance:
                result["error"] = f"logits differ before training: {diff} > {job.tolerance}"
                return
        times: dict[str, list[float]] = {m: [] for m in sides}
        waits: dict[str, list[float]] = {m: [] for m in sides}
        for i in range(job.warmup + job.steps):
            names = list(sides)
            shift = i % len(names) if names else 0
            for mode in names[shift:] + names[:shift]:
                dist.barrier()
                waited, start = waited_seconds(), time.perf_counter()
                failure = None
                try:
                    sides[mode].step()
                except Exception as e:
                    failure = _error(e)
                    traceback.print_exc()
                elapsed = time.perf_counter() - start
                if _agreed_failure(failure is not None):
                    errors[mode] = failure or "failed on another rank"
                    del sides[mode]
                    continue
                if i >= job.warmup:
                    times[mode].append(elapsed * 1e3)
                    waits[mode].append((waited_seconds() - waited) * 1e3)
        result["step_ms"] = {m: times[m] for m in sides}
        result["wait_ms"] = {m: waits[m] for m in sides}
        if "embshard-plain" in sides and "embshard-pipelined" in sides:
            result["pipelined_vs_plain_max_abs_diff"] = _diff(
                sides["embshard-pipelined"], sides["embshard-plain"]
            )
    except Exception as e:
        result["error"] = _error(e)
        raise
    finally:
        Path(job.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
