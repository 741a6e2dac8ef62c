"""``embshard plan``: plan a table spec on a topology, print the stats table, write the plan.

The spec format is in :mod:`embshard_dist.planner.spec`; without ``--topology`` the default
topology is used. Exit status: 0 with a plan written, 2 for bad input or when no plan fits.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embshard plan", description=__doc__.split("\n")[0])
    p.add_argument("--tables", required=True, help="table spec (.json, or .yaml with PyYAML)")
    p.add_argument("--topology", help="topology file (from `embshard calibrate`)")
    p.add_argument("--out", required=True, help="where to write the plan JSON")
    p.add_argument("--world-size", type=int, help="ranks (overrides the topology's)")
    p.add_argument("--local-world-size", type=int, help="ranks per node (default: all)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="without --topology")
    p.add_argument("--batch-size", type=int, help="samples per rank (overrides the spec's)")
    p.add_argument(
        "--search", choices=("auto", "greedy", "beam", "exact"), default="auto", help="search"
    )
    p.add_argument("--reserve", type=float, default=None, help="memory share kept free (0.1)")
    return p


def run(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    from embshard_dist.planner.cost_model import DEFAULT_RESERVE_FRACTION
    from embshard_dist.planner.planner import EmbeddingShardingPlanner
    from embshard_dist.planner.spec import load_table_spec
    from embshard_dist.planner.topology import Topology, default_topology

    try:
        spec = load_table_spec(args.tables)
        if args.topology:
            topology = Topology.load(
                args.topology, world_size=args.world_size, local_world_size=args.local_world_size
            )
        else:
            topology = default_topology(
                args.world_size or 2,
                compute_device=args.device,
                local_world_size=args.local_world_size,
            )
        planner = EmbeddingShardingPlanner(
            topology,
            constraints=spec.constraints,
            batch_size=args.batch_size or spec.batch_size,
            optimizer=spec.optimizer,
            reserve_fraction=DEFAULT_RESERVE_FRACTION if args.reserve is None else args.reserve,
            search=args.search,
        )
        result = planner.propose(list(spec.tables))
    except (ValueError, TypeError, OSError) as e:
        print(f"embshard plan: {e}", file=sys.stderr)
        return 2
    print(result.stats())
    Path(args.out).write_text(result.plan.to_json() + "\n")
    print(f"\nplan written to {args.out}")
    return 0
