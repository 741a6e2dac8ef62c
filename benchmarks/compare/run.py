"""The side-by-side driver: embshard against TorchRec, W1 / W2 / W4, every sharding type and a
mixed plan.

The ``planned`` row runs each library on the plan its own planner picks (see ``planned``).

For each (workload, plan) it spawns ``--world-size`` gloo processes (one thread each) that hold
BOTH libraries' models and alternate their steps (``worker``); then, unless ``--no-memory``, one
more group of processes per library that builds that library alone, for its peak RSS per rank.
Figures: the slowest rank's median ms per step, the ratio embshard / TorchRec, peak RSS per rank.

Usage::

    python -m benchmarks.compare.run [--workload W1 W2 W4] [--plans row_wise mixed ...]
        [--steps 20] [--warmup 5] [--quick] [--no-memory] [--contenders torchrec]
        [--world-size 2] [--local-size 1] [--profile] [--out benchmarks/results/compare]

``--workload W2-DLRM`` (only when named): W2's tables in a DLRM (13 dense features, bottom MLP
[256, 128], top MLP [512, 256, 1]); each plan times embshard's and TorchRec's plain loops and
``TrainPipelineSparseDist`` in the same processes, interleaved, with each rank's wait on
embshard's collectives per step (``dlrm_run``).
``--local-size``: ranks per node (default: all ranks on one node; 1 simulates one node per
rank, which gives table-row-wise and grid plans their multi-node layouts). A plan embshard
cannot run yet is timed for TorchRec alone, with a note naming what embshard lacks. Exit status
1 when any configuration failed (including the forward check).
``--quick``: the minimum counts benchmarks.md allows (10 timed steps after 3 warm-up), 2 steps
for the memory runs. ``--profile``: after the timed steps, ``--profile-steps`` more per library,
each split into input dist, lookup, output dist, backward comms, fused update and the rest
(``profile``); a phase table follows the step table. Results go to ``<out>/compare-<time>.json`` and ``.png`` (and
``latest.json`` / ``latest.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.compare import dlrm_run, report
from benchmarks.compare.common import free_port
from benchmarks.compare.dlrm_worker import DLRM_WORKLOADS
from benchmarks.compare.planned import PLANNED, planned_plans
from benchmarks.compare.plans import PLAN_KINDS, Plan, describe, make_plan
from benchmarks.compare.worker import Job, run_rank
from benchmarks.compare.workloads import WORKLOADS, get

CONTENDERS = ("embshard", "torchrec")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "compare"


def spawn(job: Job, world: int) -> tuple[list[dict[str, Any]], str | None]:
    """Run ``job`` on ``world`` fresh processes; each rank's result and the error, if any."""
    with tempfile.TemporaryDirectory(prefix="embshard-compare-") as tmp:
        job = Job(**{**job.__dict__, "out_dir": tmp})
        error = None
        try:
            mp.spawn(run_rank, args=(world, free_port(), job), nprocs=world, join=True)
        except Exception as e:  # a rank raised: keep what the ranks wrote, report the error
            error = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            )
        ranks = []
        for r in range(world):
            p = Path(tmp, f"rank{r}.json")
            ranks.append(json.loads(p.read_text()) if p.exists() else {"rank": r})
    return ranks, error


def embshard_missing(sharding_types: set[str]) -> str | None:
    """Why embshard cannot run these sharding types on the CPU, or ``None`` when it can."""
    try:
        from benchmarks.compare.embshard_side import missing
    except ImportError as e:
        return f"embshard is not importable here ({e})"
    return missing(sharding_types)


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import platform
    from importlib import metadata

    versions = {}
    for dist_name in (
        "torch",
        "fbgemm-gpu-cpu",
        "fbgemm-gpu",
        "torchrec",
        "embshard-types",
        "embshard-optim",
        "embshard-kernels",
        "embshard-dist",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist_name] = metadata.version(dist_name)
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "threads_per_rank": args.threads,
        "world_size": args.world_size,
        "local_size": args.local_size or args.world_size,
        "backend": "gloo",
        "optimizer": "RowWiseAdagrad (FBGEMM EXACT_ROWWISE_ADAGRAD) fused in backward, lr 0.01, eps 1e-8",
        "steps": args.steps,
        "warmup": args.warmup,
        "load_average_start": os.getloadavg(),
    }


def _placement(plan: Plan, world_size: int) -> str:
    """``"table_wise 26 (13 / 13 tables per rank)"``: a planner's plan in one line."""
    per_rank = [0] * world_size
    for tp in plan.values():
        for r in set(tp.ranks):
            per_rank[r] += 1
    kinds = ", ".join(f"{k} {n}" for k, n in describe(plan).items())
    return f"{kinds} ({' / '.join(map(str, per_rank))} tables per rank)"


