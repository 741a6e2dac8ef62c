"""Import cost of each embshard package beyond torch's own, in fresh interpreters.

Runs ``python -X importtime -c "import torch; import <pkg>"`` several times per package and takes
the median of the cumulative microseconds of every module the package's import added (the
top-level ``import <pkg>`` line covers them all). Wall-clock import timings on a shared 2-core
machine swing by ±0.3 s; ``-X importtime`` counts only time spent importing, which is steadier.

Usage: ``python benchmarks/import_time.py [--repeat 7] [--json out.json]``

``--torchrec`` compares what a user pulls in, side by side with TorchRec, in the current
interpreter's environment (TorchRec is installed only in the ``nox -s compare`` environment):
``import embshard_dist``, ``import embshard_dist; embshard_dist.DistributedModelParallel`` (its
public names load on first use) and ``import torchrec``, each in a fresh interpreter, the three
interleaved (the order rotates every round) after one untimed round, median of ``--repeat``. Each
interpreter times itself with ``time.perf_counter``: the import of torch, then the library's
import beyond torch; the ratio embshard / TorchRec is given for both (target: at most 0.5 beyond
torch). Usage: ``.nox/compare/bin/python benchmarks/import_time.py --torchrec [--repeat 9]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib.metadata import version

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


SIDE_BY_SIDE = {
    "embshard_dist": "import embshard_dist",
    "embshard_dist.DistributedModelParallel": (
        "import embshard_dist; embshard_dist.DistributedModelParallel"
    ),
    "torchrec": "import torchrec",
}
_TIMER = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
    "{statement}\n"
    "t2 = time.perf_counter(); print(t1 - t0, t2 - t1)"
)


def wall_import_s(statement: str) -> tuple[float, float]:
    """``(torch, beyond torch)`` wall seconds of ``statement`` in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", _TIMER.format(statement=statement)],
        capture_output=True,
        text=True,
        check=True,
    )
    torch_s, beyond_s = (float(x) for x in out.stdout.split()[-2:])
    return torch_s, beyond_s


def side_by_side(repeat: int) -> dict[str, dict[str, float]]:
    """Interleaved fresh-interpreter imports of embshard_dist and TorchRec; medians in ms."""
    names = list(SIDE_BY_SIDE)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for round_ in range(repeat + 1):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            timing = wall_import_s(SIDE_BY_SIDE[name])
            if round_:  # round 0 warms the file cache
                samples[name].append(timing)
    return {
        n: {
            "torch_ms": statistics.median(t for t, _ in s) * 1000,
            "beyond_torch_ms": statistics.median(b for _, b in s) * 1000,
            "total_ms": statistics.median(t + b for t, b in s) * 1000,
        }
        for n, s in samples.items()
    }


def _print_side_by_side(figures: dict[str, dict[str, float]], repeat: int) -> None:
    import torch

    print(
        f"fresh interpreters, interleaved, median of {repeat}; Python {platform.python_version()}"
        f", torch {torch.__version__}, fbgemm-gpu-cpu {version('fbgemm-gpu-cpu')}, torchrec "
        f"{version('torchrec')}, {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(f"{'import':42} {'beyond torch':>13} {'with torch':>11}")
    for name, f in figures.items():
        print(f"{name:42} {f['beyond_torch_ms']:10.0f} ms {f['total_ms']:8.0f} ms")
    rec = figures["torchrec"]
    for name in ("embshard_dist", "embshard_dist.DistributedModelParallel"):
        f = figures[name]
        print(
            f"{name} / torchrec: {f['beyond_torch_ms'] / rec['beyond_torch_ms']:.2f} beyond torch "
            f"(target <= 0.5), {f['total_ms'] / rec['total_ms']:.2f} with torch"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--torchrec",
        action="store_true",
        help="embshard_dist vs torchrec side by side (needs torchrec: the nox compare env)",
    )
    parser.add_argument("packages", nargs="*", default=list(PACKAGES))
    args = parser.parse_args()
    if args.torchrec:
        try:
            import torchrec  # noqa: F401
        except ImportError as error:
            raise SystemExit(
                f"--torchrec needs TorchRec in this interpreter ({error}); run it with the "
                "nox compare environment: .nox/compare/bin/python benchmarks/import_time.py "
                "--torchrec"
            ) from None
        side = side_by_side(args.repeat)
        _print_side_by_side(side, args.repeat)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(side, f, indent=2)
        return
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
