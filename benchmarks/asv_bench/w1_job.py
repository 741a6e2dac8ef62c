"""W1 or W2 on 2 gloo processes (1 thread each) for every sharding type, embshard alone, one job.

Run as ``python -m benchmarks.asv_bench.w1_job --out FILE [--workload W2]`` from the repository
root (the asv benchmarks in ``bench_w1`` and ``bench_w2`` do so once per commit, in a fresh
interpreter, so asv's own process never forks ranks). It reuses the side-by-side harness
(``benchmarks/compare``): the same
workload, plans, optimizer (RowWiseAdagrad fused in backward) and timed step, with only the
embshard contender. Per plan it starts one fresh group of ranks (so peak RSS is that plan's own)
and writes, as JSON::

    {"<plan>": {"step_ms": slowest rank's median ms, "rank_median_ms": [...],
                "peak_rss_mb": [rank 0, rank 1], "wall_s": ...}
     or {"error": "why it could not run"}, ...}

Nothing is imported from ``benchmarks.compare`` at module level: asv imports every module of
``asv_bench`` while discovering benchmarks, where the repository root is not on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


def run_plan(kind: str, steps: int, warmup: int, workload: str = "W1") -> dict[str, Any]:
    """One ``workload`` job of sharding ``kind`` on fresh ranks: step time and peak RSS per rank."""
    from benchmarks.compare.plans import describe, make_plan
    from benchmarks.compare.run import embshard_missing, spawn
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
    ranks, error = spawn(job, WORLD_SIZE)
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
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, Any] = {}
    for kind in args.plans:
        try:
            results[kind] = run_plan(kind, args.steps, args.warmup, args.workload)
        except Exception as e:  # one plan failing must not hide the others' figures
            results[kind] = {"error": f"{args.workload} {kind} failed: {type(e).__name__}: {e}"}
        print(f"{args.workload} {kind}: {results[kind]}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
