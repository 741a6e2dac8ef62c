"""Resharding on load: a checkpoint saved on N processes under one plan loads on M under another.

Every pair of {table-wise, row-wise, column-wise, mixed} x {2, 3 processes} is covered: each
of the eight (plan, world size) combinations saves a checkpoint of a small DLRM trained two
steps with partial row-wise Adam (a point-wise and a row-wise optimizer state per table), and
each checkpoint is loaded under every plan on 2 and on 3 processes. After the load, every
table's whole weight and optimizer state, the dense tensors and the dense optimizer's state,
gathered, must be bit-identical to what was saved; one further step must then match the
unsharded model loaded from the saved state and stepped on the same global batch (1e-5, the
tolerance of the sharded-vs-unsharded training tests: summation orders differ).

Cost: one rank pool per world size; each call saves or loads several plans. Models exposing
their state as DTensors (``output_dtensor=True``) save and load the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _ckpt import PLANS, full_state, largest_difference, make_dmp, reference_step, same, train
from _mp import run_on_ranks
from torch import Tensor

from embshard_dist.checkpoint.load import load_checkpoint
from embshard_dist.checkpoint.save import save_checkpoint

OPTIMIZER = "partial_rowwise_adam"
STEPS = 2
TOL = 1e-5
WORLDS = (2, 3)


def _save_all(root: str) -> dict[str, dict[str, Tensor]]:
    """Train and save every plan on this world; the saved states (rank 0's copy)."""
    world = dist.get_world_size()
    saved = {}
    for plan in PLANS:
        dmp = make_dmp(OPTIMIZER, plan)
        train(dmp, range(STEPS))
        path = Path(root, f"w{world}-{plan}")
        save_checkpoint(dmp, path, step=STEPS)
        saved[path.name] = full_state(dmp, OPTIMIZER)
    return saved if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("reshard")
    saved: dict[str, Any] = {}
    for world in WORLDS:
        saved.update(run_on_ranks(world, _save_all, str(root), timeout_s=120)[0])
    return root, saved


def _load_all(root: str, saved: dict[str, dict[str, Tensor]]) -> dict[str, Any]:
    """Load every checkpoint under every plan here; what differs, per (checkpoint, plan)."""
    out: dict[str, Any] = {}
    for name, state in saved.items():
        expected = reference_step(state, OPTIMIZER, STEPS)
        for plan in PLANS:
            dmp = make_dmp(OPTIMIZER, plan, seed=11)  # other weights: the load must replace them
            result = load_checkpoint(dmp, Path(root, name))
            loaded = full_state(dmp, OPTIMIZER)
            train(dmp, range(STEPS, STEPS + 1))
            out[f"{name} -> w{dist.get_world_size()}-{plan}"] = {
                "step": result.step,
                "not_identical": same(loaded, state),
                "after_step": largest_difference(full_state(dmp, OPTIMIZER), expected),
            }
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_every_plan_and_world_loads_every_checkpoint(
    world: int, checkpoints: tuple[Path, dict[str, Any]]
) -> None:
    root, saved = checkpoints
    assert len(saved) == len(PLANS) * len(WORLDS)
    results = run_on_ranks(world, _load_all, str(root), saved, timeout_s=150)
    assert len(results[0]) == len(saved) * len(PLANS)
    for rank_results in results:
        for pair, found in rank_results.items():
            assert found["step"] == STEPS, pair
            assert found["not_identical"] == [], f"{pair}: differ from the saved state"
            worst, key = found["after_step"]
            assert worst <= TOL, f"{pair}: {key} is {worst} from the unsharded step"


def _dtensor_state(root: str) -> dict[str, Any]:
    """Save a model exposing DTensors; load into ShardedTensor and DTensor models."""
    dmp = make_dmp(OPTIMIZER, "mixed", output_dtensor=True)
    train(dmp, range(STEPS))
    save_checkpoint(dmp, Path(root, "dtensor"), step=STEPS)
    saved = full_state(dmp, OPTIMIZER)
    out = {}
    for plan, output_dtensor in (("column_wise", False), ("row_wise", True)):
        other = make_dmp(OPTIMIZER, plan, seed=4, output_dtensor=output_dtensor)
        load_checkpoint(other, Path(root, "dtensor"))
        out[f"{plan}, DTensor {output_dtensor}"] = same(full_state(other, OPTIMIZER), saved)
    return out


def test_dtensor_state_saves_and_loads(tmp_path: Path) -> None:
    for found in run_on_ranks(2, _dtensor_state, str(tmp_path)):
        assert found == {"column_wise, DTensor False": [], "row_wise, DTensor True": []}
