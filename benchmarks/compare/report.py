"""Turn the ranks' raw results into figures: the table printed, the JSON and the PNG chart.

Step time of a contender = the slowest rank's median (the largest of the per-rank medians of
the timed steps). Ratio = embshard / TorchRec (below 1: embshard is faster). Peak RSS per rank
comes from the runs that built one library alone (``None`` when they were skipped). Phases
(``--profile``): per library, the median ms per phase of its slowest rank (by profiled total).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.profile import PHASES

ORDER = ("embshard", "torchrec")


def summarize_timing(ranks: list[dict[str, Any]], contenders: list[str]) -> dict[str, Any]:
    """Per contender: slowest rank's median ms, every rank's median; diffs, skips and errors."""
    out: dict[str, Any] = {}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        out["error"] = errors[0]
    skipped = {k: v for r in ranks for k, v in r.get("skipped", {}).items()}
    if skipped:
        out["skipped"] = skipped
    if all("step_ms" in r for r in ranks):
        medians = {
            name: [statistics.median(r["step_ms"][name]) for r in ranks]
            for name in contenders
            if name not in skipped
        }
        out["rank_median_ms"] = medians
        out["raw_ms"] = {name: [r["step_ms"][name] for r in ranks] for name in medians}
        out["step_ms"] = {name: max(m) for name, m in medians.items()}
        if "embshard" in out["step_ms"] and "torchrec" in out["step_ms"]:
            out["ratio"] = out["step_ms"]["embshard"] / out["step_ms"]["torchrec"]
    if ranks and "check_max_abs_diff" in ranks[0]:
        out["check_max_abs_diff"] = ranks[0]["check_max_abs_diff"]
    if ranks and "post_training_max_abs_diff" in ranks[0]:
        out["post_training_max_abs_diff"] = ranks[0]["post_training_max_abs_diff"]
    return out


def summarize_phases(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per contender, the phases and backward nodes of the rank whose profiled step took
    longest; empty when the run was not profiled."""
    if not ranks or not all("phase_ms" in r for r in ranks):
        return {}
    phases: dict[str, dict[str, float]] = {}
    nodes: dict[str, dict[str, float]] = {}
    for name in ranks[0]["phase_ms"]:
        slowest = max(ranks, key=lambda r: r["phase_ms"][name]["total"])
        phases[name] = slowest["phase_ms"][name]
        nodes[name] = slowest["backward_nodes_ms"][name]
    return {"phase_ms": phases, "backward_nodes_ms": nodes}


def phase_table(result: dict[str, Any]) -> str:
    """Median ms per phase of the profiled steps, one line per (row, library)."""
    columns = (*PHASES, "total")
    head = f"{'wl':3} {'plan':15} {'library':9} " + " ".join(
        f"{c.replace('_', ' '):>14}" for c in columns
    )
    lines = [
        "ms per phase: median over the profiled steps of the slowest rank (the profiler slows "
        "the backward a little);\nbackward comms: autograd nodes of collectives; fused update: "
        "the lookups' backward, optimizer included",
        head,
        "-" * len(head),
    ]
    for row in result["results"]:
        for name in ORDER:
            phases = row.get("phase_ms", {}).get(name)
            if phases is not None:
                cells = " ".join(f"{phases[c]:14.1f}" for c in columns)
                lines.append(f"{row['workload']:3} {row['plan']:15} {name:9} {cells}")
    return "\n".join(lines)


def header(env: dict[str, Any]) -> str:
    v = env["versions"]
    load = env["load_average_start"]
    lines = [
        f"embshard vs TorchRec side by side on {env['processor'] or env['machine']} "
        f"({env['cpus']} CPUs), Python {env['python']}",
        "versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"{env['world_size']} gloo ranks x {env['threads_per_rank']} thread(s); "
        f"{env['optimizer']}; {env['steps']} timed steps after {env['warmup']} warm-up, "
        "interleaved",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        + (
            "  (LOADED machine: other work is running; absolute times are inflated)"
            if load[0] > 0.5 * (env["cpus"] or 1)
            else ""
        ),
    ]
    return "\n".join(lines)


