"""``embshard plan``: plan a table spec on a topology, print the stats table, write the plan.

The spec format is in :mod:`embshard_dist.planner.spec`; without ``--topology`` the default
topology is used. Options are checked before anything is planned; a pinned sharding type a
table cannot take is refused naming the table. Exit status: 0 with a plan written, 2 for bad
input or when no plan fits (nothing is written then).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from embshard_dist.cli.options import (
    DefaultsHelpFormatter,
    check_divides,
    fraction,
    positive_int,
)

DEFAULT_WORLD_SIZE = 2
"""Ranks planned for when neither ``--world-size`` nor ``--topology`` gives them."""


def _parser() -> argparse.ArgumentParser:
    from embshard_dist.planner.cost_model import DEFAULT_RESERVE_FRACTION

    p = argparse.ArgumentParser(
        prog="embshard plan",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--tables", required=True, help="table spec (.json, or .yaml with PyYAML)")
    p.add_argument(
        "--topology",
        help="topology file (from `embshard calibrate`; default: the built-in figures of --device)",
    )
    p.add_argument("--out", required=True, help="where to write the plan JSON")
    p.add_argument(
        "--world-size",
        type=positive_int,
        help=f"ranks (overrides the topology's; default: {DEFAULT_WORLD_SIZE} without one)",
    )
    p.add_argument("--local-world-size", type=positive_int, help="ranks per node (default: all)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="without --topology")
    p.add_argument("--batch-size", type=positive_int, help="samples per rank (default: the spec's)")
    p.add_argument(
        "--search", choices=("auto", "greedy", "beam", "exact"), default="auto", help="search"
    )
    p.add_argument(
        "--reserve",
        type=fraction,
        default=DEFAULT_RESERVE_FRACTION,
        help="share of each rank's memory kept free of tables",
    )
    return p


def run(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_divides(parser, args.world_size, args.local_world_size)
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        parser.error(f"--out: folder {str(out_dir)!r} does not exist; create it or write elsewhere")
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.spec import load_table_spec
    from embshard_dist.planner.topology import Topology, default_topology

    try:
        spec = load_table_spec(args.tables)
        if args.topology:
            topology = Topology.load(args.topology)
            if args.world_size is not None or args.local_world_size is not None:
                topology = topology.with_world(
                    args.world_size or topology.world_size, args.local_world_size
                )
        else:
            topology = default_topology(
                args.world_size or DEFAULT_WORLD_SIZE,
                compute_device=args.device,
                local_world_size=args.local_world_size,
            )
        planner = EmbeddingShardingPlanner(
            topology,
            constraints=spec.constraints,
            batch_size=args.batch_size or spec.batch_size,
            optimizer=spec.optimizer,
            reserve_fraction=args.reserve,
            search=args.search,
        )
        result = planner.propose(list(spec.tables))
        text = result.plan.to_json() + "\n"
        print(result.stats())
        Path(args.out).write_text(text)
    except (ValueError, TypeError, OSError) as e:
        print(f"embshard plan: {e}", file=sys.stderr)
        return 2
    print(f"\nplan written to {args.out}")
    return 0
