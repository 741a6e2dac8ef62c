"""Reading one stored value of a checkpoint whole, in one process, with bounded memory.

Values are read straight from the shard files, following ``torch.distributed.checkpoint``'s
index: one chunk is loaded as it is, several are assembled one at a time into the destination,
so memory stays within about twice the value (``torch.distributed.checkpoint``'s own reader
holds more copies). Chunks written through stream transforms go through its reader.

Guarantees: only ``torch.load(..., weights_only=True)`` deserialises; a key the index lacks, or
a file shorter than the index says, raises ``ValueError``.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import IO, Any, cast

import torch

__all__ = ["StoredCheckpoint"]


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of an open file."""

    def __init__(self, file: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._at = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self._length}[whence]
        self._at = max(0, min(self._length, base + offset))
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._at)
        if count <= 0:
            return 0
        self._file.seek(self._offset + self._at)
        done = self._file.readinto(view[:count])
        self._at += done
        return done


class StoredCheckpoint:
    """The values of a ``torch.distributed.checkpoint`` directory, read one at a time."""

    def __init__(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self._path = path
        self._metadata = dcp.FileSystemReader(path).read_metadata()

    def read(self, key: str) -> Any:
        """The whole value stored under ``key`` (a tensor, or another stored object).

        Raises:
            ValueError: ``key`` is not stored, or a file is shorter than the index says.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        stored = self._metadata.state_dict_metadata.get(key)
        if stored is None:
            raise ValueError(f"{str(self._path)!r} stores no value {key!r}")
        if not isinstance(stored, TensorStorageMetadata):
            return self._load(self._metadata.storage_data[MetadataIndex(key)], key)
        places = [
            (chunk, self._metadata.storage_data[MetadataIndex(key, chunk.offsets)])
            for chunk in stored.chunks
        ]
        if any(getattr(info, "transform_descriptors", None) for _, info in places):
            return self._read_with_dcp(key, stored)
        size = tuple(stored.size)
        if len(places) == 1 and tuple(places[0][0].sizes) == size:
            return self._load(places[0][1], key)
        out = torch.empty(size, dtype=stored.properties.dtype)
        for chunk, info in places:
            if not math.prod(chunk.sizes):
                continue
            index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            out[index] = self._load(info, key)
        return out

    def _load(self, info: Any, key: str) -> Any:
        file = self._path / info.relative_path
        if file.stat().st_size < info.offset + info.length:
            raise ValueError(
                f"file {info.relative_path!r} of {str(self._path)!r} is shorter than its index "
                f"says (value {key!r}); the checkpoint is damaged"
            )
        with open(file, "rb") as handle:
            return torch.load(
                cast(IO[bytes], _FileSlice(handle, info.offset, info.length)),
                map_location="cpu",
                weights_only=True,
            )

    def _read_with_dcp(self, key: str, stored: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        target = {key: torch.empty(tuple(stored.size), dtype=stored.properties.dtype)}
        dcp.load(target, storage_reader=dcp.FileSystemReader(self._path), no_dist=True)
        return target[key]
