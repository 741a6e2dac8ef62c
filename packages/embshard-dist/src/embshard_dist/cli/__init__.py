"""The ``embshard`` command; each sub-command's module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

_COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("info", "print versions, devices and FBGEMM availability"),
    "train": ("train", "train a small DLRM on synthetic clicks across local processes"),
    "plan": ("plan", "plan the sharding of a table spec and print the plan's stats table"),
    "calibrate": ("calibrate", "measure this machine and write the planner's topology file"),
    "checkpoint": ("checkpoint", "inspect, export (unsharded) and import training checkpoints"),
    "data": ("data", "write synthetic Criteo-format days and convert TSV days to NumPy"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``embshard`` command."""
    parser = argparse.ArgumentParser(
        prog="embshard", description="Sharded embedding tables for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(f"embshard_dist.cli.{_COMMANDS[args.command][0]}")
    result: int = module.run(rest)
    return result


def console_main() -> int:
    """The ``embshard`` script: :func:`main`, then, in a rank started by torchrun, a quick exit.

    ``os._exit`` (after flushing output) skips interpreter teardown, where a gloo worker thread can
    need the GIL after Python released it and abort the process.
    """
    code = main()
    from embshard_dist.cli.launch import launched_by_torchrun  # torch is loaded by now

    if launched_by_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(console_main())
