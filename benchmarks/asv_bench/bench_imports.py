"""asv: import time of each embshard package in a fresh interpreter, beyond torch's own."""

from __future__ import annotations

import subprocess
import sys


def _cost(module: str) -> float:
    code = (
        "import time, torch; t = time.perf_counter(); "
        f"import {module}; print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


class ImportTime:
    params = ["embshard_types", "embshard_optim", "embshard_kernels", "embshard_dist"]
    param_names = ["package"]
    timeout = 120

    def track_import_seconds(self, package: str) -> float:
        return _cost(package)

    track_import_seconds.unit = "seconds"  # type: ignore[attr-defined]