def _dlrm_rows(args: argparse.Namespace, workload: str) -> list[dict[str, Any]]:
    """The rows of a DLRM workload (``dlrm_run``), one per plan kind; printed as they come."""
    rows = []
    for kind in args.plans:
        if kind == PLANNED:
            print(f"note: {workload}: the planned row is not run for DLRM workloads", flush=True)
            continue
        started = time.perf_counter()
        row = dlrm_run.run(args, workload, kind)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        print("\n".join(dlrm_run.lines(row)), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload",
        nargs="+",
        default=list(WORKLOADS),
        choices=[*WORKLOADS, *DLRM_WORKLOADS],
        help="W1 / W2 / W4: the collections alone; W2-DLRM: W2's tables in a DLRM, plain loops and "
        "pipelines (not run by default)",
    )
    parser.add_argument(
        "--plans", nargs="+", default=[*PLAN_KINDS, PLANNED], choices=[*PLAN_KINDS, PLANNED]
    )
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (>= 10)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps (>= 3)")
    parser.add_argument("--quick", action="store_true", help="10 timed steps after 3 warm-up")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-library RSS runs")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--local-size", type=int, default=0, help="ranks per node (default: all on one node)"
    )
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also time each step's phases")
    parser.add_argument("--profile-steps", type=int, default=10, help="profiled steps per library")
    parser.add_argument("--out", default=str(RESULTS), help=f"default: {RESULTS}")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.memory_steps = 10, 3, 2
    if args.steps < 10 or args.warmup < 3:
        parser.error("benchmarks.md asks for >= 10 timed steps after >= 3 warm-up steps")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    env = _environment(args)
    print(report.header(env), flush=True)
    rows: list[dict[str, Any]] = []
    dlrm_rows: list[dict[str, Any]] = []
    for wl in args.workload:
        if wl in DLRM_WORKLOADS:
            dlrm_rows.extend(_dlrm_rows(args, wl))
            continue
        for kind in args.plans:
            contenders = list(args.contenders)
            notes: list[str] = []
            row: dict[str, Any] = {"workload": wl, "plan": kind, "notes": notes}
            planned = None
            try:
                if kind == PLANNED:
                    planned = planned_plans(
                        get(wl), args.world_size, args.local_size or args.world_size, contenders
                    )
                    row["tables_per_type"] = describe(next(iter(planned.values())))
                    for name, plan in planned.items():
                        notes.append(f"{name}'s planner: {_placement(plan, args.world_size)}")
                else:
                    row["tables_per_type"] = describe(
                        make_plan(kind, get(wl), args.world_size, args.local_size or None)
                    )
            except ValueError as e:
                row["error"] = f"no {kind} plan for {wl} on {args.world_size} ranks: {e}"
                rows.append(row)
                print(report.row_line(row), flush=True)
                continue
            if (
                "embshard" in contenders
                and (why := embshard_missing(set(row["tables_per_type"]))) is not None
            ):
                contenders.remove("embshard")
                notes.append(f"embshard skipped: {why}")
                print(f"note: {wl} {kind}: embshard skipped: {why}", flush=True)
            if not contenders:
                rows.append(row)
                continue
            job = Job(
                workload=wl,
                plan=kind,
                contenders=tuple(contenders),
                steps=args.steps,
                warmup=args.warmup,
                threads=args.threads,
                num_batches=args.batches,
                tolerance=args.tolerance,
                seed=args.seed,
                out_dir="",
                local_size=args.local_size,
                planned=planned,
                profile_steps=args.profile_steps if args.profile else 0,
            )
            started = time.perf_counter()
            ranks, error = spawn(job, args.world_size)
            row.update(report.summarize_timing(ranks, contenders))
            row.update(report.summarize_phases(ranks))
            if error:
                row["error"] = row.get("error") or error
            if not args.no_memory and "error" not in row:
                for name in contenders:
                    mem_job = Job(
                        **{
                            **job.__dict__,
                            "contenders": (name,),
                            "memory_only": True,
                            "steps": args.memory_steps,
                            "warmup": 0,
                        }
                    )
                    mem_ranks, mem_error = spawn(mem_job, args.world_size)
                    row.setdefault("peak_rss_mb", {})[name] = [
                        r.get("peak_rss_mb") for r in mem_ranks
                    ]
                    row.setdefault("rss_before_build_mb", {})[name] = [
                        r.get("rss_before_build_mb") for r in mem_ranks
                    ]
                    if mem_error:
                        row["notes"].append(f"{name} memory run failed: {mem_error}")
            row["wall_s"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(report.row_line(row), flush=True)
    env["load_average_end"] = os.getloadavg()
    result = {"environment": env, "results": rows, "dlrm_results": dlrm_rows}
    paths = report.write(result, Path(args.out))
    print()
    if rows or not dlrm_rows:
        print(report.table(result))
    for row in dlrm_rows:
        print("\n".join(dlrm_run.lines(row)))
    if args.profile:
        print()
        print(report.phase_table(result))
    for p in paths:
        print(f"wrote {p}")
    return 1 if any("error" in r for r in [*rows, *dlrm_rows]) else 0


if __name__ == "__main__":
    sys.exit(main())
