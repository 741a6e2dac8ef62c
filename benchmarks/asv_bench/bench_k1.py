"""asv: K1 kernels (forward and forward+backward+update) for embshard and FBGEMM, and the peak
resident memory of a process that builds the K1 tables and runs one step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k1_contenders import embshard_collection, fbgemm_tbe
from workloads import K1


class K1Kernels:
    params = ["embshard", "fbgemm"]
    param_names = ["contender"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, contender: str) -> None:
        torch.set_num_threads(1)
        build = embshard_collection if contender == "embshard" else fbgemm_tbe
        self.step, self.forward = build(K1())

    def time_step(self, contender: str) -> None:
        self.step()

    def time_forward(self, contender: str) -> None:
        self.forward()

    def peakmem_step(self, contender: str) -> None:
        self.step()
