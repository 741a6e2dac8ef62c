"""Where embshard is imported from, so that a benchmark's own interpreters (ranks, import
timings) are checked to run the same commit's packages as asv's benchmark process."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str = "embshard_dist") -> str:
    """The folder ``module`` imports from in this interpreter (found, not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return f"nowhere ({module} is not importable)"
    return str(Path(spec.origin).parent)


def check_same(seen: str, what: str, module: str = "embshard_dist") -> None:
    """Raise when ``what`` imported ``module`` from ``seen``, not from where this process does."""
    here = package_dir(module)
    if seen != here:
        raise RuntimeError(
            f"{what} imported {module} from {seen}, the benchmark from {here}: the commit's "
            "packages must lead PYTHONPATH (asv_history.py sets it)"
        )
