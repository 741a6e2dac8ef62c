"""Run the asv suite against commits of embshard, and fail on regressions between two of them.

asv's ``existing`` environment benchmarks whatever the interpreter imports; this driver makes
that each commit's own embshard without touching the environment. For every commit it exports
``packages/`` of that commit (``git archive``) into a temporary folder, checks in a fresh
interpreter that the four packages import from there when their ``src`` folders lead
``PYTHONPATH``, then runs ``asv run --python=same --set-commit-hash=<sha>`` with
``ASV_PYTHONPATH`` and ``PYTHONPATH`` set to those folders (asv's benchmark processes, and the
interpreters and ranks they start, import the commit's packages), so the results are recorded
against that commit. The packages are pure Python, so their sources are what a wheel
of the commit would install; nothing is built or installed, and the environment's editable
installs of the working tree stay as they are. The benchmark code is always the working tree's
(``benchmarks/asv_bench``), run with asv's forkserver launch method (the benchmark modules and
torch imported once per commit). A commit whose packages are absent or fail to import is
reported and skipped; a commit whose ``packages/`` tree equals one benchmarked in the same run
gets that one's results.

Usage (run with the Python of the environment that holds asv, e.g. ``nox -s asv``)::

    python benchmarks/asv_history.py run [REV ...] [--commits N] [--quick] [--no-publish]
    python benchmarks/asv_history.py compare A B [--factor 1.10] [--quick] [--rerun] [--confirm 2]

``run`` with no revision: HEAD (always run) plus those of the last ``N`` (default 4) commits of
``main`` that touch ``packages/`` whose results are missing or were recorded with other
benchmark code; then ``asv publish`` (HTML in ``benchmarks/html``), made self-contained by
``dashboard/vendor.py`` (asv's CDN scripts and styles replaced by pinned npm copies).
``compare``: runs A and B where their results are missing or stale (or always with
``--rerun``), prints ``asv compare A B --split``, then exits 1 if any benchmark of B is worse
than A's by more than ``factor`` (slower, bigger, or failing where A did not), 0 otherwise.
Figures flagged at first are re-measured ``--confirm`` more times per commit, interleaved
(B A, A B, ...), into a scratch results folder; the best figure of each commit decides (noise
on a shared machine only ever adds time). Exit status 2: a revision could not be benchmarked.
"""

from __future__ import annotations

import argparse
import ast
import io
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
PACKAGES = ("embshard-types", "embshard-optim", "embshard-kernels", "embshard-dist")
MODULES = tuple(p.replace("-", "_") for p in PACKAGES)
BRANCH = "main"
PLAN_WORKLOADS = ("W1", "W2")
"""The distributed jobs (``asv_bench/bench_w1``, ``bench_w2``) whose plans can be re-run alone."""


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=BENCH, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


ROOT = Path(_git("rev-parse", "--show-toplevel"))


def _asv(*args: str, check: bool = False, env: dict[str, str] | None = None) -> int:
    cmd = [sys.executable, "-m", "asv", *args]
    print(f"$ asv {' '.join(args)}", flush=True)
    rc = subprocess.run(cmd, cwd=BENCH, env=env).returncode
    if check and rc != 0:
        raise SystemExit(f"asv {' '.join(args)} failed with status {rc}")
    return rc


# ----- results on disk -------------------------------------------------------------------------


def _config() -> dict[str, Any]:
    return json.loads((BENCH / "asv.conf.json").read_text())


def _results_dir() -> Path:
    return BENCH / _config().get("results_dir", "results")


def _machine() -> str:
    """The machine name ``asv machine --yes`` gives this host (its node name)."""
    return platform.node()


