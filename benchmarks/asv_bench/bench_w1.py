"""asv: W1 step time and peak memory per rank for every sharding type and a mixed plan.

W1 (4 tables of 100,000 x 64, 10-30 uniform ids per bag, 1,024 samples per rank) on 2 gloo
processes with 1 thread each, RowWiseAdagrad fused in backward, through the side-by-side
harness's embshard half (``benchmarks/compare``). All plans run once per commit, in
``setup_cache`` (one fresh interpreter running ``w1_job``, one fresh group of ranks per plan);
the ``track_`` benchmarks only read that cache:

* ``W1StepTime.track_step_ms``: the slowest rank's median step (forward + backward + update)
  in ms, over ``STEPS`` timed steps after ``WARMUP`` warm-up steps;
* ``W1PeakMemory.track_peak_rss_mb``: peak resident memory of each rank in MB (``ru_maxrss``,
  the whole process: the shards, and the interpreter, torch and FBGEMM pages the rank touches;
  ranks are forked from the job's process after its imports, see ``w1_job``).

A plan embshard cannot run at the benchmarked commit fails its benchmarks with the reason.
Set ``EMBSHARD_ASV_W1_STEPS`` / ``EMBSHARD_ASV_W1_WARMUP`` to change the step counts, and
``EMBSHARD_ASV_W1_PLANS`` (comma-separated) to run only some plans (the others are skipped;
``asv_history.py compare`` uses it to re-measure only the plans it suspects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .origin import check_same
from .w1_job import ORIGIN
from .w1_job import PLANS as W1_JOB_PLANS  # asv imports this package without the root

ROOT = Path(__file__).resolve().parents[2]
PLANS = list(W1_JOB_PLANS)
STEPS = int(os.environ.get("EMBSHARD_ASV_W1_STEPS", "5"))
WARMUP = int(os.environ.get("EMBSHARD_ASV_W1_WARMUP", "2"))


def run_job(workload: str, steps: int, warmup: int) -> dict[str, Any]:
    """Every plan of ``workload`` on fresh ranks; per plan its figures or ``{"error": ...}``.

    ``EMBSHARD_ASV_<workload>_PLANS`` (comma-separated) limits the plans run.
    """
    with tempfile.TemporaryDirectory(prefix=f"embshard-asv-{workload.lower()}-") as tmp:
        out = Path(tmp, f"{workload.lower()}.json")
        cmd = [sys.executable, "-m", "benchmarks.asv_bench.w1_job", "--out", str(out)]
        cmd += ["--steps", str(steps), "--warmup", str(warmup), "--workload", workload]
        only = os.environ.get(f"EMBSHARD_ASV_{workload}_PLANS", "")
        cmd += ["--plans", *only.split(",")] if only else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the {workload} job exited with status {proc.returncode}:\n{tail}")
        results: dict[str, Any] = json.loads(out.read_text())
    check_same(results.pop(ORIGIN, "an unknown folder"), f"the {workload} job")
    return results


def run_w1() -> dict[str, Any]:
    """Every W1 plan on fresh ranks (``run_job``)."""
    return run_job("W1", STEPS, WARMUP)


run_w1.timeout = 900  # type: ignore[attr-defined]


def skip_unless_run(cache: dict[str, Any], plan: str, workload: str = "W1") -> None:
    """Make asv record ``plan`` as skipped when the job left it out on purpose."""
    if plan not in cache:  # asv's convention: NotImplementedError in setup means "skipped"
        raise NotImplementedError(f"{workload} {plan} not run (EMBSHARD_ASV_{workload}_PLANS)")


def figures(cache: dict[str, Any], plan: str) -> dict[str, Any]:
    """The job's figures of ``plan``; its error raised when it could not run."""
    entry: dict[str, Any] = cache[plan]
    if "error" in entry:
        raise RuntimeError(entry["error"])
    return entry


class W1StepTime:
    params = PLANS
    param_names = ["plan"]
    timeout = 900
    setup_cache = staticmethod(run_w1)

    def setup(self, cache: dict[str, Any], plan: str) -> None:
        skip_unless_run(cache, plan)

    def track_step_ms(self, cache: dict[str, Any], plan: str) -> float:
        return float(figures(cache, plan)["step_ms"])

    track_step_ms.unit = "ms"  # type: ignore[attr-defined]


class W1PeakMemory:
    params = [PLANS, [0, 1]]
    param_names = ["plan", "rank"]
    timeout = 900
    setup_cache = staticmethod(run_w1)

    def setup(self, cache: dict[str, Any], plan: str, rank: int) -> None:
        skip_unless_run(cache, plan)

    def track_peak_rss_mb(self, cache: dict[str, Any], plan: str, rank: int) -> float:
        return float(figures(cache, plan)["peak_rss_mb"][rank])

    track_peak_rss_mb.unit = "MB"  # type: ignore[attr-defined]
