"""A checkpoint compared with a model and with its own file list, before anything is loaded.

Guarantees: each check returns every problem it found (empty: fine), each naming what differs
and what to do, so a load can report them all at once and refuse before touching the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from embshard_dist.checkpoint.format import (
    DCP_METADATA_FILE,
    OBJECT,
    CheckpointMetadata,
    TensorInfo,
    dtype_name,
)

if TYPE_CHECKING:
    from embshard_dist.checkpoint.layout import ModelLayout

__all__ = ["check_dense_optimizer", "check_files", "check_model"]

_OPTIMIZER_HINT = "load with optimizer=False to load the weights only"
_DENSE_HINT = "load with dense=False to load the embedding tables only"


def check_files(path: Path, metadata: CheckpointMetadata) -> list[str]:
    """Every listed file is present with its recorded size."""
    problems = []
    if DCP_METADATA_FILE not in metadata.files:
        problems.append(
            f"the metadata lists no {DCP_METADATA_FILE} file; the checkpoint is damaged"
        )
    for name, size in sorted(metadata.files.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"file {name!r} is missing from {str(path)!r}")
        elif (actual := file.stat().st_size) != size:
            problems.append(
                f"file {name!r} has {actual} bytes but {size} were written: it was truncated "
                "or changed after the save"
            )
    return problems


def check_model(
    metadata: CheckpointMetadata, layout: ModelLayout, *, optimizer: bool, dense: bool
) -> list[str]:
    """The checkpoint's tables, states and dense tensors against the model's."""
    problems = _check_tables(metadata, layout, optimizer=optimizer)
    if dense:
        if not metadata.dense and layout.dense:
            problems.append(
                f"the checkpoint holds no dense tensors (made by {metadata.source!r} from an "
                f"embedding collection) but the model has {len(layout.dense)}; {_DENSE_HINT}"
            )
        else:
            problems += _check_tensors(
                "dense tensor",
                metadata.dense,
                {k: _info(v) for k, v in layout.dense.items()},
                hint=_DENSE_HINT,
            )
    if optimizer and not metadata.has_optimizer:
        problems.append(
            f"the checkpoint holds no optimizer state (made by {metadata.source!r} from weights "
            f"only); {_OPTIMIZER_HINT}"
        )
    return problems


def _check_tables(
    metadata: CheckpointMetadata, layout: ModelLayout, *, optimizer: bool
) -> list[str]:
    problems = []
    saved = {t.key: t for t in metadata.tables}
    for key in sorted(set(layout.tables) - set(saved)):
        problems.append(f"table {key!r} of the model is not in the checkpoint")
    for key in sorted(set(saved) - set(layout.tables)):
        problems.append(f"table {key!r} of the checkpoint is not in the model")
    for key in sorted(set(saved) & set(layout.tables)):
        mine, theirs = layout.tables[key].info, saved[key]
        if (mine.rows, mine.dim) != (theirs.rows, theirs.dim):
            problems.append(
                f"table {key!r}: the checkpoint's is {theirs.rows} x {theirs.dim}, the model's "
                f"{mine.rows} x {mine.dim} (rows x dim)"
            )
        if mine.dtype != theirs.dtype:
            problems.append(
                f"table {key!r}: the checkpoint's weights are {theirs.dtype}, the model's "
                f"{mine.dtype}"
            )
        if optimizer and metadata.has_optimizer and mine.states != theirs.states:
            problems.append(
                f"table {key!r}: the model's optimizer keeps states {_states(mine.states)}, "
                f"the checkpoint holds {_states(theirs.states)} (saved with another "
                f"optimizer?); {_OPTIMIZER_HINT}"
            )
    return problems


def _states(states: Mapping[str, Any]) -> str:
    if not states:
        return "none"
    return ", ".join(
        f"{n} ({'row-wise' if s.rowwise else 'point-wise'} {s.dtype})" for n, s in states.items()
    )


def _info(value: Any) -> TensorInfo:
    if isinstance(value, Tensor):
        return TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    return TensorInfo((), OBJECT)


def _check_tensors(
    what: str, saved: Mapping[str, TensorInfo], mine: Mapping[str, TensorInfo], *, hint: str
) -> list[str]:
    problems = []
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing:
        problems.append(f"{what}s of the model missing from the checkpoint: {missing}; {hint}")
    if extra:
        problems.append(f"{what}s of the checkpoint not in the model: {extra}; {hint}")
    for key in sorted(set(saved) & set(mine)):
        if saved[key] != mine[key]:
            problems.append(
                f"{what} {key!r}: the checkpoint's is {list(saved[key].shape)} "
                f"{saved[key].dtype}, the model's {list(mine[key].shape)} {mine[key].dtype}"
            )
    return problems


def check_dense_optimizer(
    metadata: CheckpointMetadata,
    state: Mapping[str, Mapping[str, Any]],
    param_groups: list[dict[str, Any]],
) -> list[str]:
    """The dense optimizer's state and param groups against the checkpoint's.

    Args:
        state: the dense optimizer's current state (``{param: {state: value}}``), already
            initialised when the checkpoint holds some.
        param_groups: its param groups in the JSON form the metadata uses.
    """
    flat_saved = {
        f"{p}/{n}": info
        for p, states in metadata.dense_optimizer.items()
        for n, info in states.items()
    }
    flat_mine = {f"{p}/{n}": _info(v) for p, states in state.items() for n, v in states.items()}
    problems = _check_tensors("dense optimizer state", flat_saved, flat_mine, hint=_OPTIMIZER_HINT)
    saved_groups = sorted(tuple(g.get("params", ())) for g in metadata.dense_param_groups)
    my_groups = sorted(tuple(g.get("params", ())) for g in param_groups)
    if saved_groups != my_groups:
        problems.append(
            f"the dense optimizer's param groups {my_groups} differ from the checkpoint's "
            f"{saved_groups}; {_OPTIMIZER_HINT}"
        )
    return problems
