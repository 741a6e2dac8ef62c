"""Check the published asv dashboard in headless Chromium with the network cut.

Serves ``benchmarks/html`` on 127.0.0.1 (a free port), opens it in Chromium with every host
name unresolvable, and checks that:

* the page loaded its scripts (no asv error page or error dialog) and asked nothing of any
  host but the local server;
* the summary grid lists every benchmark asv discovered (``benchmarks.json``);
* each such benchmark's graph page draws a plot with a point for every commit measured;
* the regressions page renders.

Saves ``screenshot-summary.png`` and ``screenshot-graph.png`` beside the HTML. Exit status 0
when all checks pass, 1 otherwise (each failure printed). Run by ``nox -s asv``::

    python benchmarks/dashboard/check_browser.py [--html benchmarks/html] [--graph NAME]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cdp import Browser, CdpError

BENCH = Path(__file__).resolve().parents[1]

GRAPH = "bench_w2.W2StepTime.track_step_ms"
"""The graph screenshotted by default: W2 step time, one series per sharding type."""


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    """The dashboard's server: a browser dropping a connection mid-file is not an error."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on 127.0.0.1 at a free port; the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def measured_commits(results_dir: Path, machine: str) -> dict[str, set[str]]:
    """Benchmark name -> the commits with at least one non-failed figure, from asv's results."""
    folder = results_dir / machine
    if not folder.is_dir():
        raise SystemExit(f"no asv results for machine {machine!r} in {results_dir}: run asv first")
    seen: dict[str, set[str]] = {}
    for path in folder.glob("*.json"):
        if path.name == "machine.json":
            continue
        data = json.loads(path.read_text())
        columns = data.get("result_columns", [])
        for name, row in data.get("results", {}).items():
            result = dict(zip(columns, row, strict=False)).get("result")
            values = result if isinstance(result, list) else [result]
            if any(v is not None and v == v for v in values):  # v == v: not NaN
                seen.setdefault(name, set()).add(data["commit_hash"])
    return seen


def discovered(results_dir: Path) -> set[str]:
    """Every benchmark asv discovered (``benchmarks.json`` of the results), measured or not."""
    path = results_dir / "benchmarks.json"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run asv first")
    data = json.loads(path.read_text())
    return {name for name, entry in data.items() if isinstance(entry, dict)}


_NO_ERROR = (
    "typeof $ === 'function' && typeof $.plot === 'function' && !location.pathname.endsWith("
    "'error.html') && !$('#error').hasClass('in')"
)
_GRID = "$('#summarygrid-display .benchmark-container').map((i, a) => a.getAttribute('href'))"
_POINTS = (
    "(() => { const p = $('#main-graph').data('plot'); if (!p) return null;"
    " const xs = new Set(); for (const s of p.getData()) for (const d of s.data)"
    " if (d && d[1] !== null && !Number.isNaN(d[1])) xs.add(d[0]); return xs.size; })()"
)


def check(html: Path, results_dir: Path, machine: str, graph: str | None) -> list[str]:
    """Run every check; the failures (empty: all passed)."""
    failures: list[str] = []
    expected = measured_commits(results_dir, machine)
    if not expected:
        return [f"no benchmark of {results_dir / machine} has a result: nothing to display"]
    fallback = max(sorted(expected), key=lambda n: len(expected[n]))
    shown = graph or (GRAPH if GRAPH in expected else fallback)
    with serve(html) as base, Browser() as page:
        page.goto(f"{base}/index.html")
        try:
            page.wait_for(_NO_ERROR, what="asv's scripts to load")
            page.wait_for(f"{_GRID}.length > 0", what="the summary grid")
        except CdpError as err:
            page.screenshot(html / "screenshot-summary.png")
            shot = html / "screenshot-summary.png"
            if str(page.evaluate("location.pathname")).endswith("error.html"):
                outside = sorted({u for u in page.requests if not u.startswith((base, "data:"))})
                return [
                    f"summary: asv's error page (a script failed to load; the page asked the "
                    f"network for {', '.join(outside) or 'nothing'}): run "
                    f"`python benchmarks/dashboard/vendor.py publish {html}` (see {shot})"
                ]
            return [f"summary: {err} (see {shot})"]
        listed = {str(h).lstrip("#") for h in page.evaluate(f"{_GRID}.get()")}
        missing = sorted((discovered(results_dir) | set(expected)) - listed)
        if missing:
            failures.append(f"summary grid lacks {', '.join(missing)}")
        page.wait_for(
            "$('#summarygrid-display canvas').length > 0", what="the summary grid's plots"
        )
        page.screenshot(html / "screenshot-summary.png")
        print(f"summary grid: all {len(listed)} benchmarks listed ({len(expected)} measured)")
        for name in sorted(expected):
            # Forget the previous graph's plot, so that only this benchmark's own plot counts.
            page.evaluate("$('#main-graph').removeData('plot'), true")
            page.goto(f"{base}/index.html#{quote(name)}")
            want = len(expected[name])
            drawn = f"$('#title').text().trim() === {json.dumps(name)} && ({_POINTS}) >= 1"
            try:
                page.wait_for(f"{_NO_ERROR} && {drawn}", what=f"the plot of {name}")
                got = int(page.evaluate(_POINTS))
            except CdpError as err:
                failures.append(f"graph {name}: {err}")
                continue
            if got != want:
                failures.append(f"graph {name}: points at {got} commits, {want} measured")
            else:
                print(f"graph {name}: points at all {want} measured commits")
            if name == shown:
                page.wait_for("$('#main-graph .flot-x-axis, #main-graph .tickLabel').length > 0")
                page.screenshot(html / "screenshot-graph.png")
        page.goto(f"{base}/index.html#regressions")
        try:
            page.wait_for(
                f"{_NO_ERROR} && $('#regressions-display').is(':visible')"
                " && $('#regressions-body').children().length > 0",
                what="the regressions page",
            )
            print("regressions page: rendered")
        except CdpError as err:
            failures.append(f"regressions: {err}")
        outside = [u for u in page.requests if not u.startswith((base, "about:", "data:"))]
        if outside:
            failures.append(f"the dashboard asked the network for {', '.join(sorted(outside))}")
        else:
            print(f"network: {len(page.requests)} requests, all to {base}")
    return failures


def main(argv: list[str] | None = None) -> int:
    conf = json.loads((BENCH / "asv.conf.json").read_text())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=Path, default=BENCH / conf.get("html_dir", "html"))
    parser.add_argument("--results", type=Path, default=BENCH / conf.get("results_dir", "results"))
    parser.add_argument("--machine", default=platform.node(), help="asv machine name")
    parser.add_argument(
        "--graph", help=f"benchmark to screenshot (default: {GRAPH}, else the most measured)"
    )
    args = parser.parse_args(argv)
    if not (args.html / "index.html").exists():
        print(f"error: {args.html}/index.html does not exist: run `nox -s asv` first")
        return 1
    failures = check(args.html, args.results, args.machine, args.graph)
    for f in failures:
        print(f"FAIL: {f}")
    print(
        f"screenshots: {args.html / 'screenshot-summary.png'}, {args.html / 'screenshot-graph.png'}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
