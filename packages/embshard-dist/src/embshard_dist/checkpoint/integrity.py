"""Per-file checksums of a checkpoint: computed at save, verified before anything is read.

Every file of a checkpoint gets an xxh3-64 digest (streamed, a few MiB of memory whatever the
file's size), recorded in ``embshard.json``. :func:`verify_files` compares each file with its
recorded size and digest and names, for each bad file, the tables it holds (read from
``torch.distributed.checkpoint``'s ``.metadata`` index when that index is sound). Ranks share
the hashing: rank ``r`` of ``n`` hashes every ``n``-th file, every rank checks every size.

Guarantees: a missing, truncated, extended or changed file is reported by name, as is an
unreadable ``.metadata``; nothing here raises for a damaged checkpoint (problems are returned).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

from embshard_dist.checkpoint.format import DCP_METADATA_FILE, CheckpointMetadata

__all__ = ["file_checksum", "read_index", "verify_files"]

_CHUNK = 4 << 20


def file_checksum(path: Path) -> str:
    """The xxh3-64 digest of ``path``'s bytes, as 16 hex digits (read in chunks)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_index(path: Path) -> Any:
    """``torch.distributed.checkpoint``'s index (``.metadata``) of the checkpoint at ``path``.

    Raises:
        ValueError: the file is missing or cannot be unpickled; the message names it.
    """
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # unpickling garbage raises anything
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ValueError(
            f"file {DCP_METADATA_FILE!r} of {str(path)!r} (the index of every stored tensor) "
            f"cannot be read ({type(e).__name__}: {first}); the checkpoint is damaged: restore "
            "it from a copy or load an earlier checkpoint"
        ) from e


def verify_files(
    path: Path, metadata: CheckpointMetadata, *, rank: int = 0, world_size: int = 1
) -> list[str]:
    """Problems with the files of the checkpoint at ``path`` (empty: all sound).

    Args:
        rank, world_size: this process's share of the hashing (``rank`` hashes the files whose
            position in the sorted file list is ``rank`` modulo ``world_size``); sizes and
            presence are checked on every rank.
    """
    problems: dict[str, str] = {}
    if DCP_METADATA_FILE not in metadata.files:
        return [f"the metadata lists no {DCP_METADATA_FILE} file; the checkpoint is damaged"]
    for index, (name, size) in enumerate(sorted(metadata.files.items())):
        file = path / name
        if not file.is_file():
            problems[name] = f"file {name!r} is missing from {str(path)!r}"
            continue
        actual = file.stat().st_size
        if actual != size:
            problems[name] = (
                f"file {name!r} has {actual} bytes but {size} were written: it was truncated "
                "or changed after the save"
            )
            continue
        expected = metadata.checksums.get(name)
        if expected is None or index % world_size != rank:
            continue
        if (found := file_checksum(file)) != expected:
            problems[name] = (
                f"file {name!r} failed its checksum (xxh3-64 {found}, {expected} at the save): "
                "its bytes changed after the save"
            )
    owner = sorted(metadata.files).index(DCP_METADATA_FILE) % world_size
    if not metadata.checksums and DCP_METADATA_FILE not in problems and owner == rank:
        try:  # no digest to compare: at least the index must be readable
            read_index(path)
        except ValueError as e:
            problems[DCP_METADATA_FILE] = str(e)
    if not problems:
        return []
    holders = _holders(path, metadata) if DCP_METADATA_FILE not in problems else {}
    return [_with_contents(problems[n], n, holders) for n in sorted(problems)]


def _with_contents(problem: str, name: str, holders: dict[str, list[str]]) -> str:
    if name == DCP_METADATA_FILE:
        what = "the index of every stored tensor: no table can be read"
    elif name.startswith("rng/"):
        what = "a rank's random generator states"
    elif name.startswith("extra/"):
        what = "a rank's extra_state"
    elif name in holders:
        tables = [v for v in holders[name] if v.startswith("table ")]
        others = len(holders[name]) - len(tables)
        what = "holds " + ", ".join(tables + ([f"{others} other values"] if others else []))
    else:
        return f"{problem}; restore it from a copy or load an earlier checkpoint"
    return f"{problem} ({what}); restore it from a copy or load an earlier checkpoint"


def _holders(path: Path, metadata: CheckpointMetadata) -> dict[str, list[str]]:
    """Which tables (and other values) each data file holds, from the ``.metadata`` index."""
    try:
        index = read_index(path)
    except ValueError:
        return {}
    names = {t.key: t.name for t in metadata.tables}
    found: dict[str, set[str]] = {}
    for where, info in index.storage_data.items():
        found.setdefault(str(info.relative_path), set()).add(_value_name(where.fqn, names))
    return {file: sorted(values) for file, values in found.items()}


def _value_name(fqn: str, tables: dict[str, str]) -> str:
    """``model/x.t0.weight`` -> ``table 't0'``; other values by their storage key."""
    kind, _, rest = fqn.partition("/")
    key = rest.rsplit("/", 1)[0] if kind == "optim" else rest
    if kind in ("model", "optim") and key in tables:
        return f"table {tables[key]!r} ({key})"
    return f"{fqn!r}"
