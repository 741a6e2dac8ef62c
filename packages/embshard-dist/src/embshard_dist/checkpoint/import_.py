"""``embshard checkpoint import``: an unsharded state dict (or an export) as a checkpoint.

Every 2-D float tensor under ``[{module}.]embedding_bags.{table}.weight`` (or ``embeddings.``)
of a ``torch.save``'d state dict becomes a table and every other tensor a dense one; an export
comes back exactly. The result has no plan, so loading reshards it to any plan and world size.

Guarantees: everything is checked before anything is written; the destination must not exist
and appears only once complete.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embshard_dist.checkpoint.atomic import commit, temporary_path
from embshard_dist.checkpoint.export import read_export, read_export_index
from embshard_dist.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointMetadata,
    TableInfo,
    TensorInfo,
    dtype_name,
    model_key,
)
from embshard_dist.checkpoint.tensors import quiet

__all__ = ["TABLE_KEY", "import_state_dict"]

TABLE_KEY = re.compile(
    r"(?:(?P<module>.+)\.)?(?:embedding_bags|embeddings)\.(?P<name>[^.]+)\.weight"
)
"""State-dict keys of embedding tables (TorchRec's and embshard's names, bags or sequences)."""

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def import_state_dict(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    prefix: str = "",
    step: int | None = None,
) -> CheckpointMetadata:
    """Write the checkpoint ``out`` from the state dict or export ``source``.

    Args:
        prefix: module path to put before a state-dict file's keys (not for exports).
        step: the step to record (default: the export's, else 0).

    Returns:
        The new checkpoint's metadata.

    Raises:
        ValueError: an unreadable or unsuitable source, or ``out`` exists (nothing written).
    """
    import torch.distributed.checkpoint as dcp

    src, final = Path(source), Path(out)
    if final.exists():
        raise ValueError(f"cannot import into {str(final)!r}: the path exists; remove it first")
    if src.is_dir():
        if prefix:
            raise ValueError(
                "prefix applies to a state-dict file; an export keeps the keys it was saved with"
            )
        values, metadata = _from_export(src)
    else:
        values, metadata = _from_file(src, prefix)
    if step is not None:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        metadata = replace(metadata, step=step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(final, secrets.token_hex(6))
    tmp.mkdir()
    try:
        with quiet():
            writer = dcp.FileSystemWriter(tmp, sync_files=True)
            dcp.save(values, storage_writer=writer, no_dist=True)
        return commit(tmp, final, metadata)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"cannot import {str(path)!r}: no such file or directory")
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError:  # a file in the legacy (non-zip) format cannot be memory-mapped
        pass
    except Exception as e:
        raise ValueError(
            f"cannot import {str(path)!r}: torch.load failed ({type(e).__name__}: {e}); give a "
            "file written by torch.save(module.state_dict(), path)"
        ) from e
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise ValueError(
            f"cannot import {str(path)!r}: torch.load failed ({type(e).__name__}: {e})"
        ) from e


def _from_file(path: Path, prefix: str) -> tuple[dict[str, Any], CheckpointMetadata]:
    loaded = _load_file(path)
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"cannot import {str(path)!r}: it holds a {type(loaded).__name__}, not a state dict "
            "(a mapping of names to tensors)"
        )
    bad = sorted(str(k) for k, v in loaded.items() if not isinstance(k, str) or not _tensor(v))
    if bad:
        raise ValueError(
            f"cannot import {str(path)!r}: entries {bad[:10]} are not tensors; a state dict "
            "maps names to tensors"
        )
    full = {(f"{prefix}.{k}" if prefix else k): v for k, v in loaded.items()}
    tables: list[TableInfo] = []
    dense: dict[str, TensorInfo] = {}
    for key, tensor in full.items():
        match = TABLE_KEY.fullmatch(key)
        if match is None:
            dense[key] = TensorInfo(tuple(tensor.shape), dtype_name(tensor.dtype))
            continue
        if tensor.dim() != 2 or tensor.dtype not in _FLOATS:
            raise ValueError(
                f"cannot import {str(path)!r}: table {key!r} is a {tensor.dim()}-D "
                f"{dtype_name(tensor.dtype)} tensor; an embedding table is a 2-D float tensor"
            )
        tables.append(
            TableInfo(
                key=key,
                module=match.group("module") or "",
                name=match.group("name"),
                rows=int(tensor.shape[0]),
                dim=int(tensor.shape[1]),
                dtype=dtype_name(tensor.dtype),
                sharding=None,
            )
        )
    if not tables:
        raise ValueError(
            f"cannot import {str(path)!r}: no embedding table in it (keys like "
            f"'embedding_bags.NAME.weight'); its keys are {sorted(full)[:10]}"
        )
    metadata = CheckpointMetadata(
        version=FORMAT_VERSION,
        step=0,
        world_size=1,
        tables=tuple(tables),
        dense=dense,
        has_optimizer=False,
        dense_optimizer={},
        dense_param_groups=[],
        fused_hyperparameters={},
        plan=None,
        files={},
        created=_now(),
        source="import",
    )
    return {model_key(k): v for k, v in full.items()}, metadata


def _tensor(value: Any) -> bool:
    return type(value) in (Tensor, torch.nn.Parameter)


def _from_export(path: Path) -> tuple[dict[str, Any], CheckpointMetadata]:
    index = read_export_index(path)
    saved = CheckpointMetadata.from_json(
        json.dumps(index["checkpoint"]), where=f"{path}/index.json"
    )
    values = read_export(path)
    problems = []
    for key, entry in index["tensors"].items():
        value = values[key]
        if isinstance(value, Tensor):
            shape, dtype = tuple(value.shape), dtype_name(value.dtype)
            if shape != tuple(entry["shape"]) or dtype != entry["dtype"]:
                problems.append(
                    f"{entry['file']!r} holds a {list(shape)} {dtype} tensor, the index says "
                    f"{entry['shape']} {entry['dtype']}"
                )
    if problems:
        raise ValueError(f"cannot import {str(path)!r}:\n  - " + "\n  - ".join(problems))
    optimizer = bool(index["optimizer"])
    tables = tuple(
        replace(t, sharding=None, states=t.states if optimizer else {}) for t in saved.tables
    )
    metadata = replace(
        saved,
        version=FORMAT_VERSION,
        world_size=1,
        tables=tables,
        has_optimizer=optimizer,
        plan=None,
        files={},
        checksums={},  # the export's files are new: commit hashes them
        extra_state=(),  # an export holds no extra state
        created=_now(),
        source="import",
    )
    if not metadata.has_optimizer:
        metadata = replace(
            metadata, dense_optimizer={}, dense_param_groups=[], fused_hyperparameters={}
        )
    return values, metadata


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
