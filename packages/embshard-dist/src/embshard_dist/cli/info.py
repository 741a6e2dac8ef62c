"""``embshard info``: what embshard runs on here (versions, devices, FBGEMM build)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
from collections.abc import Sequence

from embshard_dist.cli.options import DefaultsHelpFormatter

_PACKAGES = ("embshard-types", "embshard-optim", "embshard-kernels", "embshard-dist", "torch")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def run(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="embshard info", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    parser.parse_args(argv)
    import torch

    for name in _PACKAGES:
        print(f"{name:18} {_version(name)}")
    fbgemm = [d for d in ("fbgemm-gpu-cpu", "fbgemm-gpu") if _version(d) != "not installed"]
    print(f"{'fbgemm':18} {', '.join(f'{d} {_version(d)}' for d in fbgemm) or 'not installed'}")
    print(f"{'python':18} {platform.python_version()} on {platform.machine()}")
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"{'devices':18} cpu ({torch.get_num_threads()} threads), {cuda} CUDA device(s)")
    return 0
