"""Resume is exact: 10 steps straight equal 5 steps, save, new processes, load, 5 more steps.

Two ranks, the mixed plan (table-wise, row-wise, column-wise and data-parallel tables), with
RowWiseAdagrad (saved synchronously) and with Adam (saved asynchronously while two more
training steps change the model before the save is waited for: the checkpoint must still hold
step 5). The final weights, fused optimizer state, dense parameters and dense optimizer state
of both runs must be bit-identical. The processes that saved are killed before the load; the
loading processes start from a differently seeded model. The random generator states and the
step counter come back too.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ckpt import full_state, make_dmp, same, train
from _mp import run_ranks

from embshard_dist.checkpoint.load import load_checkpoint
from embshard_dist.checkpoint.save import save_checkpoint

WORLD = 2
OPTIMIZERS = {"rowwise_adagrad": False, "adam": True}  # optimizer -> asynchronous save


def _straight_and_first_half(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for optimizer, async_save in OPTIMIZERS.items():
        straight = make_dmp(optimizer, "mixed")
        train(straight, range(10))
        out[f"{optimizer}:straight"] = full_state(straight, optimizer)
        dmp = make_dmp(optimizer, "mixed")
        train(dmp, range(5))
        torch.manual_seed(100 + dist.get_rank())  # each rank its own generator states
        random.seed(200 + dist.get_rank())
        handle = save_checkpoint(dmp, Path(root, optimizer), step=5, async_save=async_save)
        if async_save:
            train(dmp, range(5, 7))  # training goes on while the files are written
        handle.wait()
        out[f"{optimizer}:rng"] = (torch.rand(4), random.random())
    return out


def _second_half(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for optimizer in OPTIMIZERS:
        torch.manual_seed(1234)  # the load must bring each rank's saved states back
        random.seed(1234)
        dmp = make_dmp(optimizer, "mixed", seed=7)
        result = load_checkpoint(dmp, Path(root, optimizer))
        out[f"{optimizer}:rng"] = (torch.rand(4), random.random())
        out[f"{optimizer}:result"] = (result.step, result.rng_restored, result.saved_world_size)
        train(dmp, range(result.step, 10))
        out[f"{optimizer}:resumed"] = full_state(dmp, optimizer)
    return out


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    first = run_ranks(WORLD, _straight_and_first_half, str(tmp_path), timeout_s=90)
    second = run_ranks(WORLD, _second_half, str(tmp_path), timeout_s=90)
    for rank in range(WORLD):
        before, after = first[rank], second[rank]
        for optimizer in OPTIMIZERS:
            assert after[f"{optimizer}:result"] == (5, True, WORLD)
            differ = same(before[f"{optimizer}:straight"], after[f"{optimizer}:resumed"])
            assert differ == [], f"{optimizer}, rank {rank}: resumed run differs in {differ}"
            saved_rng, loaded_rng = before[f"{optimizer}:rng"], after[f"{optimizer}:rng"]
            assert torch.equal(saved_rng[0], loaded_rng[0]) and saved_rng[1] == loaded_rng[1]
    # each rank got its own generator states back
    assert not torch.equal(second[0]["adam:rng"][0], second[1]["adam:rng"][0])