def _load_results(sha: str, results_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Benchmark name -> {"result", "params", "version", ...} recorded for commit ``sha``."""
    merged: dict[str, dict[str, Any]] = {}
    folder = (results_dir or _results_dir()) / _machine()
    files = [p for p in folder.glob(f"{sha[:8]}-*.json")] if folder.is_dir() else []
    for path in sorted(files, key=lambda p: p.stat().st_mtime):
        data = json.loads(path.read_text())
        if data.get("commit_hash") != sha:
            continue
        columns = data.get("result_columns", [])
        for name, row in data.get("results", {}).items():
            merged[name] = dict(zip(columns, row, strict=False))
    return merged


def _current_versions() -> dict[str, str]:
    path = _results_dir() / "benchmarks.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {k: v["version"] for k, v in data.items() if isinstance(v, dict) and "version" in v}


def _complete(sha: str) -> bool:
    """Whether ``sha`` has results for every current benchmark, from the current benchmark code."""
    versions = _current_versions()
    got = _load_results(sha)
    return bool(versions) and all(
        name in got and got[name].get("version") == v for name, v in versions.items()
    )


def _discover() -> None:
    """Refresh ``benchmarks.json`` from the working tree's benchmarks (runs nothing)."""
    _asv("run", "--python=same", "--bench", "just-discover", check=True)


# ----- staging a commit ------------------------------------------------------------------------


def _stage_commit(sha: str, tmp: Path) -> list[Path] | str:
    """Export commit ``sha``'s four packages into ``tmp``; their source folders, or why not.

    The packages are pure Python: their ``src`` folders, first on ``PYTHONPATH``, are what a
    wheel of that commit would install. A fresh interpreter checks that each package imports
    from there (not from the working tree the environment holds editable).
    """
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "packages"], cwd=ROOT, capture_output=True
    )
    if archive.returncode != 0:
        return f"git archive failed: {archive.stderr.decode().strip()}"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    srcs = [tmp / "packages" / p / "src" for p in PACKAGES]
    absent = [
        f"{p}/src/{m}"
        for p, m, s in zip(PACKAGES, MODULES, srcs, strict=True)
        if not (s / m / "__init__.py").exists()
    ]
    if absent:
        return f"the commit has no {', '.join(absent)}"
    probe = (
        "import sys, importlib\n"
        f"for m in {MODULES!r}:\n"
        "    f = importlib.import_module(m).__file__ or ''\n"
        f"    if not f.startswith({str(tmp)!r}):\n"
        "        sys.exit(f'{m} imports from {f}, not from the commit')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, srcs))}
    imp = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp, env=env
    )
    if imp.returncode != 0:
        return "import failed: " + " | ".join(imp.stderr.strip().splitlines()[-3:])
    return srcs


def _asv_run(
    sha: str, quick: bool, bench: str | None, env: dict[str, str], *, config: Path | None = None
) -> int:
    """``asv run`` recording commit ``sha``. The forkserver launch method imports the benchmark
    modules (torch with them) once per run and forks each benchmark from there, instead of a
    fresh interpreter per benchmark and parameter."""
    args = ["--config", str(config)] if config else []
    args += ["run", "--python=same", f"--set-commit-hash={sha}", "--show-stderr"]
    args += ["--launch-method=forkserver"]
    args += ["--quick"] if quick else []
    args += ["--bench", bench] if bench else []
    return _asv(*args, env=env)


def _each_commit(shas: list[str], action: Callable[[str, dict[str, str]], str]) -> dict[str, str]:
    """Stage each commit in turn (repeats allowed) and call ``action`` on it with the variables
    that make asv's benchmarks import it; commit -> status. ``ASV_PYTHONPATH`` puts the staged
    sources first on ``sys.path`` of asv's benchmark processes; ``PYTHONPATH`` (which asv's
    ``existing`` environment passes through unchanged) does so for the interpreters the
    benchmarks start themselves (ranks, import timings). A commit whose packages cannot be
    staged or imported gets "skipped: why". The environment itself is never changed."""
    status: dict[str, str] = {}
    for sha in shas:
        print(f"\n=== {sha[:8]} {_git('log', '-1', '--format=%s', sha)[:70]}", flush=True)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="embshard-asv-") as tmp:
            staged = _stage_commit(sha, Path(tmp))
            if isinstance(staged, str):
                status[sha] = f"skipped: {staged}"
                print(f"skipped {sha[:8]}: {staged}", flush=True)
                continue
            path = os.pathsep.join(map(str, staged))
            env = {**os.environ, "ASV_PYTHONPATH": path, "PYTHONPATH": path}
            status[sha] = action(sha, env)
        print(f"{sha[:8]}: {status[sha]} ({time.perf_counter() - started:.0f} s)", flush=True)
    return status


