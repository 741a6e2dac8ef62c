"""Loading a checkpoint into a ``DistributedModelParallel``, under any plan and world size.

Each rank asks ``torch.distributed.checkpoint`` for exactly the blocks its shards cover, so a
checkpoint saved on N processes under one plan loads bit for bit on M under another.

Guarantees: every rank checks the checkpoint (every file's size; its share of the files'
checksums) and the ranks agree before anything is read; reads go to fresh buffers copied into the
model (and handed to the ``extra_state`` objects) only when all succeeded, so a failed load leaves
them untouched and raises the same ``ValueError`` on every rank. A rank that freezes or dies
gives the others ``CollectiveError`` within about the collective limit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.checkpoint.bounded import checkpoint_group, failure_summary, run_collective
from embshard_dist.checkpoint.extra_state import (
    check_loadable,
    extra_file,
    read_extra_state,
    restore_extra_state,
)
from embshard_dist.checkpoint.format import (
    OBJECT,
    CheckpointMetadata,
    dense_optim_key,
    model_key,
    optim_key,
    parse_dtype,
    read_metadata,
    resolve_checkpoint,
    rng_file,
)
from embshard_dist.checkpoint.integrity import verify_files
from embshard_dist.checkpoint.layout import ModelLayout, TableLayout, describe_model
from embshard_dist.checkpoint.save import wait_for_pending_save
from embshard_dist.checkpoint.tensors import Piece, quiet, read_tiling, sharded_tensor
from embshard_dist.checkpoint.train_state import agree, from_json_value, restore_rng
from embshard_dist.checkpoint.validate import check_dense_optimizer, check_model
from embshard_dist.comm.timeouts import CollectiveError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from embshard_dist.dmp.model_parallel import DistributedModelParallel

__all__ = ["LoadResult", "load_checkpoint"]


@dataclass(frozen=True)
class LoadResult:
    """What a load did.

    Args:
        path: the checkpoint loaded (a directory of checkpoints resolves to its latest).
        step: the training step it was saved at (continue training from there).
        optimizer_loaded: whether optimizer state, step counters and learning rates were.
        rng_restored: whether this rank's generator states were restored (same world size).
    """

    path: Path
    step: int
    saved_world_size: int
    optimizer_loaded: bool
    dense_loaded: bool
    rng_restored: bool


_Copy = tuple[Tensor, Tensor]


def load_checkpoint(
    dmp: DistributedModelParallel,
    path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    dense: bool = True,
    rng: bool = True,
    extra_state: Mapping[str, Stateful] | None = None,
) -> LoadResult:
    """Load a checkpoint into ``dmp`` (every rank calls it).

    Args:
        path: a checkpoint, or a directory of checkpoints (its ``latest`` one is loaded).
        optimizer: load the optimizers' state, step counter and learning rates.
        dense: load the dense tensors (``False`` for a checkpoint imported from an
            embedding collection alone).
        rng: restore the random generator states (only when the world size is the same).
        extra_state: ``Stateful`` objects saved with ``save_checkpoint(extra_state=...)``, by
            name; each gets this rank's saved state through ``load_state_dict`` (same world
            size only).

    Raises:
        ValueError: on every rank, before the model is touched: not a checkpoint, a newer
            format, missing, truncated or changed files (named, with the tables they hold), a
            mismatch with the model or the extra state, or a failed read.
        CollectiveError: a rank froze or died during the load.
    """
    wait_for_pending_save()
    with quiet():
        return _load(
            dmp, path, optimizer=optimizer, dense=dense, rng=rng, extra=dict(extra_state or {})
        )


def _load(
    dmp: DistributedModelParallel,
    path: str | os.PathLike[str],
    *,
    optimizer: bool,
    dense: bool,
    rng: bool,
    extra: dict[str, Stateful],
) -> LoadResult:
    layout = describe_model(dmp)
    pg = layout.pg
    where = f"checkpoint load from {str(path)!r}"
    problems: list[str] = []
    final = Path(path)
    metadata: CheckpointMetadata | None = None
    try:
        final = resolve_checkpoint(path)
        metadata = read_metadata(final)
    except ValueError as e:
        problems.append(str(e))
    if metadata is not None:
        me, size = dist.get_rank(pg), dist.get_world_size(pg)
        problems += verify_files(final, metadata, rank=me, world_size=size)
        problems += check_model(metadata, layout, optimizer=optimizer, dense=dense)
        problems += check_loadable(extra, metadata, layout.world_size)
    states: dict[str, Any] = {}
    if metadata is not None and extra and not problems:
        states, found = read_extra_state(final / extra_file(layout.rank), sorted(extra))
        problems += found
    if metadata is not None and not metadata.checksums and not problems and me == 0:
        _warn_unverified(final)
    agree(problems, group=pg, name=where)
    assert metadata is not None
    created = _init_dense_state(dmp, layout, metadata) if optimizer else False
    problems = (
        check_dense_optimizer(metadata, layout.dense_state, layout.dense_param_groups)
        if optimizer
        else []
    )
    if problems and created:
        state = dmp.dense_optimizer.state
        if isinstance(state, MutableMapping):
            state.clear()
    agree(problems, group=pg, name=where)

    targets, copies = _targets(layout, metadata, optimizer=optimizer, dense=dense)
    _read(targets, final, pg, where)
    with torch.no_grad():
        for live, loaded in copies:
            live.copy_(loaded)
    if optimizer:
        _load_optimizers(dmp, layout, metadata, targets)
    restore_extra_state(extra, states)
    restored = False
    rng_path = final / rng_file(layout.rank)
    if rng and metadata.world_size == layout.world_size and rng_path.is_file():
        restore_rng(rng_path)
        restored = True
    return LoadResult(
        path=final,
        step=metadata.step,
        saved_world_size=metadata.world_size,
        optimizer_loaded=optimizer,
        dense_loaded=dense,
        rng_restored=restored,
    )


def _init_dense_state(
    dmp: DistributedModelParallel, layout: ModelLayout, metadata: CheckpointMetadata
) -> bool:
    """Give a stateless dense optimizer zero state when the checkpoint holds some."""
    if not metadata.dense_optimizer or layout.dense_state:
        return False
    optimizer = dmp.dense_optimizer
    optimizer.init_state()
    layout.dense_state = {p: dict(s) for p, s in optimizer.state_dict()["state"].items()}
    return True


_warned: set[Path] = set()


def _warn_unverified(path: Path) -> None:
    """Say once per checkpoint that it has no checksums to verify."""
    if path not in _warned:
        _warned.add(path)
        warnings.warn(
            f"checkpoint {str(path)!r} was written before embshard recorded checksums: its "
            "files are checked by size only; save it again to get verified checkpoints",
            UserWarning,
            stacklevel=4,
        )


def _read(targets: dict[str, Any], path: Path, pg: dist.ProcessGroup | None, where: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    group = checkpoint_group(pg)
    problems: list[str] = []
    try:
        run_collective(
            f"{where} (torch.distributed.checkpoint)",
            lambda: dcp.load(
                targets, storage_reader=dcp.FileSystemReader(path), process_group=group
            ),
            group=group,
        )
    except CollectiveError:
        raise
    except (Exception, CheckpointException) as e:  # reported on every rank; model untouched
        problems.append(f"reading {str(path)!r} failed: {failure_summary(e)}; its data is damaged")
    agree(problems, group=pg, name=where)


def _targets(
    layout: ModelLayout, metadata: CheckpointMetadata, *, optimizer: bool, dense: bool
) -> tuple[dict[str, Any], list[_Copy]]:
    """Fresh buffers to read into (by storage key), and where each goes afterwards."""
    targets: dict[str, Any] = {}
    copies: list[_Copy] = []
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(layout.pg or dist.group.WORLD)
    other = ranks[(ranks.index(me) + 1) % len(ranks)]
    for key, table in layout.tables.items():
        dtype = parse_dtype(table.info.dtype, what=f"table {key!r}")
        targets[model_key(key)] = _blocks(table, table.weight, dtype, layout, copies)
        if not optimizer:
            continue
        for name, state in table.states.items():
            state_dtype = parse_dtype(state.info.dtype, what=f"table {key!r} state {name!r}")
            if state.info.rowwise:
                entry = _rows(table, state.pieces, state_dtype, layout, copies, me, other)
            else:
                entry = _blocks(table, state.pieces, state_dtype, layout, copies)
            targets[optim_key(key, name)] = entry
    if dense:
        for key, tensor in layout.dense.items():
            buffer = torch.empty_like(tensor)
            targets[model_key(key)] = buffer
            copies.append((tensor, buffer))
    if optimizer:
        for param, states in metadata.dense_optimizer.items():
            for name, info in states.items():
                targets[dense_optim_key(param, name)] = (
                    None
                    if info.dtype == OBJECT
                    else torch.empty(info.shape, dtype=parse_dtype(info.dtype, what=param))
                )
    return targets, copies


def _blocks(
    table: TableLayout,
    pieces: list[Piece],
    dtype: torch.dtype,
    layout: ModelLayout,
    copies: list[_Copy],
) -> Any:
    """A ``[rows, dim]`` target over buffers like this rank's ``pieces``."""
    buffers = [Piece(p.offsets, torch.empty_like(p.tensor)) for p in pieces]
    copies += [(p.tensor, b.tensor) for p, b in zip(pieces, buffers, strict=True)]
    if table.shards is None:
        (buffer,) = buffers
        return buffer.tensor
    return sharded_tensor(buffers, table.shards, table.size, dtype, layout.pg)


