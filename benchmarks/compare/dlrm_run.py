"""The W2-DLRM rows of the side-by-side driver: spawn the ranks, summarize, print.

Figures per (workload, plan): each mode's step time (the slowest rank's median ms), each rank's
median wait on embshard's collectives per step, and the ratios the issue sets targets for:
embshard pipelined / embshard plain (target <= 0.85) and embshard pipelined / TorchRec pipelined
(target <= 0.7; against TorchRec's plain loop when its pipeline cannot run, with its error); and
the semi-synchronous pipelines against embshard's plain loop and against each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from benchmarks.compare.common import free_port
from benchmarks.compare.dlrm_sides import MODES
from benchmarks.compare.dlrm_worker import DlrmJob, run_rank


def spawn(job: DlrmJob, world: int) -> tuple[list[dict[str, Any]], str | None]:
    """Run ``job`` on ``world`` fresh processes; each rank's result and the error, if any."""
    with tempfile.TemporaryDirectory(prefix="embshard-dlrm-") as tmp:
        job = dataclasses.replace(job, out_dir=tmp)
        error = None
        try:
            mp.spawn(run_rank, args=(world, free_port(), job), nprocs=world, join=True)
        except Exception as e:
            lines = str(e).strip().splitlines()
            error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        ranks = []
        for r in range(world):
            p = Path(tmp, f"rank{r}.json")
            ranks.append(json.loads(p.read_text()) if p.exists() else {"rank": r})
    return ranks, error


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Step times, waits, ratios and errors of one run (see the module docstring)."""
    out: dict[str, Any] = {}
    errors = {m: e for r in ranks for m, e in r.get("errors", {}).items()}
    if errors:
        out["mode_errors"] = errors
    failed = [r["error"] for r in ranks if "error" in r]
    if failed:
        out["error"] = failed[0]
    for key in ("check_max_abs_diff", "pipelined_vs_plain_max_abs_diff"):
        if ranks and key in ranks[0]:
            out[key] = ranks[0][key]
    if not all("step_ms" in r for r in ranks):
        return out
    modes = [m for m in MODES if all(m in r["step_ms"] for r in ranks)]
    medians = {m: [statistics.median(r["step_ms"][m]) for r in ranks] for m in modes}
    out["rank_median_ms"] = medians
    out["step_ms"] = {m: max(v) for m, v in medians.items()}
    out["wait_ms_per_step"] = {
        m: [statistics.median(r["wait_ms"][m]) for r in ranks]
        for m in modes
        if m.startswith("embshard")
    }
    ms = out["step_ms"]
    ratios: dict[str, float] = {}
    if "embshard-pipelined" in ms and "embshard-plain" in ms:
        ratios["embshard pipelined / embshard plain"] = (
            ms["embshard-pipelined"] / ms["embshard-plain"]
        )
    if "embshard-pipelined" in ms:
        for other in ("torchrec-pipelined", "torchrec-plain"):
            if other in ms:
                label = other.replace("-", " ")
                ratios[f"embshard pipelined / {label}"] = ms["embshard-pipelined"] / ms[other]
    if "embshard-fused" in ms:
        for other in ("embshard-pipelined", "torchrec-fused", "torchrec-pipelined"):
            if other in ms:
                label = other.replace("-", " ")
                ratios[f"embshard fused / {label}"] = ms["embshard-fused"] / ms[other]
    if "embshard-semi-sync" in ms:
        for other in ("embshard-plain", "embshard-pipelined", "torchrec-semi-sync"):
            if other in ms:
                label = other.replace("-", " ", 1)
                ratios[f"embshard semi-sync / {label}"] = ms["embshard-semi-sync"] / ms[other]
    out["ratios"] = ratios
    return out


def run(args: argparse.Namespace, workload: str, plan: str) -> dict[str, Any]:
    """One W2-DLRM row: every mode of ``workload`` on ``plan``, timed interleaved."""
    job = DlrmJob(
        workload=workload,
        plan=plan,
        modes=MODES,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        num_batches=args.batches,
        tolerance=args.tolerance,
        seed=args.seed,
        out_dir="",
        local_size=args.local_size,
    )
    ranks, error = spawn(job, args.world_size)
    row: dict[str, Any] = {"workload": workload, "plan": plan, **summarize(ranks)}
    if error:
        row["error"] = row.get("error") or error
    return row


def lines(row: dict[str, Any]) -> list[str]:
    """The row, for the console."""
    head = f"{row['workload']} {row['plan']}"
    out = []
    for mode, ms in row.get("step_ms", {}).items():
        waits = row.get("wait_ms_per_step", {}).get(mode)
        wait = (
            f"; waits on embshard's collectives {', '.join(f'{w:.1f}' for w in waits)} ms/step "
            "(per rank)"
            if waits is not None
            else ""
        )
        out.append(f"{head}: {mode:>19} {ms:8.1f} ms/step (slowest rank's median){wait}")
    for name, ratio in row.get("ratios", {}).items():
        out.append(f"{head}: {name} = {ratio:.3f}")
    for mode, err in row.get("mode_errors", {}).items():
        out.append(f"{head}: {mode} could not run: {err}")
    for key in ("check_max_abs_diff", "pipelined_vs_plain_max_abs_diff"):
        if key in row:
            out.append(f"{head}: {key} = {row[key]:.3g}")
    if "error" in row:
        out.append(f"{head}: ERROR {row['error']}")
    return out
