"""asv: a small DLRM's training step, ``TrainPipelineSparseDist`` against the plain loop.

2 gloo processes with 1 thread each, per sharding type (table-wise, row-wise), through
``pipeline_job``: the job runs once per commit in ``setup_cache`` (one fresh interpreter, one
fresh group of ranks per sharding type) and the benchmark reads that cache. One graph shows
both loops for every sharding type:

* ``PipelineStep.track_step_ms``: ms per training step (forward, backward, optimizer), the
  slowest rank's, best of the job's alternating rounds.

A commit without ``embshard_dist.train_pipeline`` records the benchmark as skipped.
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
from .pipeline_job import LOOPS, SHARDINGS  # asv imports this package without the root
from .w1_job import ORIGIN

ROOT = Path(__file__).resolve().parents[2]


def run_pipeline_job() -> dict[str, Any]:
    """Both loops for every sharding type on fresh ranks (``pipeline_job``)."""
    with tempfile.TemporaryDirectory(prefix="embshard-asv-pipeline-") as tmp:
        out = Path(tmp, "pipeline.json")
        cmd = [sys.executable, "-m", "benchmarks.asv_bench.pipeline_job", "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the pipeline job exited with status {proc.returncode}:\n{tail}")
        results: dict[str, Any] = json.loads(out.read_text())
    check_same(results.pop(ORIGIN, "an unknown folder"), "the pipeline job")
    return results


run_pipeline_job.timeout = 600  # type: ignore[attr-defined]


class PipelineStep:
    params = [list(LOOPS), list(SHARDINGS)]
    param_names = ["loop", "sharding"]
    timeout = 600
    setup_cache = staticmethod(run_pipeline_job)

    def setup(self, cache: dict[str, Any], loop: str, sharding: str) -> None:
        if "missing" in cache[sharding]:  # asv's convention: NotImplementedError means skipped
            raise NotImplementedError(f"no train pipeline at this commit: {cache[sharding]}")

    def track_step_ms(self, cache: dict[str, Any], loop: str, sharding: str) -> float:
        entry = cache[sharding]
        if "error" in entry:
            raise RuntimeError(entry["error"])
        return float(entry[loop])

    track_step_ms.unit = "ms"  # type: ignore[attr-defined]
