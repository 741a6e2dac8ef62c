"""asv: import time of each embshard package in a fresh interpreter, beyond torch's own.

Each figure is the median of ``REPEATS`` fresh interpreters, each timing ``import <package>``
after ``import torch`` (a single cold import is too noisy on a shared machine to compare
commits at a 10% threshold).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from .origin import check_same

REPEATS = 3


def _cost(module: str) -> float:
    code = (
        "import time, torch; t = time.perf_counter(); "
        f"import {module}; print(time.perf_counter() - t); print({module}.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, where = out.stdout.strip().splitlines()[-2:]
    check_same(str(Path(where).parent), "the timed interpreter", module)
    return float(seconds)


class ImportTime:
    params = ["embshard_types", "embshard_optim", "embshard_kernels", "embshard_dist"]
    param_names = ["package"]
    timeout = 180

    def track_import_seconds(self, package: str) -> float:
        return statistics.median(_cost(package) for _ in range(REPEATS))

    track_import_seconds.unit = "seconds"  # type: ignore[attr-defined]
