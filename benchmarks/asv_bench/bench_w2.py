"""asv: W2 step time and peak memory per rank for every sharding type and a mixed plan.

W2 (26 Criteo-like tables capped at 200,000 rows x 128, 1-40 Zipf ids per bag, 512 samples per
rank) on 2 gloo processes with 1 thread each, RowWiseAdagrad fused in backward, through the
same job as W1 (``w1_job --workload W2``): all plans run once per commit in ``setup_cache``,
one fresh group of ranks per plan, and the ``track_`` benchmarks read that cache. Each graph
shows every sharding type (one series per plan):

* ``W2StepTime.track_step_ms``: the slowest rank's median step (forward + backward + update)
  in ms;
* ``W2PeakMemory.track_peak_rss_mb``: peak resident memory of each rank in MB (whole process).

``EMBSHARD_ASV_W2_STEPS`` / ``EMBSHARD_ASV_W2_WARMUP`` change the step counts and
``EMBSHARD_ASV_W2_PLANS`` (comma-separated) runs only some plans (the others are skipped).
"""

from __future__ import annotations

import os
from typing import Any

from .bench_w1 import PLANS, figures, run_job, skip_unless_run

STEPS = int(os.environ.get("EMBSHARD_ASV_W2_STEPS", "5"))
WARMUP = int(os.environ.get("EMBSHARD_ASV_W2_WARMUP", "2"))


def run_w2() -> dict[str, Any]:
    """Every W2 plan on fresh ranks (``bench_w1.run_job``)."""
    return run_job("W2", STEPS, WARMUP)


run_w2.timeout = 1800  # type: ignore[attr-defined]


class W2StepTime:
    params = PLANS
    param_names = ["plan"]
    timeout = 1800
    setup_cache = staticmethod(run_w2)

    def setup(self, cache: dict[str, Any], plan: str) -> None:
        skip_unless_run(cache, plan, "W2")

    def track_step_ms(self, cache: dict[str, Any], plan: str) -> float:
        return float(figures(cache, plan)["step_ms"])

    track_step_ms.unit = "ms"  # type: ignore[attr-defined]


class W2PeakMemory:
    params = [PLANS, [0, 1]]
    param_names = ["plan", "rank"]
    timeout = 1800
    setup_cache = staticmethod(run_w2)

    def setup(self, cache: dict[str, Any], plan: str, rank: int) -> None:
        skip_unless_run(cache, plan, "W2")

    def track_peak_rss_mb(self, cache: dict[str, Any], plan: str, rank: int) -> float:
        return float(figures(cache, plan)["peak_rss_mb"][rank])

    track_peak_rss_mb.unit = "MB"  # type: ignore[attr-defined]
