"""Making a checkpoint visible all at once, and keeping a directory of checkpoints tidy.

A checkpoint is written into a hidden sibling ``.NAME.tmp-TOKEN``, then :func:`commit` writes
its metadata (with every file's size and digest) and renames it into place; an interrupted save leaves only that hidden directory,
which :func:`remove_stale` removes later.

Guarantees: :func:`commit` never replaces a path; :func:`write_latest` is atomic; :func:`prune`
removes only complete checkpoints older than the ``keep_last`` newest, never ``latest``'s.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

from embshard_dist.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointMetadata,
    resolve_checkpoint,
)
from embshard_dist.checkpoint.integrity import file_checksum

__all__ = [
    "commit",
    "fsync_dir",
    "fsync_file",
    "list_files",
    "prune",
    "remove_stale",
    "temporary_path",
    "write_latest",
]

_STEP_DIR = re.compile(r"step-\d{8}")
_STALE = re.compile(r"\.step-\d{8}\.tmp-[0-9a-f]+")


def temporary_path(final: Path, token: str) -> Path:
    """The hidden directory a checkpoint bound for ``final`` is written into."""
    return final.parent / f".{final.name}.tmp-{token}"


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(root: Path) -> dict[str, int]:
    """Every file under ``root`` but the metadata file: relative path -> size in bytes."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != METADATA_FILE:
            out[path.relative_to(root).as_posix()] = path.stat().st_size
    return out


def commit(tmp: Path, final: Path, metadata: CheckpointMetadata) -> CheckpointMetadata:
    """Write the metadata of the checkpoint in ``tmp`` and rename ``tmp`` to ``final``.

    Files without a digest in ``metadata.checksums`` (``.metadata``, an import's files) are
    hashed here.

    Returns:
        The metadata written (with the file list and every file's digest filled in).

    Raises:
        ValueError: ``final`` already exists.
    """
    if final.exists():
        raise ValueError(
            f"cannot commit the checkpoint to {str(final)!r}: the path exists; save under "
            "another path or remove it"
        )
    for sub in [p for p in tmp.rglob("*") if p.is_dir()]:
        fsync_dir(sub)
    files = list_files(tmp)
    checksums = {name: metadata.checksums.get(name) or file_checksum(tmp / name) for name in files}
    metadata = dataclasses.replace(metadata, files=files, checksums=checksums)
    staging = tmp / f"{METADATA_FILE}.partial"
    staging.write_text(metadata.to_json())
    fsync_file(staging)
    staging.rename(tmp / METADATA_FILE)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return metadata


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at the sub-directory ``name`` (atomically)."""
    staging = root / f".{LATEST_FILE}.partial"
    staging.write_text(name + "\n")
    fsync_file(staging)
    os.replace(staging, root / LATEST_FILE)
    fsync_dir(root)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all complete ``step-*`` checkpoints but the ``keep_last`` newest; return them."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    try:
        current = resolve_checkpoint(root)
    except ValueError:
        return []
    steps = sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and _STEP_DIR.fullmatch(p.name) and (p / METADATA_FILE).is_file()
    )
    removed = []
    for path in steps[:-keep_last]:
        if path != current:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def remove_stale(root: Path) -> list[Path]:
    """Remove the hidden directories interrupted saves left in ``root``; return them."""
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and _STALE.fullmatch(p.name)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
