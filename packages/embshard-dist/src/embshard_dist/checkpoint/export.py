"""``embshard checkpoint export``: a checkpoint as unsharded tensors, one table at a time.

The export is a directory of ``torch.save``'d values named by state-dict key (``model/``,
``optim/``, ``dense_optim/``) with an ``index.json``; :func:`read_export` gives back a state
dict any unsharded model loads. Values are read and written one at a time in one process, so
peak memory grows by about twice the largest tensor however large the model.

Guarantees: the checkpoint is verified first (every file's size and checksum, its
``.metadata`` index readable); the destination must not exist; nothing appears
there unless the export completed (one rename at the end).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embshard_dist.checkpoint.atomic import fsync_dir, fsync_file
from embshard_dist.checkpoint.format import (
    CheckpointMetadata,
    dense_optim_key,
    model_key,
    optim_key,
    read_metadata,
    resolve_checkpoint,
)
from embshard_dist.checkpoint.integrity import verify_files
from embshard_dist.checkpoint.reader import StoredCheckpoint
from embshard_dist.checkpoint.tensors import quiet

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "ExportedTensor",
    "export_checkpoint",
    "read_export",
    "read_export_index",
    "safe_relative",
    "stored_values",
]

EXPORT_FORMAT = "embshard-export"
EXPORT_VERSION = 1
INDEX_FILE = "index.json"


@dataclass(frozen=True)
class ExportedTensor:
    """One stored value of a checkpoint: its storage key, shape and dtype (or ``object``)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def file(self) -> str:
        """Its file in an export, relative to the export's directory."""
        return safe_relative(f"{self.key}.pt")


def safe_relative(name: str) -> str:
    """``name`` if it is a relative path that stays inside its directory.

    Raises:
        ValueError: an absolute path, or one with ``..`` or empty components.
    """
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"refusing the file name {name!r}: it leaves its directory")
    return name


def stored_values(metadata: CheckpointMetadata) -> Iterator[ExportedTensor]:
    """Every value a checkpoint stores: tables, then dense tensors, then optimizer state."""
    for table in metadata.tables:
        yield ExportedTensor(model_key(table.key), (table.rows, table.dim), table.dtype)
    for key, info in metadata.dense.items():
        yield ExportedTensor(model_key(key), info.shape, info.dtype)
    if not metadata.has_optimizer:
        return
    for table in metadata.tables:
        for name, state in table.states.items():
            shape = (table.rows,) if state.rowwise else (table.rows, table.dim)
            yield ExportedTensor(optim_key(table.key, name), shape, state.dtype)
    for param, states in metadata.dense_optimizer.items():
        for name, info in states.items():
            yield ExportedTensor(dense_optim_key(param, name), info.shape, info.dtype)


def export_checkpoint(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, optimizer: bool = True
) -> dict[str, Any]:
    """Export the checkpoint at ``path`` to the new directory ``out``.

    Args:
        path: a checkpoint, or a directory of checkpoints (its latest is exported).
        optimizer: export the optimizer state too (else weights and dense tensors only).

    Returns:
        The export's index (what ``index.json`` holds).

    Raises:
        ValueError: ``out`` exists, or the checkpoint is damaged (each bad file named, with the
            tables it holds).
    """
    source = resolve_checkpoint(path)
    metadata = read_metadata(source)
    problems = verify_files(source, metadata)
    if problems:
        raise ValueError(f"cannot export {str(source)!r}:\n  - " + "\n  - ".join(problems))
    final = Path(out)
    if final.exists():
        raise ValueError(f"cannot export to {str(final)!r}: the path exists; remove it first")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    entries: dict[str, Any] = {}
    try:
        with quiet():
            stored = StoredCheckpoint(source)
            for value in stored_values(metadata):
                if not optimizer and not value.key.startswith("model/"):
                    continue
                file = tmp / value.file
                file.parent.mkdir(parents=True, exist_ok=True)
                torch.save(stored.read(value.key), file)  # one value in memory at a time
                fsync_file(file)
                entries[value.key] = {
                    "file": value.file,
                    "shape": list(value.shape),
                    "dtype": value.dtype,
                }
        index = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "optimizer": optimizer and metadata.has_optimizer,
            "tensors": entries,
            "checkpoint": json.loads(metadata.to_json()),
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
        fsync_file(tmp / INDEX_FILE)
        for sub in [p for p in tmp.rglob("*") if p.is_dir()]:
            fsync_dir(sub)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def read_export_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``index.json`` of an export, checked.

    Raises:
        ValueError: not an export, or one of a newer version.
    """
    file = Path(path) / INDEX_FILE
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is not an embshard export: it has no {INDEX_FILE}")
    try:
        index = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{file}: not an embshard export index")
    version = index.get("version")
    if not isinstance(version, int) or version > EXPORT_VERSION:
        raise ValueError(
            f"{file}: export format version {version!r} is newer than this embshard reads "
            f"(up to {EXPORT_VERSION}); upgrade embshard"
        )
    return index


def read_export(path: str | os.PathLike[str], *, mmap: bool = True) -> dict[str, Any]:
    """An export's values by storage key (``model/...``, ``optim/...``, ``dense_optim/...``).

    Args:
        mmap: map the files instead of reading them.

    Raises:
        ValueError: not an export, or a file it lists is missing.
    """
    root = Path(path)
    index = read_export_index(root)
    out = {}
    for key, entry in index["tensors"].items():
        file = root / safe_relative(str(entry["file"]))
        if not file.is_file():
            raise ValueError(f"export {str(root)!r}: file {entry['file']!r} of {key!r} is missing")
        out[key] = torch.load(file, mmap=mmap, weights_only=True, map_location="cpu")
    return out
