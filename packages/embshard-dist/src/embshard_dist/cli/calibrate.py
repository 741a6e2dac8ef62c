"""``embshard calibrate``: measure this machine and write the planner's topology file.

See :mod:`embshard_dist.planner.calibration.calibrate` for what is measured. Options are checked
before any process starts. Exit status: 0 with the file written; 1 when the multi-process
measurement fails (nothing written; with ``--allow-defaults`` the default comms figures are
written instead, with a warning on stderr, and the status is 0); 2 for bad options or when the
file cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from embshard_dist.cli.options import DefaultsHelpFormatter, check_divides, positive_int
from embshard_dist.planner.calibration.calibrate import (
    CALIBRATION_BACKENDS,
    CalibrationError,
    CalibrationWarning,
    calibrate,
)
from embshard_dist.planner.calibration.probes import CALIBRATION_REPS


def run(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="embshard calibrate",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="where to write the topology JSON")
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks the topology is for")
    p.add_argument("--local-world-size", type=positive_int, help="ranks per node (default: all)")
    p.add_argument(
        "--backend",
        choices=CALIBRATION_BACKENDS,
        default="gloo",
        help="process-group backend to measure (the probes run on the CPU)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    p.add_argument("--no-comms", action="store_true", help="skip the collective measurements")
    p.add_argument(
        "--reps",
        type=positive_int,
        default=CALIBRATION_REPS,
        help="timed rounds (more: steadier on a busy host)",
    )
    p.add_argument(
        "--allow-defaults",
        action="store_true",
        help="if the multi-process measurement fails, write the default comms figures "
        "(with a warning) instead of failing",
    )
    args = p.parse_args(argv)
    check_divides(p, args.world_size, args.local_world_size)
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        p.error(f"--out: folder {str(out_dir)!r} does not exist; create it or write elsewhere")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationWarning)
        try:
            topology = calibrate(
                world_size=args.world_size,
                local_world_size=args.local_world_size,
                backend=args.backend,
                threads=args.threads,
                comms=not args.no_comms,
                reps=args.reps,
                allow_defaults=args.allow_defaults,
            )
        except CalibrationError as e:
            print(f"embshard calibrate: error: {e}; nothing written", file=sys.stderr)
            return 1
    for w in caught:
        if issubclass(w.category, CalibrationWarning):
            print(f"embshard calibrate: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    try:
        topology.save(args.out)
    except OSError as e:
        print(f"embshard calibrate: cannot write {args.out!r}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(topology.to_dict(), indent=2))
    print(f"\ntopology written to {args.out}")
    return 0
