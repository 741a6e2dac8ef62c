"""A save killed half-way leaves the previous checkpoint intact, loadable and bit-identical.

Two ranks save step 3 into a directory of checkpoints, train one more step and save step 4;
during that save rank 1 writes its shard file, truncates it and dies (``os._exit``) before the
save could be committed. Rank 0 must get an error instead of hanging; ``latest`` must still
name step 3, no ``step-00000004`` may exist. New processes then load the directory (its
latest: step 3) and must find exactly the state saved at step 3; their next save removes the
dead save's leftovers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from _ckpt import full_state, make_dmp, same, train
from _mp import Exited, run_ranks

from embshard_dist.checkpoint.inspect import inspect_checkpoint
from embshard_dist.checkpoint.load import load_checkpoint
from embshard_dist.checkpoint.save import save_to_directory

OPTIMIZER = "rowwise_adagrad"


def _die_while_writing() -> None:
    """Make this rank write its shard file, cut it in half and die (inside the save)."""
    original = dcp_filesystem.FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        original(self, plan, planner).wait()
        for file in Path(self.path).glob(f"__{dist.get_rank()}_*.distcp"):
            os.truncate(file, file.stat().st_size // 2)
        os._exit(9)

    dcp_filesystem.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def _save_then_die(root: str) -> dict[str, Any]:
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(3))
    save_to_directory(dmp, root, step=3)
    saved = full_state(dmp, OPTIMIZER)
    train(dmp, range(3, 4))
    if dist.get_rank() == 1:
        _die_while_writing()
    try:
        save_to_directory(dmp, root, step=4)
    except Exception as e:  # the peer died: the save must fail, not hang
        return {"saved": saved, "error": type(e).__name__}
    return {"saved": saved, "error": None}


def _load_and_save(root: str) -> dict[str, Any]:
    dmp = make_dmp(OPTIMIZER, "mixed", seed=5)
    result = load_checkpoint(dmp, root)
    loaded = full_state(dmp, OPTIMIZER)
    save_to_directory(dmp, root, step=4)
    return {"step": result.step, "path": result.path.name, "loaded": loaded}


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    first = run_ranks(2, _save_then_die, str(root), may_exit=[1], timeout_s=90)
    assert first[1] == Exited(9)
    assert first[0]["error"] is not None, "rank 0's save succeeded although rank 1 died"
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert not (root / "step-00000004").exists()
    leftovers = list(root.glob(".step-00000004.tmp-*"))
    assert leftovers, "the killed save should have left its hidden directory"
    info = inspect_checkpoint(root)
    assert info["step"] == 3 and info["problems"] == []

    second = run_ranks(2, _load_and_save, str(root), timeout_s=90)
    for rank in range(2):
        assert second[rank]["step"] == 3 and second[rank]["path"] == "step-00000003"
        differ = same(first[0]["saved"], second[rank]["loaded"])
        assert differ == [], f"rank {rank}: the loaded state differs in {differ}"
    assert not any(p.exists() for p in leftovers), "the next save removes the leftovers"
    assert (root / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003", "step-00000004"]