def _packages_tree(sha: str) -> str:
    """The git tree of ``packages/`` at ``sha`` (equal trees: the same code is benchmarked)."""
    return _git("rev-parse", f"{sha}:packages")


def _copy_results(src: str, dst: str) -> None:
    """Record ``src``'s results for ``dst`` too (same ``packages/`` tree), at ``dst``'s date."""
    date = int(_git("log", "-1", "--format=%at", dst)) * 1000
    folder = _results_dir() / _machine()
    for path in sorted(folder.glob(f"{src[:8]}-*.json")):
        data = json.loads(path.read_text())
        if data.get("commit_hash") != src:
            continue
        data.update(commit_hash=dst, date=date)
        (folder / f"{dst[:8]}-{data['env_name']}.json").write_text(json.dumps(data))


def _run_commits(shas: list[str], quick: bool, bench: str | None = None) -> dict[str, str]:
    """Benchmark each commit into the results; commit -> "ok" or why not. A commit whose
    ``packages/`` tree equals one benchmarked before it in ``shas`` gets that one's results."""
    first: dict[str, str] = {}
    twins: dict[str, list[str]] = {}
    for sha in shas:
        tree = _packages_tree(sha)
        if tree in first:
            twins[first[tree]].append(sha)
        else:
            first[tree] = sha
            twins[sha] = []

    def action(sha: str, env: dict[str, str]) -> str:
        rc = _asv_run(sha, quick, bench, env)
        return "ok" if rc == 0 else f"asv run exited {rc} (some benchmarks failed)"

    status = _each_commit(list(twins), action)
    for sha, copies in twins.items():
        for twin in copies:
            if not status[sha].startswith("skipped"):
                _copy_results(sha, twin)
            status[twin] = f"{status[sha]} (same packages/ as {sha[:8]}: its results)"
            print(f"{twin[:8]}: {status[twin]}", flush=True)
    return {sha: status[sha] for sha in shas}


# ----- commands --------------------------------------------------------------------------------


def _resolve(rev: str) -> str:
    return _git("rev-parse", "--verify", f"{rev}^{{commit}}")


def cmd_run(args: argparse.Namespace) -> int:
    _asv("machine", "--yes", check=True)
    if args.revs:
        shas = list(dict.fromkeys(_resolve(r) for r in args.revs))
    else:
        head = _resolve("HEAD")
        _discover()
        history = _git("rev-list", f"--max-count={args.commits}", BRANCH, "--", ":(top)packages")
        shas = [head] + [s for s in history.split() if s != head and not _complete(s)]
    print("commits to benchmark: " + " ".join(s[:8] for s in shas), flush=True)
    status = _run_commits(shas, args.quick, args.bench)
    if not args.no_publish:
        _publish()
    print("\nsummary:")
    for sha, s in status.items():
        print(f"  {sha[:8]}  {s}")
    return 0 if all(s.startswith("ok") for s in status.values()) else 2


