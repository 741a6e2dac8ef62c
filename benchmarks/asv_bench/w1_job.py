"""W1 or W2 on 2 gloo processes (1 thread each) for every sharding type, embshard alone, one job.

Run as ``python -m benchmarks.asv_bench.w1_job --out FILE [--workload W2]`` from the repository
root (the asv benchmarks in ``bench_w1`` and ``bench_w2`` do so once per commit, in a fresh
interpreter, so asv's own process never forks ranks). It reuses the side-by-side harness
(``benchmarks/compare``): the same
workload, plans, optimizer (RowWiseAdagrad fused in backward) and timed step, with only the
embshard contender. Per plan it starts one fresh group of ranks (so peak RSS is that plan's own),
forked from this process once it has imported torch, embshard and the harness: each rank starts
where a fresh interpreter would be after those imports, without paying for them again. Its peak
RSS counts the shards and the library pages the rank touches (pages a fresh process maps while
importing and never touches again are not counted). It writes, as JSON::

    {"<plan>": {"step_ms": slowest rank's median ms, "rank_median_ms": [...],
                "peak_rss_mb": [rank 0, rank 1], "wall_s": ...}
     or {"error": "why it could not run"}, ..., "embshard_dist_from": folder}

Nothing is imported from ``benchmarks.compare`` at module level: asv imports every module of
``asv_bench`` while discovering benchmarks, where the repository root is not on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLANS = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "grid_shard",
    "mixed",
)
WORLD_SIZE = 2
ORIGIN = "embshard_dist_from"
"""The key of the folder the job imported ``embshard_dist`` from."""


def spawn_forked(job: Any, world: int) -> tuple[list[dict[str, Any]], str | None]:
    """``benchmarks.compare.run.spawn`` with the ranks forked from this process: run ``job`` on
    ``world`` fresh ranks; each rank's result and the error, if any."""
    import torch.multiprocessing as mp

    from benchmarks.compare.common import free_port
    from benchmarks.compare.worker import Job, run_rank

    with tempfile.TemporaryDirectory(prefix="embshard-asv-ranks-") as tmp:
        job = Job(**{**job.__dict__, "out_dir": tmp})
        error = None
        try:
            mp.start_processes(
                run_rank, args=(world, free_port(), job), nprocs=world, start_method="fork"
            )
        except Exception as e:  # a rank raised: keep what the ranks wrote, report the error
            lines = str(e).strip().splitlines()
            error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        ranks = []
        for r in range(world):
            p = Path(tmp, f"rank{r}.json")
            ranks.append(json.loads(p.read_text()) if p.exists() else {"rank": r})
    return ranks, error


def run_plan(kind: str, steps: int, warmup: int, workload: str = "W1") -> dict[str, Any]:
    """One ``workload`` job of sharding ``kind`` on fresh ranks: step time and peak RSS per rank."""
    from benchmarks.compare.plans import describe, make_plan
    from benchmarks.compare.run import embshard_missing
    from benchmarks.compare.worker import Job
    from benchmarks.compare.workloads import get

    started = time.perf_counter()
    kinds = set(describe(make_plan(kind, get(workload), WORLD_SIZE, None)))
    why = embshard_missing(kinds)
    if why is not None:
        return {"error": f"embshard cannot run {workload} {kind}: {why}"}
    job = Job(
        workload=workload,
        plan=kind,
        contenders=("embshard",),
        steps=steps,
        warmup=warmup,
        threads=1,
        num_batches=4,
        tolerance=1e-5,
        seed=0,
        out_dir="",
    )
    ranks, error = spawn_forked(job, WORLD_SIZE)
    errors = [r["error"] for r in ranks if "error" in r] + ([error] if error else [])
    skipped = [v for r in ranks for v in r.get("skipped", {}).values()]
    if errors or skipped or not all("step_ms" in r for r in ranks):
        why = "; ".join(errors + skipped) or "a rank wrote no step times"
        return {"error": f"{workload} {kind} failed: {why}"}
    medians = [statistics.median(r["step_ms"]["embshard"]) for r in ranks]
    return {
        "step_ms": max(medians),
        "rank_median_ms": medians,
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per plan")
    parser.add_argument("--workload", default="W1", choices=("W1", "W2"))
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts: forked ranks must find no pool
    import torch

    import benchmarks.compare.worker  # noqa: F401  (imported once, before the ranks fork)

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for kind in args.plans:
        try:
            results[kind] = run_plan(kind, args.steps, args.warmup, args.workload)
        except Exception as e:  # one plan failing must not hide the others' figures
            results[kind] = {"error": f"{args.workload} {kind} failed: {type(e).__name__}: {e}"}
        print(f"{args.workload} {kind}: {results[kind]}", file=sys.stderr, flush=True)
    from benchmarks.asv_bench.origin import package_dir

    results[ORIGIN] = package_dir()
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
