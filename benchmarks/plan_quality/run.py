"""Plan quality driver: the planner's estimates against measured steps; its plan against TorchRec's.

For each workload (W1, W2 of ``shared/benchmarks.md``; 2 gloo ranks, 1 thread each):

1. the topology: calibrated on this machine (``embshard_dist.planner.calibration.calibrate.calibrate``, the
   logic of ``embshard calibrate``) right before the workload is measured and again right
   after (a shared host's speed drifts with its load; a prediction is the mean of the two
   calibrations' predictions, and the report shows how far apart they were), unless
   ``--topology FILE`` gives one;
2. the plans: every single sharding type applied to all tables (the side-by-side harness's
   layouts), embshard's planner's plan for that topology, when TorchRec imports, TorchRec's
   planner's plan for ``Topology(world_size=2, compute_device="cpu")`` on the same tables,
   pooling factor and batch size, and the hand-made mixtures of
   ``benchmarks.plan_quality.alternatives`` (what else a planner could pick);
3. the estimate of each plan (``embshard_dist.planner.estimate.estimate_plan``: predicted step
   time per rank; a plan's prediction is its slowest rank's);
4. the measurement: embshard executes every plan in the same processes, interleaved (see
   ``benchmarks.plan_quality.measure``); a plan's step time is its slowest rank's median;
5. the compute floor (``benchmarks.plan_quality.floor``): the global batch's lookups and
   updates with no communication, in this process divided by the ranks, and split over the
   ranks' processes running at once; no plan's slowest rank does less;
6. the report: predicted vs measured ms per plan and rank, the estimator's error, each plan's
   ratio to TorchRec's planner's plan and to the best single sharding type, and how far each
   plan sits above the compute floor.

Usage (from the repository root; TorchRec's plan needs the ``compare`` nox environment)::

    .nox/compare/bin/python -m benchmarks.plan_quality.run [--workload W1 W2]
        [--topology topo.json] [--save-topology topo.json] [--calibration-reps 21]
        [--steps 10] [--warmup 3] [--plans table_wise embshard-planner ...]
        [--no-floor] [--estimate-only] [--json out.json]

Exit status 1 when a measurement failed or the forward check did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare.plans import SHARDING_TYPES
from benchmarks.compare.workloads import WORKLOADS, get
from benchmarks.plan_quality.alternatives import MIXTURES, alternative_plans
from benchmarks.plan_quality.floor import compute_floor, contended_floor
from benchmarks.plan_quality.measure import MeasureJob, measure, summarize
from benchmarks.plan_quality.plans import (
    EMBSHARD_PLANNER,
    TORCHREC_PLANNER,
    describe,
    embshard_planner_plan,
    single_type_plan,
    torchrec_available,
    torchrec_planner_plan,
)
from benchmarks.plan_quality.tables import (
    optimizer_spec,
    planner_constraints,
    planner_tables,
)
from embshard_dist.planner.calibration.probes import CALIBRATION_REPS

WORLD = 2
PLAN_LABELS = (*SHARDING_TYPES, EMBSHARD_PLANNER, TORCHREC_PLANNER, *MIXTURES)


def _topology(args: argparse.Namespace) -> Any:
    from embshard_dist.planner.topology import Topology

    if args.topology:
        return Topology.load(args.topology, world_size=WORLD)
    from embshard_dist.planner.calibration.calibrate import calibrate

    started = time.perf_counter()
    topo = calibrate(world_size=WORLD, threads=args.threads, reps=args.calibration_reps)
    print(f"calibrated in {time.perf_counter() - started:.1f} s: {topo.source}", flush=True)
    if args.save_topology:
        topo.save(args.save_topology)
        print(f"topology written to {args.save_topology}", flush=True)
    return topo


def _mean_prediction(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    rank_ms = [(x + y) / 2 for x, y in zip(a["rank_ms"], b["rank_ms"], strict=True)]
    drift = abs(a["ms"] - b["ms"]) / max(1e-9, (a["ms"] + b["ms"]) / 2)
    return {"ms": max(rank_ms), "rank_ms": rank_ms, "before_ms": a["ms"], "after_ms": b["ms"],
            "drift": drift}  # fmt: skip


def _plans(wl: Any, labels: list[str], topo: Any) -> tuple[dict[str, Any], list[str]]:
    plans: dict[str, Any] = {}
    notes: list[str] = []
    mixtures = alternative_plans(wl, WORLD)
    for label in labels:
        if label in SHARDING_TYPES:
            plans[label] = single_type_plan(label, wl, WORLD)
        elif label == EMBSHARD_PLANNER:
            plans[label], result = embshard_planner_plan(wl, topo)
            print(result.stats(), flush=True)
        elif label == TORCHREC_PLANNER:
            why = torchrec_available()
            if why is not None:
                notes.append(f"{TORCHREC_PLANNER} skipped: {why}")
                continue
            plans[label] = torchrec_planner_plan(wl, WORLD)
        elif label in mixtures:
            plans[label] = mixtures[label]
        else:
            notes.append(f"{label} skipped: no table of {wl.name} is small or large enough")
    return plans, notes


def _estimate(plan: Any, wl: Any, topo: Any) -> dict[str, Any]:
    from embshard_dist.planner.estimate import estimate_plan

    est = estimate_plan(
        plan,
        planner_tables(wl),
        topo,
        constraints=planner_constraints(wl),
        batch_size=wl.batch_per_rank,
        optimizer=optimizer_spec(),
    )
    return {"ms": est.max_ms, "rank_ms": [r["total_ms"] for r in est.per_rank_ms()]}


def _fmt_ranks(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def report(wl: str, rows: list[dict[str, Any]], floor: dict[str, Any] | None = None) -> str:
    """The table of one workload: predicted vs measured, error, ratios, and (given the compute
    floor) how much of each measured step a plan could change at all."""
    measured = {r["plan"]: r["measured"]["ms"] for r in rows if "measured" in r}
    singles = [measured[k] for k in SHARDING_TYPES if k in measured]
    best_single = min(singles) if singles else None
    torchrec = measured.get(TORCHREC_PLANNER)
    head = (
        f"| {wl} plan | tables per type | predicted ms (rank 0 / 1) | measured ms (rank 0 / 1) "
        "| error | calibration drift | / torchrec-planner | / best single type | above floor ms |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p = r["predicted"]
        if "measured" not in r:
            lines.append(
                f"| {r['plan']} | {r['types']} | {p['ms']:.1f} ({_fmt_ranks(p['rank_ms'])}) "
                "| - | - | - | - | - | - |"
            )
            continue
        m = r["measured"]
        err = (p["ms"] - m["ms"]) / m["ms"] * 100
        drift = f"{p['drift'] * 100:.0f}%" if "drift" in p else "-"
        vs_tr = f"{m['ms'] / torchrec:.2f}" if torchrec else "-"
        vs_best = f"{m['ms'] / best_single:.2f}" if best_single else "-"
        above = f"{m['ms'] - floor['contended_ms']:.1f}" if floor else "-"
        lines.append(
            f"| {r['plan']} | {r['types']} | {p['ms']:.1f} ({_fmt_ranks(p['rank_ms'])}) | "
            f"{m['ms']:.1f} ({_fmt_ranks(m['rank_ms'])}) | {err:+.0f}% | {drift} | {vs_tr} | "
            f"{vs_best} | {above} |"
        )
    if floor:
        lines.append("")
        lines.append(
            f"Compute floor (no communication): {floor['floor_ms']:.1f} ms per rank alone (the "
            f"global batch's lookups and updates in one process, {floor['global_step_ms']:.1f} "
            f"ms, / {floor['world']}); {floor['contended_ms']:.1f} ms with the ranks' processes "
            f"stepping their shares at once ({_fmt_ranks(floor['contended_rank_ms'])}). "
            "'above floor' is a plan's step minus the latter."
        )
        if torchrec:
            target = 0.85 * torchrec
            lines.append(
                f"0.85 x torchrec-planner = {target:.1f} ms: a plan must spend at most "
                f"{target - floor['contended_ms']:.1f} ms above the floor where torchrec-planner's "
                f"spends {torchrec - floor['contended_ms']:.1f} ms."
            )
    return "\n".join(lines)


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib
    from importlib import metadata

    versions = {}
    for name in ("torch", "fbgemm-gpu-cpu", "torchrec", "embshard-dist"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "world_size": WORLD,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_average_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--plans", nargs="+", default=list(PLAN_LABELS), choices=PLAN_LABELS)
    parser.add_argument("--topology", help="a topology file (default: calibrate now)")
    parser.add_argument("--save-topology", help="write the calibrated topology here")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (>= 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps (>= 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--calibration-reps", type=int, default=CALIBRATION_REPS, help="calibration rounds"
    )
    parser.add_argument("--estimate-only", action="store_true", help="print estimates only")
    parser.add_argument("--no-floor", action="store_true", help="skip the compute floor")
    parser.add_argument("--json", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.warmup < 3:
        parser.error("benchmarks.md asks for >= 10 timed steps after >= 3 warm-up steps")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    env = _environment(args)
    print(json.dumps(env), flush=True)
    failed = False
    results: dict[str, Any] = {"environment": env, "workloads": {}}
    for name in args.workload:
        wl = get(name)
        topo = _topology(args)
        plans, notes = _plans(wl, list(args.plans), topo)
        for note in notes:
            print(f"note: {name}: {note}", flush=True)
        rows: list[dict[str, Any]] = [
            {"plan": label, "types": describe(plan), "predicted": _estimate(plan, wl, topo)}
            for label, plan in plans.items()
        ]
        topologies = [topo.to_dict()]
        floor = None
        if not (args.estimate_only or args.no_floor):
            floor = compute_floor(wl, WORLD, args.steps, args.warmup, args.threads)
            both = contended_floor(wl, WORLD, args.steps, args.warmup)
            floor.update(contended_ms=both["floor_ms"], contended_rank_ms=both["rank_ms"])
            print(f"{name}: compute floor {floor}", flush=True)
        if not args.estimate_only:
            job = MeasureJob(
                name,
                tuple((label, plan.to_json(indent=None)) for label, plan in plans.items()),
                steps=args.steps,
                warmup=args.warmup,
                threads=args.threads,
            )
            started = time.perf_counter()
            ranks = measure(job, WORLD)
            errors = {r["error"] for r in ranks if "error" in r}
            if errors:
                failed = True
                print(f"{name}: measurement failed: {'; '.join(sorted(errors))}", flush=True)
            else:
                for row, (_, m) in zip(rows, summarize(ranks).items(), strict=True):
                    row["measured"] = m
            print(f"{name}: measured in {time.perf_counter() - started:.0f} s", flush=True)
            if not args.topology:
                after = _topology(args)
                topologies.append(after.to_dict())
                for row, plan in zip(rows, plans.values(), strict=True):
                    row["predicted"] = _mean_prediction(
                        row["predicted"], _estimate(plan, wl, after)
                    )
        print()
        print(report(name, rows, floor), flush=True)
        print()
        results["workloads"][name] = {
            "rows": rows,
            "notes": notes,
            "topologies": topologies,
            "floor": floor,
        }
    env["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
