"""Import cost of each embshard package beyond torch's own, in fresh interpreters.

Runs ``python -X importtime -c "import torch; import <pkg>"`` several times per package and takes
the median of the cumulative microseconds of every module the package's import added (the
top-level ``import <pkg>`` line covers them all). Wall-clock import timings on a shared 2-core
machine swing by ±0.3 s; ``-X importtime`` counts only time spent importing, which is steadier.

Usage: ``python benchmarks/import_time.py [--repeat 7] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PACKAGES = ("embshard_types", "embshard_optim", "embshard_kernels", "embshard_dist")


def import_cost_s(module: str) -> float:
    """Seconds spent importing ``module`` after torch is already imported."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import torch; import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    total_us = 0
    seen_torch = False
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.removeprefix("import time:").split("|")
        cumulative = cumulative.strip()
        if not cumulative.isdigit():
            continue
        depth = len(name) - len(name.lstrip())
        if name.strip() == "torch" and depth == 1:
            seen_torch = True
        elif seen_torch and depth == 1:
            total_us += int(cumulative)
    return total_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("packages", nargs="*", default=list(PACKAGES))
    args = parser.parse_args()
    figures = {}
    for module in args.packages:
        samples = [import_cost_s(module) for _ in range(args.repeat)]
        figures[module] = statistics.median(samples)
        print(
            f"{module:18} {figures[module] * 1000:7.1f} ms beyond torch (median of {args.repeat})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
