"""``embshard checkpoint export``: a checkpoint as unsharded tensors, one table at a time.

The export is a directory of ``torch.save``'d values named by state-dict key (``model/``,
``optim/``, ``dense_optim/``) with an ``index.json``; :func:`read_export` gives back a state
dict any unsharded model loads. Values are read and written one at a time in one process, so
peak memory grows by about twice the largest tensor however large the model.

With ``quantize`` (``int8``, ``int4``, ``int2``, ``fp16``) the export is for serving: weights
only, each table quantized row-wise as it is read (FBGEMM's format: packed rows plus each
row's fp16 scale and bias), so memory still grows by about one table;
:func:`load_quantized_export` fills a quantized model (``quantize_embeddings``) from it.

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
from torch import nn

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
from embshard_kernels.quant import QUANT_TYPES, quantize_rows
from embshard_types.vocab import DataType

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "ExportedTensor",
    "export_checkpoint",
    "load_quantized_export",
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
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    quantize: DataType | str | None = None,
) -> dict[str, Any]:
    """Export the checkpoint at ``path`` to the new directory ``out``.

    Args:
        path: a checkpoint, or a directory of checkpoints (its latest is exported).
        optimizer: export the optimizer state too (else weights and dense tensors only).
        quantize: quantize every table to this type for serving (weights only).

    Returns:
        The export's index (what ``index.json`` holds).

    Raises:
        ValueError: ``out`` exists, the checkpoint is damaged (each bad file named, with the
            tables it holds), ``quantize`` is not a quantized type or a table's width does
            not pack, or ``optimizer`` is asked for with ``quantize``.
    """
    data_type = _quant_type(quantize)
    if data_type is not None and optimizer:
        raise ValueError(
            f"a quantized export ({data_type.value}) is for serving and holds weights only; "
            "export without the optimizer state (optimizer=False, --weights-only)"
        )
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
            tables = {model_key(t.key) for t in metadata.tables}
            for value in stored_values(metadata):
                if not optimizer and not value.key.startswith("model/"):
                    continue
                file = tmp / value.file
                file.parent.mkdir(parents=True, exist_ok=True)
                tensor = stored.read(value.key)  # one value in memory at a time
                entry: dict[str, Any] = {
                    "file": value.file,
                    "shape": list(value.shape),
                    "dtype": value.dtype,
                }
                if data_type is not None and value.key in tables:
                    tensor, entry["scale_shift_file"] = _quantized(tensor, data_type, value, tmp)
                    entry["dtype"] = data_type.value
                torch.save(tensor, file)
                fsync_file(file)
                del tensor
                entries[value.key] = entry
        index = {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "quantized": None if data_type is None else data_type.value,
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


def _quant_type(quantize: DataType | str | None) -> DataType | None:
    if quantize is None:
        return None
    data_type = DataType.parse(quantize, what="quantize")
    if data_type not in QUANT_TYPES or data_type is DataType.FP32:
        raise ValueError(
            f"quantize: {data_type.value!r} is not a serving type; use one of "
            f"{[d.value for d in QUANT_TYPES if d is not DataType.FP32]}"
        )
    return data_type


def _quantized(
    weight: torch.Tensor, data_type: DataType, value: ExportedTensor, tmp: Path
) -> tuple[torch.Tensor, str | None]:
    """The packed rows of one table, its scale/bias saved beside (file name, or ``None``)."""
    try:
        packed, scale_shift = quantize_rows(weight, data_type)
    except ValueError as e:
        raise ValueError(f"cannot quantize {value.key!r}: {e}") from None
    if scale_shift is None:
        return packed, None
    name = safe_relative(f"{value.key}.scale_shift.pt")
    torch.save(scale_shift, tmp / name)
    fsync_file(tmp / name)
    return packed, name


def load_quantized_export(model: nn.Module, path: str | os.PathLike[str]) -> list[str]:
    """Fill ``model``'s quantized collections and dense tensors from a quantized export.

    ``model`` is the trained model's architecture after ``quantize_embeddings`` with the
    export's type; every table of its quantized collections must be in the export.

    Returns:
        The exported keys the model has no place for (e.g. of another head).

    Raises:
        ValueError: not a quantized export, another quantized type than the model's, a table
            missing from the export, or a shape that does not match (naming the table).
    """
    root = Path(path)
    index = read_export_index(root)
    kind = index.get("quantized")
    if kind is None:
        raise ValueError(
            f"{str(root)!r} is a float export; export with quantize=... (--quantize int8) for "
            "a quantized model, or load this one with read_export into the float model"
        )
    entries: dict[str, Any] = index["tensors"]
    used: set[str] = set()
    for prefix, collection in _quant_collections(model).items():
        if collection.data_type.value != kind:
            raise ValueError(
                f"module {prefix!r} is quantized to {collection.data_type.value} but the export "
                f"holds {kind}; quantize the model with {kind!r}"
            )
        attr = "embeddings" if hasattr(collection, "embedding_configs") else "embedding_bags"
        for table in collection.packed_tables():
            key = f"model/{prefix}.{attr}.{table}.weight".replace("model/.", "model/")
            entry = entries.get(key)
            if entry is None:
                raise ValueError(f"{str(root)!r} has no table {key!r} (module {prefix!r})")
            packed = _load(root, entry["file"])
            side = entry.get("scale_shift_file")
            scale_shift = None if side is None else _load(root, side)
            try:
                collection.load_packed(table, packed, scale_shift)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            used.add(key)
    dense = {
        k.removeprefix("model/"): _load(root, e["file"])
        for k, e in entries.items()
        if k.startswith("model/") and k not in used
    }
    own = {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
    model.load_state_dict({k: v for k, v in dense.items() if k in own}, strict=False)
    return sorted(k for k in dense if k not in own)


def _quant_collections(model: nn.Module) -> dict[str, Any]:
    from embshard_kernels.quantize import QuantEmbeddingBagCollection, QuantEmbeddingCollection

    kinds = (QuantEmbeddingBagCollection, QuantEmbeddingCollection)
    found = {path: m for path, m in model.named_modules() if isinstance(m, kinds)}
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no quantized embedding collection; quantize it first "
            "(embshard_kernels.quantize_embeddings(model, dtype))"
        )
    return found


def _load(root: Path, name: str) -> torch.Tensor:
    file = root / safe_relative(name)
    if not file.is_file():
        raise ValueError(f"export {str(root)!r}: file {name!r} is missing")
    tensor: torch.Tensor = torch.load(file, weights_only=True, map_location="cpu")
    return tensor


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
