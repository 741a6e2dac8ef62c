"""Saving a ``DistributedModelParallel``'s training state, atomically, maybe in the background.

Each rank writes only its own shards (and the job's ``extra_state``) through
``torch.distributed.checkpoint`` into a hidden directory, hashes the files it wrote, and rank 0
records the digests and renames the directory into place once all have written. The exchanges
run on a gloo group bounded by embshard's collective limit. An asynchronous save copies the state
to CPU first, then writes on a background thread.

Guarantees: every rank calls together; an existing destination is refused before anything is
written; an error on any rank is raised on every rank (a rank's own reason kept, e.g. ``No space
left on device``) and the hidden directory is removed; a rank that freezes or dies gives the
others ``CollectiveError``; a save stopped half-way leaves earlier checkpoints and ``latest``
untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.checkpoint.atomic import (
    commit,
    fsync_file,
    prune,
    remove_stale,
    temporary_path,
    write_latest,
)
from embshard_dist.checkpoint.bounded import checkpoint_group, failure_summary, run_collective
from embshard_dist.checkpoint.extra_state import (
    capture_extra_state,
    check_extra_state,
    extra_file,
    write_extra_state,
)
from embshard_dist.checkpoint.format import (
    FORMAT_VERSION,
    OBJECT,
    CheckpointMetadata,
    TensorInfo,
    dense_optim_key,
    dtype_name,
    model_key,
    optim_key,
    parse_dtype,
    rng_file,
    step_dir_name,
)
from embshard_dist.checkpoint.integrity import file_checksum
from embshard_dist.checkpoint.layout import ModelLayout, describe_model
from embshard_dist.checkpoint.tensors import Piece, Shard, quiet, sharded_tensor
from embshard_dist.checkpoint.train_state import agree, capture_rng, gather_json

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from embshard_dist.dmp.model_parallel import DistributedModelParallel

__all__ = [
    "SaveHandle",
    "save_checkpoint",
    "save_entries",
    "save_to_directory",
    "wait_for_pending_save",
]


class SaveHandle:
    """A save in progress or done; ``future`` completes with the path or the save's error."""

    def __init__(self, path: Path, future: Future[Path]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        """Whether the save finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save to finish and return the checkpoint's path.

        Raises:
            Exception: whatever stopped the save (on every rank).
        """
        return self._future.result(timeout)


_pending: SaveHandle | None = None


def wait_for_pending_save() -> None:
    """Wait for this process's background save, if one is running (raises its error)."""
    global _pending
    if _pending is not None:
        previous, _pending = _pending, None
        previous.wait()


def save_checkpoint(
    dmp: DistributedModelParallel,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    async_save: bool = False,
    extra_state: Mapping[str, Stateful] | None = None,
) -> SaveHandle:
    """Save ``dmp``'s training state to the new checkpoint directory ``path`` (all ranks call).

    Args:
        path: the checkpoint to create (its parent is created if needed; it must not exist).
        step: training steps taken so far (restored by the load, and given to the fused
            optimizers' step counters); ``None`` records 0 and a load then leaves the step
            counters as they are.
        async_save: write in a background thread.
        extra_state: the job's own state to keep with the model (data loader position, LR
            scheduler, metrics): ``Stateful`` objects by name, saved per rank from their
            ``state_dict()`` (taken now) and restored by ``load_checkpoint(extra_state=...)``.

    Returns:
        A handle; with ``async_save=False`` the save is already complete.

    Raises:
        ValueError: ``path`` exists, ``step`` is negative or ``extra_state`` is not a mapping of
            ``Stateful`` objects with the same names on every rank (on every rank, nothing
            written).
        RuntimeError: a rank failed to write (its reason, e.g. ``No space left on device``,
            is in the message; the hidden temporary directory is removed).
        CollectiveError: a rank froze or died during the save.
    """
    return _save(
        dmp,
        Path(path),
        step=step,
        async_save=async_save,
        after_commit=None,
        extra_state=extra_state,
    )


def save_to_directory(
    dmp: DistributedModelParallel,
    root: str | os.PathLike[str],
    *,
    step: int,
    keep_last: int = 2,
    async_save: bool = False,
    extra_state: Mapping[str, Stateful] | None = None,
) -> SaveHandle:
    """Save into ``root/step-NNNNNNNN``, then point ``root/latest`` at it and prune old ones.

    Args:
        keep_last: complete checkpoints to keep (the new one included; at least 1).
        extra_state: as for :func:`save_checkpoint`.

    Raises:
        ValueError: ``keep_last`` < 1, or that step's checkpoint exists.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    root = Path(root)
    final = root / step_dir_name(step)

    def after_commit(path: Path) -> None:
        write_latest(root, path.name)
        prune(root, keep_last)

    return _save(
        dmp,
        final,
        step=step,
        async_save=async_save,
        after_commit=after_commit,
        extra_state=extra_state,
    )


def _save(
    dmp: DistributedModelParallel,
    final: Path,
    *,
    step: int | None,
    async_save: bool,
    after_commit: Callable[[Path], None] | None,
    extra_state: Mapping[str, Stateful] | None,
) -> SaveHandle:
    global _pending
    wait_for_pending_save()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    layout = describe_model(dmp)
    pg, rank = layout.pg, layout.rank
    extra = dict(extra_state or {})
    problems = check_extra_state(extra, what="save")
    token, extra_names = _shared_token(pg, sorted(extra))
    if not problems and sorted(extra) != extra_names:
        problems.append(
            f"rank {rank} gives extra_state {sorted(extra)} but rank 0 gives {extra_names}; "
            "pass the same names on every rank"
        )
    tmp = temporary_path(final, token)
    if rank == 0:
        problems += _prepare(final, tmp, clean=after_commit is not None)
    try:
        agree(problems, group=pg, name=f"checkpoint save to {str(final)!r}")
    except ValueError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    metadata = _metadata(layout, step, dmp.plan.to_dict(), tuple(sorted(extra)))
    with quiet():
        entries = save_entries(layout, stage=async_save)
    states = capture_extra_state(extra, stage=async_save)
    rng = capture_rng()
    group = checkpoint_group(pg)  # made here, on every rank: new_group is a collective

    def write() -> Path:
        with quiet():
            return _write(entries, (rng, states), metadata, tmp, final, rank, group, after_commit)

    future: Future[Path] = Future()
    if not async_save:
        future.set_result(write())
        return SaveHandle(final, future)

    def run() -> None:
        try:
            future.set_result(write())
        except BaseException as e:  # the caller sees it through wait()
            future.set_exception(e)

    threading.Thread(target=run, name=f"embshard-save-{final.name}", daemon=False).start()
    _pending = SaveHandle(final, future)
    return _pending


def _shared_token(pg: dist.ProcessGroup | None, extra: list[str]) -> tuple[str, list[str]]:
    """A random token chosen by rank 0 and rank 0's extra-state names, the same on every rank."""
    first = gather_json([secrets.token_hex(6), extra], group=pg, name="checkpoint.token")[0]
    return str(first[0]), [str(n) for n in first[1]]


def _prepare(final: Path, tmp: Path, *, clean: bool) -> list[str]:
    """Rank 0: refuse an existing destination, clear leftovers, create the hidden directory."""
    if final.exists():
        return [f"{str(final)!r} exists; save under another path or remove it first"]
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if clean:
            remove_stale(final.parent)
        (tmp / "rng").mkdir(parents=True)
    except OSError as e:
        return [f"cannot create {str(tmp)!r}: {e}"]
    return []


def _write(
    entries: dict[str, Any],
    own: tuple[dict[str, Any], dict[str, Any]],
    metadata: CheckpointMetadata,
    tmp: Path,
    final: Path,
    rank: int,
    group: dist.ProcessGroup,
    after_commit: Callable[[Path], None] | None,
) -> Path:
    """Write through ``torch.distributed.checkpoint``, hash, and let rank 0 commit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from embshard_dist.checkpoint.writer import RecordingWriter

    where = f"writing the checkpoint {str(final)!r} failed"
    writer = RecordingWriter(tmp)
    try:
        run_collective(
            f"checkpoint save to {str(final)!r} (torch.distributed.checkpoint)",
            lambda: dcp.save(entries, storage_writer=writer, process_group=group),
            group=group,
        )
    except CheckpointException as e:  # every rank got it from the same exchange: all stopped
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{where}: {failure_summary(e)}") from e
    local = _finish_rank(own, tmp, rank, writer.written)
    reports = gather_json(local, group=group, name=f"checkpoint files of {str(final)!r}")
    problems = [p for report in reports for p in report["problems"]]
    if problems:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{where}: " + "; ".join(problems))
    checksums = {n: d for report in reports for n, d in report["checksums"].items()}
    if rank == 0:
        try:
            commit(tmp, final, dataclasses.replace(metadata, checksums=checksums))
            if after_commit is not None:
                after_commit(final)
        except (OSError, ValueError) as e:
            problems.append(f"rank 0 could not commit {str(final)!r}: {e}")
            if not final.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    agree(problems, group=group, name=f"checkpoint commit of {str(final)!r}")
    return final


def _finish_rank(
    own: tuple[dict[str, Any], dict[str, Any]], tmp: Path, rank: int, written: list[str]
) -> dict[str, Any]:
    """This rank's generator states and extra state written, and the digests of its files."""
    rng, states = own
    try:
        names = [*written, rng_file(rank)]
        torch.save(rng, tmp / rng_file(rank))
        if states:
            write_extra_state(states, tmp / extra_file(rank))
            names.append(extra_file(rank))
        for name in names[len(written) :]:
            fsync_file(tmp / name)
        return {"problems": [], "checksums": {n: file_checksum(tmp / n) for n in names}}
    except OSError as e:
        return {"problems": [f"rank {rank}: {type(e).__name__}: {e}"], "checksums": {}}


def _metadata(
    layout: ModelLayout, step: int | None, plan: dict[str, Any], extra: tuple[str, ...]
) -> CheckpointMetadata:
    dense_optimizer = {
        param: {name: _tensor_info(value) for name, value in states.items()}
        for param, states in layout.dense_state.items()
    }
    return CheckpointMetadata(
        version=FORMAT_VERSION,
        step=0 if step is None else step,
        world_size=layout.world_size,
        tables=tuple(t.info for t in layout.tables.values()),
        dense={k: _tensor_info(v) for k, v in layout.dense.items()},
        has_optimizer=True,
        dense_optimizer=dense_optimizer,
        dense_param_groups=layout.dense_param_groups,
        fused_hyperparameters=layout.fused_hyperparameters,
        plan=plan,
        files={},
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        source="save",
        extra_state=extra,
        step_known=step is not None,
    )


def _tensor_info(value: Any) -> TensorInfo:
    if isinstance(value, Tensor):
        return TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    return TensorInfo((), OBJECT)


def save_entries(layout: ModelLayout, *, stage: bool) -> dict[str, Any]:
    """The ``torch.distributed.checkpoint`` state dict of a model (plan-independent keys).

    Args:
        stage: copy every tensor to CPU memory (for background saves); else wrap the live tensors.
    """

    def own(t: Tensor) -> Tensor:
        return t.detach().to("cpu", copy=True) if stage else t

    out: dict[str, Any] = {}
    pg = layout.pg
    for key, table in layout.tables.items():
        info, rows = table.info, table.info.rows
        weight = [Piece(p.offsets, own(p.tensor)) for p in table.weight]
        dtype = parse_dtype(info.dtype, what=f"table {info.name!r}")
        out[model_key(key)] = _entry(weight, table.shards, table.size, dtype, pg)
        for name, state in table.states.items():
            dtype = parse_dtype(state.info.dtype, what=f"table {info.name!r} state {name!r}")
            if state.info.rowwise:
                pieces = [Piece((p.offsets[0],), own(p.tensor)) for p in state.pieces]
                pieces = [p for p in pieces if p.offsets[0] < rows]  # column block 0's copy
                entry = _entry(pieces, table.row_shards(), (rows,), dtype, pg)
            else:
                pieces = [Piece(p.offsets, own(p.tensor)) for p in state.pieces]
                entry = _entry(pieces, table.shards, table.size, dtype, pg)
            out[optim_key(key, name)] = entry
    for key, tensor in layout.dense.items():
        out[model_key(key)] = own(tensor)
    for param, states in layout.dense_state.items():
        for name, value in states.items():
            out[dense_optim_key(param, name)] = own(value) if isinstance(value, Tensor) else value
    return out


def _entry(
    pieces: list[Piece],
    shards: list[Shard] | None,
    size: tuple[int, ...],
    dtype: torch.dtype,
    pg: dist.ProcessGroup | None,
) -> Any:
    if shards is None:
        (piece,) = pieces
        return piece.tensor
    return sharded_tensor(pieces, shards, size, dtype, pg)
