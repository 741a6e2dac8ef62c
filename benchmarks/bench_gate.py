"""Run the pytest-benchmark suites, save the run, and fail on a regression that holds up.

``nox -s bench`` runs this. Steps:

1. the previous saved run under ``benchmarks/results/pytest`` (the highest-numbered JSON) is the
   baseline, if there is one;
2. every benchmark runs once and the run is saved there (``--benchmark-autosave``);
3. a benchmark whose fastest round is more than ``--threshold`` (10%) slower than the
   baseline's is measured again, alone, up to ``--retries`` times; it counts as a regression
   only if every attempt is slower than the threshold (on a machine where other work runs, a
   round is only ever slowed down, and a slowdown by chance rarely repeats three times; a real
   one does). Benchmarks that set ``extra_info["gate"] = "report only"`` (with a ``why``)
   are listed but never fail the gate; ``extra_info["threshold"]`` sets a benchmark's own
   allowed slowdown.

Exit status: pytest's when the suites fail, 1 on a regression, else 0. Arguments after ``--`` go
to pytest (e.g. ``-k kjt``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STORAGE = Path("benchmarks/results/pytest")


def _latest_saved() -> Path | None:
    runs = sorted(STORAGE.rglob("*.json"), key=lambda p: p.name.split("_", 1)[0])
    return runs[-1] if runs else None


def _benchmarks(report: Path) -> dict[str, dict[str, Any]]:
    """Benchmark full name -> its record in a pytest-benchmark JSON report."""
    data = json.loads(report.read_text())
    return {b["fullname"]: b for b in data.get("benchmarks", [])}


def _fastest(records: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Benchmark -> its fastest round (seconds)."""
    return {name: float(b["stats"]["min"]) for name, b in records.items()}


def _pytest(args: list[str], report: Path, *, save: bool) -> int:
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-only",
        f"--benchmark-storage={STORAGE}", f"--benchmark-json={report}",
        *(["--benchmark-autosave"] if save else []), *args,
    ]  # fmt: skip
    return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed slowdown")
    parser.add_argument("--retries", type=int, default=2, help="re-measurements of a suspect")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    baseline_file = _latest_saved()
    baseline = _fastest(_benchmarks(baseline_file)) if baseline_file else {}
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp, "run.json")
        code = _pytest(["benchmarks", *args.pytest_args], first, save=True)
        if code != 0:
            return code
        if not baseline:
            print("bench gate: no previous saved run; this run is the baseline")
            return 0
        records = _benchmarks(first)
        extra = {name: b.get("extra_info", {}) for name, b in records.items()}
        limit = {n: 1.0 + float(e.get("threshold", args.threshold)) for n, e in extra.items()}
        ungated = {
            n: str(e.get("why", "")) for n, e in extra.items() if e.get("gate") == "report only"
        }
        best = _fastest(records)
        suspects = [
            n
            for n, t in best.items()
            if n in baseline and n not in ungated and t > baseline[n] * limit[n]
        ]
        for attempt in range(args.retries):
            if not suspects:
                break
            print(f"bench gate: measuring again ({attempt + 1}/{args.retries}): {suspects}")
            again = Path(tmp, f"again{attempt}.json")
            if _pytest(suspects, again, save=False) != 0:
                return 1
            for name, t in _fastest(_benchmarks(again)).items():
                best[name] = min(best[name], t)
            suspects = [n for n in suspects if best[n] > baseline[n] * limit[n]]
    print(f"bench gate: baseline {baseline_file.name}; fastest round against it:")
    for name in sorted(n for n in best if n in baseline):
        ratio = best[name] / baseline[name]
        flag = "  REGRESSION" if name in suspects else ""
        if name in ungated:
            flag = "  (report only: " + ungated[name] + ")"
        print(f"  {ratio:6.3f}  {name}{flag}")
    if suspects:
        print(f"bench gate: {len(suspects)} regression(s) above their threshold, repeated")
        return 1
    print("bench gate: no regression above the thresholds (10% unless a benchmark sets one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