def _ms(row: dict[str, Any], name: str) -> str:
    v = row.get("step_ms", {}).get(name)
    return f"{v:8.1f}" if v is not None else f"{'-':>8}"


def _rss(row: dict[str, Any], name: str) -> str:
    v = row.get("peak_rss_mb", {}).get(name)
    if not v or any(x is None for x in v):
        return f"{'-':>11}"
    return f"{'/'.join(f'{x:.0f}' for x in v):>11}"


def row_line(row: dict[str, Any]) -> str:
    ratio = row.get("ratio")
    diff = row.get("check_max_abs_diff", {}).get("torchrec")
    post = row.get("post_training_max_abs_diff", {}).get("torchrec")
    parts = [
        f"{row['workload']:3} {row['plan']:15}",
        _ms(row, "embshard"),
        _ms(row, "torchrec"),
        f"{ratio:6.2f}" if ratio is not None else f"{'-':>6}",
        _rss(row, "embshard"),
        _rss(row, "torchrec"),
        f"{diff:9.1e}" if diff is not None else f"{'-':>9}",
        f"{post:9.1e}" if post is not None else f"{'-':>9}",
    ]
    tail = []
    if "error" in row:
        tail.append(f"ERROR {row['error']}")
    tail += row.get("notes", [])
    return " ".join(parts) + ("  " + "; ".join(tail) if tail else "")


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'wl':3} {'plan':15} {'emb ms':>8} {'trec ms':>8} {'ratio':>6} "
        f"{'emb RSS MB':>11} {'trec RSS MB':>11} {'fwd diff':>9} {'post diff':>9}"
    )
    lines = [
        "ms per step: slowest rank's median; ratio = embshard / TorchRec; RSS: peak per rank "
        "(rank0/rank1), each library alone;\nfwd diff: max |embshard - TorchRec| of the outputs "
        "before training (must be <= the tolerance); post diff: the same after the timed steps "
        "(informational: TorchRec's column-wise tables keep row-wise optimizer state per column "
        "shard, so plans with column-wise tables drift apart)",
        head,
        "-" * len(head),
    ]
    lines += [row_line(r) for r in result["results"]]
    end = result["environment"].get("load_average_end")
    if end:
        lines.append(f"load average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    return "\n".join(lines)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """Write ``compare-<time>.json`` / ``.png`` and ``latest.*`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = []
    text = json.dumps(result, indent=2)
    for name in (f"compare-{stamp}.json", "latest.json"):
        (out / name).write_text(text)
    paths.append(out / f"compare-{stamp}.json")
    png = chart(result, out / f"compare-{stamp}.png")
    if png is not None:
        (out / "latest.png").write_bytes(png.read_bytes())
        paths.append(png)
    return paths


def chart(result: dict[str, Any], path: Path) -> Path | None:
    """A bar chart per workload: ms per step of each library per plan, ratios above the bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart written")
        return None
    rows = [r for r in result["results"] if r.get("step_ms")]
    workloads = sorted({r["workload"] for r in rows})
    if not workloads:
        return None
    fig, axes = plt.subplots(len(workloads), 1, figsize=(10, 4 * len(workloads)), squeeze=False)
    for ax, wl in zip(axes[:, 0], workloads, strict=True):
        wrows = [r for r in rows if r["workload"] == wl]
        xs = range(len(wrows))
        width = 0.38
        for j, name in enumerate(ORDER):
            vals = [r["step_ms"].get(name, 0.0) for r in wrows]
            ax.bar([x + (j - 0.5) * width for x in xs], vals, width, label=name)
        for x, r in zip(xs, wrows, strict=True):
            if "ratio" in r:
                top = max(r["step_ms"].values())
                ax.annotate(f"{r['ratio']:.2f}x", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [r["plan"] for r in wrows], rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (slowest rank's median, log scale)")
        ax.set_title(f"{wl}: embshard vs TorchRec (label: embshard / TorchRec)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