def _rows(
    table: TableLayout,
    pieces: list[Piece],
    dtype: torch.dtype,
    layout: ModelLayout,
    copies: list[_Copy],
    me: int,
    other: int,
) -> Any:
    """A ``[rows]`` target over the row ranges this rank's ``pieces`` cover (any block)."""
    rows = table.info.rows
    if table.shards is None:
        (piece,) = pieces
        buffer = torch.empty_like(piece.tensor)
        copies.append((piece.tensor, buffer))
        return buffer
    device = pieces[0].tensor.device if pieces else torch.device("cpu")
    ranges = sorted({(p.offsets[0] % rows, p.sizes[0]) for p in pieces if p.sizes[0]})
    buffers = {r: torch.empty(r[1], dtype=dtype, device=device) for r in ranges}
    for p in pieces:
        if p.sizes[0]:
            copies.append((p.tensor, buffers[(p.offsets[0] % rows, p.sizes[0])]))
    tiling = read_tiling(ranges, rows, me, other)
    local = [Piece((start,), buffer) for (start, _), buffer in buffers.items()]
    return sharded_tensor(local, tiling, (rows,), dtype, layout.pg)


def _load_optimizers(
    dmp: DistributedModelParallel,
    layout: ModelLayout,
    metadata: CheckpointMetadata,
    targets: dict[str, Any],
) -> None:
    """Dense optimizer state and groups, fused learning rates and step counter."""
    if metadata.dense_optimizer or metadata.dense_param_groups:
        state = {
            param: {name: targets[dense_optim_key(param, name)] for name in states}
            for param, states in metadata.dense_optimizer.items()
        }
        groups = [
            {k: from_json_value(v) for k, v in group.items()}
            for group in metadata.dense_param_groups
        ]
        dmp.dense_optimizer.load_state_dict({"state": state, "param_groups": groups})
    fused = dmp.fused_optimizer
    names = {id(p): name for name, p in fused.params.items()}
    for group in fused.param_groups:
        saved = [metadata.fused_hyperparameters.get(names[id(p)]) for p in group["params"]]
        hyper = next((h for h in saved if h is not None), None)
        for key, value in (hyper or {}).items():
            if key in group:
                group[key] = from_json_value(value)
    fused.post_load_state_dict()
    set_step: Callable[[int], None] | None = getattr(fused, "set_optimizer_step", None)
    if set_step is not None and metadata.step_known:
        set_step(metadata.step)
