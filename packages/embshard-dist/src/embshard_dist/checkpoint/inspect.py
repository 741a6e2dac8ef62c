"""``embshard checkpoint inspect``: what a checkpoint holds, without loading any tensor.

:func:`inspect_checkpoint` reads only the metadata and file sizes (tables, dense tensors, step,
plan, bytes per rank, missing or truncated files); with ``verify=True`` it also reads every file
to compare its checksum and checks that the ``.metadata`` index is readable.
:func:`format_inspection` prints it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from embshard_dist.checkpoint.format import (
    FORMAT_VERSION,
    OBJECT,
    CheckpointMetadata,
    parse_dtype,
    read_metadata,
    resolve_checkpoint,
)
from embshard_dist.checkpoint.integrity import verify_files
from embshard_dist.checkpoint.validate import check_files
from embshard_types.plan import ShardingPlan
from embshard_types.text_table import tabulate

__all__ = ["format_inspection", "inspect_checkpoint"]

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def _bytes_of(dtype: str, count: int) -> int:
    if dtype == OBJECT:
        return 0
    return count * torch.empty((), dtype=parse_dtype(dtype, what="checkpoint")).element_size()


def inspect_checkpoint(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """A JSON-able summary of the checkpoint at ``path``.

    Args:
        verify: read every file and compare its checksum (else sizes only).

    Raises:
        ValueError: not a checkpoint, or one of a newer format version.
    """
    final = resolve_checkpoint(path)
    meta = read_metadata(final)
    tables = []
    for t in meta.tables:
        states = {
            name: ("row-wise" if s.rowwise else "point-wise")
            for name, s in t.states.items()
            if meta.has_optimizer
        }
        state_bytes = sum(
            _bytes_of(s.dtype, t.rows if s.rowwise else t.rows * t.dim)
            for s in t.states.values()
            if meta.has_optimizer
        )
        tables.append(
            {
                "key": t.key,
                "rows": t.rows,
                "dim": t.dim,
                "dtype": t.dtype,
                "sharding": t.sharding,
                "states": states,
                "weight_bytes": _bytes_of(t.dtype, t.rows * t.dim),
                "state_bytes": state_bytes,
            }
        )
    per_rank: dict[int, int] = {}
    for name, size in meta.files.items():
        match = _RANK_FILE.fullmatch(name)
        if match:
            rank = int(match.group(1))
            per_rank[rank] = per_rank.get(rank, 0) + size
    return {
        "path": str(final),
        "format_version": meta.version,
        "reader_version": FORMAT_VERSION,
        "created": meta.created,
        "source": meta.source,
        "step": meta.step,
        "world_size": meta.world_size,
        "optimizer": meta.has_optimizer,
        "tables": tables,
        "dense": {
            "tensors": len(meta.dense),
            "bytes": sum(_bytes_of(i.dtype, _count(i.shape)) for i in meta.dense.values()),
        },
        "files": {"count": len(meta.files), "bytes": sum(meta.files.values())},
        "bytes_per_rank": {str(r): per_rank[r] for r in sorted(per_rank)},
        "plan": meta.plan,
        "verified": _verified(meta) if verify else None,
        "problems": _problems(final, meta, verify=verify),
    }


def _problems(final: Path, meta: CheckpointMetadata, *, verify: bool) -> list[str]:
    if not verify:
        return check_files(final, meta)
    return verify_files(final, meta)


def _verified(meta: CheckpointMetadata) -> str:
    if meta.checksums:
        return "checksums"
    return "sizes only (written before embshard recorded checksums)"


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _tables_text(tables: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [
            t["key"],
            t["rows"],
            t["dim"],
            t["dtype"],
            t["sharding"] or "unsharded",
            _size(t["weight_bytes"]),
            _size(t["state_bytes"]),
            ", ".join(f"{n} ({k})" for n, k in t["states"].items()) or "-",
        ]
        for t in tables
    ]
    headers = ["table", "rows", "dim", "dtype", "sharding", "weights", "opt. state", "states"]
    return tabulate(rows, headers, title="embedding tables:", empty="no embedding tables")


def format_inspection(info: Mapping[str, Any]) -> str:
    """Plain text for a summary made by :func:`inspect_checkpoint`."""
    lines = [
        f"checkpoint {info['path']}",
        f"  format version {info['format_version']} (this embshard reads up to "
        f"{info['reader_version']}), made by {info['source']} at {info['created']}",
        f"  step {info['step']}, saved by {info['world_size']} process(es), optimizer state "
        f"{'included' if info['optimizer'] else 'not included'}",
        f"  files: {info['files']['count']}, {_size(info['files']['bytes'])}"
        + (
            " ("
            + ", ".join(f"rank {r}: {_size(b)}" for r, b in info["bytes_per_rank"].items())
            + ")"
            if info["bytes_per_rank"]
            else ""
        ),
        *(
            [f"  verified: {info['verified']}" + (" (all match)" if not info["problems"] else "")]
            if info.get("verified")
            else []
        ),
        "",
        _tables_text(info["tables"]),
    ]
    lines += ["", f"dense tensors: {info['dense']['tensors']}, {_size(info['dense']['bytes'])}"]
    if info["plan"] is not None:
        lines += ["", "plan it was saved with:", str(ShardingPlan.from_dict(info["plan"]))]
    if info["problems"]:
        lines += ["", "PROBLEMS (the checkpoint cannot be loaded):"]
        lines += [f"  - {p}" for p in info["problems"]]
    return "\n".join(lines)
