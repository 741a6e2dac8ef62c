"""Faults during a checkpoint: a frozen rank, a full disk; every rank told, nothing left behind.

* A rank frozen (``SIGSTOP``, sent to itself inside ``torch.distributed.checkpoint``'s write or
  read) during a save and during a load: the other rank must raise ``CollectiveError`` naming
  the collective and the frozen peer, within about the collective limit (3 s here), not wait for
  the process group's own timeout. The surviving rank kills the frozen one afterwards.
* A full disk on rank 1 (its files go through a real file whose writes raise ``ENOSPC`` once a
  few KiB are written, as a full filesystem's do): the save fails on both ranks with "No space
  left on device" and rank 1 named, the hidden temporary directory is removed, and a later save
  into the same place succeeds and loads.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from _ckpt import full_state, make_dmp, pieces, same, train
from _mp import Exited, run_on_ranks, run_ranks
from torch import Tensor

from embshard_dist.checkpoint import load_checkpoint, save_checkpoint
from embshard_dist.comm.timeouts import CollectiveError

OPTIMIZER = "rowwise_adagrad"
LIMIT_S = 3.0


def _pids() -> list[int]:
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return [int(p) for p in pids]


def _stop_myself_in(cls: Any, method: str) -> None:
    """Make this process stop itself (SIGSTOP) when ``cls.method`` is next called."""

    def frozen(self: Any, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)
        raise AssertionError("a stopped rank was resumed")

    setattr(cls, method, frozen)


def _freeze(root: str, during: str) -> dict[str, Any]:
    pids = _pids()
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(1))
    path = Path(root, "ckpt")
    if during == "load":
        save_checkpoint(dmp, path, step=1)
    if dist.get_rank() == 1:
        if during == "save":
            _stop_myself_in(dcp_filesystem.FileSystemWriter, "write_data")
        else:
            _stop_myself_in(dcp_filesystem.FileSystemReader, "read_data")
    before = _local(dmp)
    start = time.monotonic()
    try:
        if during == "save":
            save_checkpoint(dmp, path, step=1)
        else:
            load_checkpoint(dmp, path)
        return {"error": None}
    except CollectiveError as e:
        return {
            "error": str(e),
            "peer": e.peer,
            "elapsed": time.monotonic() - start,
            "unchanged": _same_local(before, _local(dmp)),
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGKILL)


def _local(dmp: Any) -> dict[str, list[Tensor]]:
    """Copies of this rank's pieces of every state-dict tensor (no collective)."""
    return {
        key: [t.detach().clone() for _, t in pieces(value)]
        for key, value in dmp.state_dict().items()
    }


def _same_local(a: dict[str, list[Tensor]], b: dict[str, list[Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k])
        and all(bool((x == y).all()) for x, y in zip(a[k], b[k], strict=True))
        for k in a
    )


def _check_frozen(tmp_path: Path, during: str) -> None:
    results = run_ranks(
        2,
        _freeze,
        str(tmp_path),
        during,
        may_exit=[1],
        timeout_s=120,
        collective_timeout_s=LIMIT_S,
    )
    assert isinstance(results[1], Exited), results[1]
    found = results[0]
    assert found["error"], f"the {during} on rank 0 succeeded although rank 1 was frozen"
    assert "torch.distributed.checkpoint" in found["error"], found["error"]
    assert "timed out" in found["error"], found["error"]
    assert found["peer"] == 1, found
    assert found["unchanged"], f"rank 0's model changed during the failed {during}"
    assert found["elapsed"] < 2 * LIMIT_S + 2.0, f"took {found['elapsed']:.1f} s"


def test_a_rank_frozen_while_saving_gives_the_other_a_collective_error(tmp_path: Path) -> None:
    _check_frozen(tmp_path, "save")
    assert not (tmp_path / "ckpt").exists()


def test_a_rank_frozen_while_loading_gives_the_other_a_collective_error(tmp_path: Path) -> None:
    _check_frozen(tmp_path, "load")


class _FullDisk(io.FileIO):
    """A real file on a "disk" with a few KiB free: past that, writes raise ``ENOSPC``."""

    free: ClassVar[list[int]] = [4096]

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.free[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        self.free[0] -= size
        return super().write(data)


def _fill_disk() -> Any:
    _FullDisk.free[0] = 4096  # a fresh "disk", also in a process that ran this before
    original = dcp_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with original(self, path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_FullDisk(str(path), "w")) as stream:  # what open(.., "wb") is
            yield stream

    dcp_filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    return original


def _disk_full(root: str) -> dict[str, Any]:
    dmp = make_dmp(OPTIMIZER, "mixed")
    train(dmp, range(2))
    path = Path(root, "ckpt")
    original = _fill_disk() if dist.get_rank() == 1 else None
    try:
        save_checkpoint(dmp, path, step=2)
        error = ""
    except RuntimeError as e:
        error = str(e)
    finally:
        if original is not None:
            dcp_filesystem.FileSystem.create_stream = original  # type: ignore[method-assign]
    dist.barrier()
    leftovers = sorted(p.name for p in Path(root).iterdir())
    saved = full_state(dmp, OPTIMIZER)
    save_checkpoint(dmp, path, step=2)  # space again: the same path saves
    model = make_dmp(OPTIMIZER, "mixed", seed=4)
    load_checkpoint(model, path)
    return {
        "error": error,
        "leftovers": leftovers,
        "differ": same(saved, full_state(model, OPTIMIZER)),
    }


def test_a_full_disk_fails_the_save_with_its_reason_and_leaves_nothing(tmp_path: Path) -> None:
    # No rank dies or hangs here (the group stays usable: the retried save and the load run on
    # it), so the session's pool of ranks serves; rank 1's patched stream is undone after the
    # failed save.
    results = run_on_ranks(2, _disk_full, str(tmp_path), timeout_s=120)
    for rank, found in enumerate(results):
        assert "No space left on device" in found["error"], f"rank {rank}: {found['error']}"
        assert "rank 1" in found["error"], f"rank {rank}: {found['error']}"
        assert "dict_keys" not in found["error"], found["error"]
        assert found["leftovers"] == [], f"rank {rank}: left {found['leftovers']}"
        assert found["differ"] == [], f"rank {rank}: the retried save differs in {found['differ']}"
