"""One rank of a comparison: build the contenders, check them, then time them interleaved.

Protocol on every rank (all ranks run the same sequence of collectives):

1. build each contender named in the job, on the same workload, plan, initial weights and
   loss weights (a contender that cannot run the plan raises ``Unsupported`` on every rank);
2. check: the first batch's forward outputs of every contender against the first one's, by
   feature; the largest absolute difference over the ranks must be at most ``tolerance``,
   otherwise nothing is timed and the job reports the failure;
3. time: ``warmup + steps`` rounds; in each round every contender does one step, the order
   alternating between rounds (A B, B A, ...), each step started after a barrier so the
   ranks start together; steps cycle through the pre-built batches;
4. after the timed rounds, the forward outputs are compared again (informational: after the same
   training steps the two libraries' weights agree only where both do the same math);
5. with ``profile_steps``, that many more steps per contender (alternating, after a barrier),
   each split into phases (``profile``);
6. write this rank's step times, phases, peak RSS (``ru_maxrss``) and diffs as JSON.

A ``memory`` job builds one contender alone and runs a few steps, so its peak RSS is its own.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.compare.common import Contender, Unsupported, join_group
from benchmarks.compare.planned import PLANNED
from benchmarks.compare.plans import Plan, make_plan
from benchmarks.compare.profile import median_phases
from benchmarks.compare.workloads import Batch, Workload, get


@dataclass(frozen=True)
class Job:
    """What every rank of one comparison does."""

    workload: str
    plan: str
    contenders: tuple[str, ...]
    steps: int
    warmup: int
    threads: int
    num_batches: int
    tolerance: float
    seed: int
    out_dir: str
    local_size: int = 0
    memory_only: bool = False
    planned: dict[str, Plan] | None = None
    """``plan == "planned"``: contender -> the plan its own planner picked (see ``planned``)."""
    profile_steps: int = 0
    """Steps per contender profiled phase by phase after the timed ones (0: none)."""


def build(
    name: str,
    workload: Workload,
    plan_kind: str,
    rank: int,
    world: int,
    local: int = 0,
    planned: dict[str, Plan] | None = None,
) -> Contender:
    """Contender ``name`` on this rank (``local``: ranks per node, 0 for one node;
    ``planned``: the planners' plans, for ``plan_kind == "planned"``)."""
    local = local or world
    if plan_kind == PLANNED:
        if planned is None or name not in planned:
            raise ValueError(f"the 'planned' row needs {name}'s planner's plan")
        plan = planned[name]
    else:
        plan = make_plan(plan_kind, workload, world, local)
    weights = workload.loss_weights(rank)
    if name == "torchrec":
        from benchmarks.compare.torchrec_side import TorchRecSide

        return TorchRecSide(workload, plan, weights, world, local)
    if name == "embshard":
        from benchmarks.compare.embshard_side import EmbshardSide

        return EmbshardSide(workload, plan, weights, world, local)
    raise ValueError(f"unknown contender {name!r}; expected 'embshard' or 'torchrec'")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise ValueError(f"the contenders return different features: {sorted(a)} vs {sorted(b)}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _time_step(side: Contender, batch: Batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    side.step(batch)
    return time.perf_counter() - start


def _profile(sides: list[Contender], batches: list[Batch], steps: int) -> dict[str, object]:
    """Per contender, the median ms of each phase over ``steps`` profiled steps, and the
    backward's autograd nodes (ms) of the last one."""
    phases: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    nodes: dict[str, dict[str, float]] = {}
    for i in range(steps):
        for side in sides if i % 2 == 0 else sides[::-1]:
            dist.barrier()
            step_phases, nodes[side.name] = side.profile(batches[i % len(batches)])
            phases[side.name].append(step_phases)
    return {
        "phase_ms": {name: median_phases(samples) for name, samples in phases.items()},
        "backward_nodes_ms": nodes,
    }


def _compare(sides: list[Contender], batch: Batch) -> dict[str, float]:
    outs = [s.forward(batch) for s in sides]
    return {
        s.name: _all_max(max_diff(outs[0], o)) for s, o in zip(sides[1:], outs[1:], strict=True)
    }


def _quiet() -> None:
    """Silence the libraries' deprecation chatter (it would bury the figures)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_rank(rank: int, world: int, port: int, job: Job) -> None:
    """Entry point of one spawned rank (``torch.multiprocessing.spawn``)."""
    _quiet()
    join_group(rank, world, port, job.threads, job.local_size)
    result: dict[str, object] = {"rank": rank}
    code = 0
    try:
        workload = get(job.workload, job.seed)
        batches = workload.batches(rank, world, job.num_batches)
        result["rss_before_build_mb"] = _peak_rss_mb()
        sides: list[Contender] = []
        skipped: dict[str, str] = {}
        for name in job.contenders:
            try:
                sides.append(
                    build(name, workload, job.plan, rank, world, job.local_size, job.planned)
                )
            except Unsupported as e:
                skipped[name] = str(e)
        result["skipped"] = skipped
        if job.memory_only:
            for i in range(job.warmup + job.steps):
                for side in sides:
                    side.step(batches[i % len(batches)])
            result["peak_rss_mb"] = _peak_rss_mb()
            return
        diffs = _compare(sides, batches[0]) if len(sides) > 1 else {}
        result["check_max_abs_diff"] = diffs
        if any(d > job.tolerance for d in diffs.values()):
            result["error"] = (
                f"forward outputs differ before training: {diffs} > tolerance {job.tolerance}"
            )
            return
        times: dict[str, list[float]] = {s.name: [] for s in sides}
        for i in range(job.warmup + job.steps):
            order = sides if i % 2 == 0 else sides[::-1]
            batch = batches[i % len(batches)]
            for side in order:
                t = _time_step(side, batch)
                if i >= job.warmup:
                    times[side.name].append(t * 1e3)
        result["step_ms"] = times
        if job.profile_steps:
            result.update(_profile(sides, batches, job.profile_steps))
        result["post_training_max_abs_diff"] = _compare(sides, batches[0]) if len(sides) > 1 else {}
        result["peak_rss_mb"] = _peak_rss_mb()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        Path(job.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        # Skip interpreter teardown, as `embshard train`'s ranks do: ranks have aborted in it
        # ("terminate called without an active exception", no Python frame left) after their
        # results were written, and the row was lost (see benchmarks/README.md, session 14).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
