"""``embshard checkpoint``: inspect, export and import checkpoints, offline, in one process.

Exit status: 0 on success, 1 when ``inspect`` finds the checkpoint damaged (``--verify`` also
reads every file against its checksum), 2 for bad input or a damaged checkpoint given to
``export`` (the message names each bad file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from embshard_dist.cli.options import DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``embshard checkpoint``."""
    parser = argparse.ArgumentParser(
        prog="embshard checkpoint",
        description="Inspect, export and import checkpoints.",
        formatter_class=DefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fmt = DefaultsHelpFormatter
    inspect = sub.add_parser("inspect", help="print what a checkpoint holds", formatter_class=fmt)
    inspect.add_argument("path", metavar="DIR", help="a checkpoint or a directory of them")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="read every file and compare its checksum with the one recorded at the save",
    )
    export = sub.add_parser(
        "export", help="write every tensor unsharded, one file each", formatter_class=fmt
    )
    export.add_argument("path", metavar="DIR", help="a checkpoint or a directory of them")
    export.add_argument("out", metavar="OUT", help="the export directory to create")
    export.add_argument("--weights-only", action="store_true", help="leave the optimizer state out")
    export.add_argument(
        "--quantize",
        choices=["int8", "int4", "int2", "fp16"],
        default=None,
        help="quantize every table row-wise for serving (weights only; implies --weights-only); "
        "load it with embshard_dist.checkpoint.export.load_quantized_export (default: float)",
    )
    imp = sub.add_parser(
        "import", help="make a checkpoint from a state dict or an export", formatter_class=fmt
    )
    imp.add_argument("source", metavar="SRC", help="a torch.save'd state dict, or an export")
    imp.add_argument("out", metavar="OUT", help="the checkpoint directory to create")
    imp.add_argument(
        "--prefix",
        default="",
        help="module path to put before the state dict's keys, e.g. sparse_arch (default: none)",
    )
    imp.add_argument(
        "--step", type=int, default=None, help="the step to record (default: the export's, else 0)"
    )
    return parser


def run(argv: Sequence[str]) -> int:
    """Entry point of ``embshard checkpoint``."""
    args = build_parser().parse_args(argv)
    try:
        if args.action == "inspect":
            from embshard_dist.checkpoint.inspect import format_inspection, inspect_checkpoint

            info = inspect_checkpoint(args.path, verify=args.verify)
            print(json.dumps(info, indent=2) if args.json else format_inspection(info))
            return 1 if info["problems"] else 0
        if args.action == "export":
            from embshard_dist.checkpoint.export import export_checkpoint

            quantize = args.quantize
            index = export_checkpoint(
                args.path,
                args.out,
                optimizer=not (args.weights_only or quantize),
                quantize=quantize,
            )
            kind = f", tables quantized to {quantize}" if quantize else ""
            print(f"exported {len(index['tensors'])} tensors to {args.out}{kind}")
            return 0
        from embshard_dist.checkpoint.import_ import import_state_dict

        meta = import_state_dict(args.source, args.out, prefix=args.prefix, step=args.step)
        print(
            f"imported {len(meta.tables)} tables and {len(meta.dense)} dense tensors into "
            f"{args.out} (step {meta.step}, optimizer state "
            f"{'included' if meta.has_optimizer else 'not included'})"
        )
        return 0
    except ValueError as e:
        print(f"embshard checkpoint {args.action}: error: {e}", file=sys.stderr)
        return 2
