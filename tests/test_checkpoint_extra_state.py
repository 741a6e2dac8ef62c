"""The job's own state rides in the checkpoint: ``extra_state=`` saves and restores ``Stateful``s.

Each of two ranks has a data loader position (an int and a tensor, different per rank) and a
replicated LR scheduler; they are saved with the model (the README's call: no ``step=``,
imported from ``embshard_dist.checkpoint``), synchronously and in the background, and loaded
into fresh objects, which must get exactly their rank's saved state. A load asking for state the
checkpoint lacks is refused on every rank with the objects untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ckpt import make_dmp, train
from _mp import run_on_ranks

from embshard_dist.checkpoint import load_checkpoint, save_checkpoint

OPTIMIZER = "rowwise_adagrad"


class Position:
    """A stand-in for a data loader's position: a batch index and a shuffling seed tensor."""

    def __init__(self, batch: int, seed: torch.Tensor) -> None:
        self.batch, self.seed = batch, seed

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "seed": self.seed, "nested": {"epoch": self.batch // 10}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch, self.seed = int(state["batch"]), state["seed"].clone()


def _round_trip(root: str, async_save: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(2))
    loader = Position(batch=17 + rank, seed=torch.arange(4) * (rank + 1))
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), 3)
    for _ in range(5):
        sched.step()
    path = Path(root, f"async-{async_save}")
    handle = save_checkpoint(
        dmp, path, async_save=async_save, extra_state={"loader": loader, "sched": sched}
    )
    loader.batch = -1  # changed after the call: the save keeps what it was given
    handle.wait()
    fresh = Position(batch=0, seed=torch.zeros(4, dtype=torch.int64))
    fresh_sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), 3)
    model = make_dmp(OPTIMIZER, "mixed", seed=2)
    result = load_checkpoint(model, path, extra_state={"loader": fresh, "sched": fresh_sched})
    refused = ""
    other = Position(batch=5, seed=torch.ones(4, dtype=torch.int64))
    try:
        load_checkpoint(model, path, extra_state={"metrics": other})
    except ValueError as e:
        refused = str(e)
    return {
        "batch": fresh.batch,
        "seed": fresh.seed.tolist(),
        "epochs": fresh_sched.last_epoch,
        "step": result.step,
        "refused": refused,
        "other": (other.batch, other.seed.tolist()),
    }


def test_extra_state_round_trips_per_rank(tmp_path: Path) -> None:
    for async_save in (False, True):
        results = run_on_ranks(2, _round_trip, str(tmp_path), async_save, timeout_s=120)
        for rank, found in enumerate(results):
            assert found["batch"] == 17 + rank, found
            assert found["seed"] == [i * (rank + 1) for i in range(4)], found
            assert found["epochs"] == 5, found
            assert found["step"] == 0, found
            assert "'metrics'" in found["refused"] and "not in the checkpoint" in found["refused"]
            assert found["other"] == (5, [1, 1, 1, 1]), "a refused load changed the object"
