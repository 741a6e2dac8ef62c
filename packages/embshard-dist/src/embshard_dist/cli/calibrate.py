"""``embshard calibrate``: measure this machine and write the planner's topology file.

See :mod:`embshard_dist.planner.calibration.calibrate` for what is measured.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from embshard_dist.planner.calibration.probes import CALIBRATION_REPS


def run(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    p = argparse.ArgumentParser(prog="embshard calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where to write the topology JSON")
    p.add_argument("--world-size", type=int, default=2, help="ranks the topology is for")
    p.add_argument("--local-world-size", type=int, help="ranks per node (default: all)")
    p.add_argument("--backend", default="gloo", help="process-group backend to measure")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--no-comms", action="store_true", help="skip the collective measurements")
    p.add_argument(
        "--reps",
        type=int,
        default=CALIBRATION_REPS,
        help="timed rounds (more: steadier on a busy host)",
    )
    args = p.parse_args(argv)
    from embshard_dist.planner.calibration.calibrate import calibrate

    topology = calibrate(
        world_size=args.world_size,
        local_world_size=args.local_world_size,
        backend=args.backend,
        threads=args.threads,
        comms=not args.no_comms,
        reps=args.reps,
    )
    topology.save(args.out)
    print(json.dumps(topology.to_dict(), indent=2))
    print(f"\ntopology written to {args.out}")
    return 0