def _publish() -> None:
    """``asv publish``, then make the HTML self-contained (pinned scripts and styles beside it)."""
    from dashboard.vendor import VendorError, publish

    _asv("publish", check=True)
    html_dir = BENCH / _config().get("html_dir", "html")
    try:
        files = publish(html_dir)
    except VendorError as err:
        raise SystemExit(f"the dashboard needs the network to display: {err}") from err
    print(f"dashboard: {html_dir}/index.html ({len(files)} pinned asset files, no network needed)")


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _combos(entry: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The parameter combinations of one recorded benchmark, in asv's result order."""
    params = [[ast.literal_eval(v) for v in p] for p in entry.get("params") or []]
    return list(itertools.product(*params))


def _figures(entry: dict[str, Any]) -> list[Any]:
    result = entry.get("result")
    return result if isinstance(result, list) else [result]


def _overlap(hi_a: Any, lo_b: Any) -> bool:
    """Whether B's lower 99% confidence bound is at or below A's upper one (both known)."""
    if hi_a is None or lo_b is None or _nan(hi_a) or _nan(lo_b):
        return False
    return bool(lo_b <= hi_a)


def _flag(a: dict[str, Any], b: dict[str, Any], factor: float) -> list[int]:
    """Indices of the parameter combinations where ``b`` is worse than ``a`` by ``factor``:
    larger by more than the factor (unless both sides have confidence intervals and they
    overlap, as ``asv compare`` treats them), or failing where ``a`` did not."""
    ra, rb = _figures(a), _figures(b)
    ci_a = a.get("stats_ci_99_b") or []
    ci_b = b.get("stats_ci_99_a") or []
    out = []
    for i, (x, y) in enumerate(zip(ra, rb, strict=False)):
        if x is None or _nan(x) or (y is not None and _nan(y)):
            continue
        if y is None:
            out.append(i)
            continue
        if x <= 0 or y / x <= factor:
            continue
        hi_a = ci_a[i] if i < len(ci_a) else None
        lo_b = ci_b[i] if i < len(ci_b) else None
        if _overlap(hi_a, lo_b):
            continue
        out.append(i)
    return out


Key = tuple[str, int]
"""A benchmark name and the index of one of its parameter combinations."""


def _label(name: str, entry: dict[str, Any], i: int) -> str:
    combos = _combos(entry)
    if not combos or i >= len(combos) or not combos[i]:
        return name
    return f"{name}({', '.join(map(str, combos[i]))})"


def _confirm(
    a: str, b: str, suspects: list[Key], rounds: int, quick: bool
) -> dict[str, dict[Key, list[Any]]]:
    """Re-measure only the suspect benchmarks of ``a`` and ``b``, interleaved (A B, B A, ...),
    into a scratch results folder (the recorded results and the dashboard are left alone).
    Per commit and suspect: the figure of each round (``None``: failed)."""
    names = sorted({n for n, _ in suspects})
    bench = "^(" + "|".join(re.escape(n) for n in names) + r")(\(|$)"
    plans: dict[str, set[str]] = {w: set() for w in PLAN_WORKLOADS}
    for name, i in suspects:
        workload = name.split(".")[0].removeprefix("bench_").upper()
        if workload in plans:
            entry = _load_results(b).get(name) or _load_results(a)[name]
            plans[workload].add(str(_combos(entry)[i][0]))
    seen: dict[str, dict[Key, list[Any]]] = {
        a: {k: [] for k in suspects},
        b: {k: [] for k in suspects},
    }
    with tempfile.TemporaryDirectory(prefix="embshard-asv-confirm-") as tmp:
        conf = _config()
        conf.update(
            repo=str(ROOT),
            benchmark_dir=str(BENCH / conf.get("benchmark_dir", "benchmarks")),
            results_dir=str(Path(tmp, "results")),
            html_dir=str(Path(tmp, "html")),
        )
        config = Path(tmp, "asv.conf.json")
        config.write_text(json.dumps(conf))
        order = [s for r in range(rounds) for s in ((b, a) if r % 2 == 0 else (a, b))]
        # Only the suspect plans of each distributed job run again ("" for a job: all of it,
        # which happens only when none of its plans is suspect and its benchmarks are not run).
        keys = {w: f"EMBSHARD_ASV_{w}_PLANS" for w in PLAN_WORKLOADS}
        env_before = {key: os.environ.get(key) for key in keys.values()}
        for workload, key in keys.items():
            os.environ[key] = ",".join(sorted(plans[workload]))
        try:

            def action(sha: str, env: dict[str, str]) -> str:
                rc = _asv_run(sha, quick, bench, env, config=config)
                got = _load_results(sha, Path(tmp, "results"))
                for name, i in suspects:
                    figures = _figures(got[name]) if name in got else []
                    seen[sha][(name, i)].append(figures[i] if i < len(figures) else None)
                return "ok" if rc == 0 else f"asv run exited {rc}"

            _each_commit(order, action)
        finally:
            for key, value in env_before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return seen


def _best(values: list[Any]) -> float | None:
    ok = [v for v in values if v is not None and not _nan(v)]
    return min(ok) if ok else None


def cmd_compare(args: argparse.Namespace) -> int:
    _asv("machine", "--yes", check=True)
    a, b = _resolve(args.a), _resolve(args.b)
    _discover()
    todo = [s for s in dict.fromkeys((a, b)) if args.rerun or not _complete(s)]
    if todo:
        print("benchmarking " + " ".join(s[:8] for s in todo), flush=True)
        status = _run_commits(todo, args.quick)
        failed = {s: v for s, v in status.items() if v.startswith("skipped")}
        if failed:
            for s, v in failed.items():
                print(f"cannot compare: {s[:8]} {v}")
            return 2
    _asv("compare", a, b, f"--factor={args.factor}", "--split", f"--machine={_machine()}")
    ra, rb = _load_results(a), _load_results(b)
    versions = _current_versions()
    names = [n for n in sorted(versions) if n in ra and n in rb]
    names = [n for n in names if ra[n].get("version") == rb[n].get("version") == versions[n]]
    suspects = [(n, i) for n in names for i in _flag(ra[n], rb[n], args.factor)]
    regressions: list[str] = []
    if suspects and args.confirm > 0:
        print(
            f"\n{len(suspects)} figure(s) worse by more than {args.factor:g}x; re-measuring them "
            f"{args.confirm} more time(s) per commit, interleaved (best figure per commit counts)",
            flush=True,
        )
        seen = _confirm(a, b, suspects, args.confirm, args.quick)
        for name, i in suspects:
            first_a, first_b = _figures(ra[name])[i], _figures(rb[name])[i]
            best_a = _best([first_a, *seen[a][(name, i)]])
            best_b = _best([first_b, *seen[b][(name, i)]])
            rounds = f"A {[first_a, *seen[a][(name, i)]]} B {[first_b, *seen[b][(name, i)]]}"
            if best_a is None:
                continue
            if best_b is None:
                regressions.append(f"{_label(name, rb[name], i)} fails ({rounds})")
            elif best_b / best_a > args.factor:
                regressions.append(
                    f"{_label(name, rb[name], i)} {best_a:.4g} -> {best_b:.4g} "
                    f"(x{best_b / best_a:.2f}; {rounds})"
                )
            else:
                print(
                    f"  noise: {_label(name, rb[name], i)} x{best_b / best_a:.2f} at best ({rounds})"
                )
    else:
        for name, i in suspects:
            x, y = _figures(ra[name])[i], _figures(rb[name])[i]
            what = "fails" if y is None else f"{x:.4g} -> {y:.4g} (x{y / x:.2f})"
            regressions.append(f"{_label(name, rb[name], i)} {what}")
    if regressions:
        print(f"\nREGRESSION: {b[:8]} is worse than {a[:8]} by more than {args.factor:g}x in:")
        for r in regressions:
            print(f"  {r}")
        return 1
    print(
        f"\nOK: no benchmark of {b[:8]} is worse than {a[:8]} by more than {args.factor:g}x "
        f"({len(names)} benchmarks compared)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="benchmark commits and publish the dashboard")
    run.add_argument("revs", nargs="*", help="revisions (default: HEAD and recent history)")
    run.add_argument("--commits", type=int, default=4, help="recent commits of main to cover")
    run.add_argument("--quick", action="store_true", help="asv run --quick (one sample each)")
    run.add_argument("--bench", help="asv --bench regex (only these benchmarks)")
    run.add_argument("--no-publish", action="store_true")
    run.set_defaults(func=cmd_run)
    cmp = sub.add_parser("compare", help="fail on a regression of B against A")
    cmp.add_argument("a", help="reference revision")
    cmp.add_argument("b", help="revision under test")
    cmp.add_argument("--factor", type=float, default=1.10, help="worse-by threshold (1.10)")
    cmp.add_argument("--quick", action="store_true", help="asv run --quick where a run is needed")
    cmp.add_argument("--rerun", action="store_true", help="benchmark A and B even if recorded")
    cmp.add_argument(
        "--confirm",
        type=int,
        default=2,
        help="extra interleaved rounds re-measuring only the suspect figures (0: none)",
    )
    cmp.set_defaults(func=cmd_compare)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
