"""Converts raw Criteo TSV days into the memory-mapped NumPy format, streaming.

Each input file becomes one day: ``day_N_dense.npy`` (float32 [rows, 13], transformed),
``day_N_sparse.npy`` (int32, or int64 for tables over 2**31 rows, [rows, 26]) and
``day_N_labels.npy`` (int32 [rows, 1]), written chunk by chunk into ``.npy`` maps so no day is
held in memory. The transforms are :class:`~embshard_dist.data.criteo_format.CriteoTransform`'s,
so reading the result gives exactly the batches the TSV reader gives. With a frequency threshold
``t``, ids (after hashing) seen fewer than ``t`` times over all inputs share row 0 with missing
values; this needs one more pass over the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from embshard_dist.data.criteo_format import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, CriteoTransform
from embshard_dist.data.criteo_npy import npy_day_paths
from embshard_dist.data.criteo_tsv import TsvSource

DEFAULT_CHUNK_ROWS = 1 << 16


def count_lines(path: str | Path) -> int:
    """Lines in a file (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def count_ids(
    paths: Sequence[str | Path], transform: CriteoTransform, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> list[npt.NDArray[np.int64]]:
    """Per categorical feature, how often each (transformed) id occurs over ``paths``."""
    sizes = transform.num_embeddings_per_feature
    counts = [np.zeros(s, dtype=np.int64) for s in sizes]
    for block in TsvSource(paths, transform).blocks(0, chunk_rows):
        sparse = block.take(0, len(block)).sparse
        for j in range(CAT_FEATURE_COUNT):
            counts[j] += np.bincount(sparse[:, j], minlength=sizes[j])
    return counts


def preprocess_tsv(
    paths: Sequence[str | Path],
    out_dir: str | Path,
    transform: CriteoTransform,
    *,
    frequency_threshold: int = 0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[Path, Path, Path]]:
    """Write day ``i`` of the NumPy format from ``paths[i]``; returns each day's three files.

    Raises:
        ValueError: a negative threshold, or a malformed line (named by file and line).
        FileNotFoundError: an input file is missing.
    """
    if frequency_threshold < 0:
        raise ValueError(f"frequency_threshold must be >= 0, got {frequency_threshold}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rare: list[npt.NDArray[np.bool_]] | None = None
    if frequency_threshold > 0:
        counts = count_ids(paths, transform, chunk_rows)
        rare = [c < frequency_threshold for c in counts]
    big = max(transform.num_embeddings_per_feature) > np.iinfo(np.int32).max
    sparse_dtype = np.int64 if big else np.int32
    written = []
    for day, path in enumerate(paths):
        rows = count_lines(path)
        dense_p, sparse_p, labels_p = npy_day_paths(out, day)
        dense = np.lib.format.open_memmap(dense_p, "w+", np.float32, (rows, INT_FEATURE_COUNT))
        sparse = np.lib.format.open_memmap(sparse_p, "w+", sparse_dtype, (rows, CAT_FEATURE_COUNT))
        labels = np.lib.format.open_memmap(labels_p, "w+", np.int32, (rows, 1))
        at = 0
        for block in TsvSource([path], transform).blocks(0, chunk_rows):
            part = block.take(0, len(block))
            ids = part.sparse
            if rare is not None:
                ids = ids.copy()
                for j in range(CAT_FEATURE_COUNT):
                    ids[rare[j][ids[:, j]], j] = 0
            n = len(part)
            dense[at : at + n] = part.dense
            sparse[at : at + n] = ids
            labels[at : at + n, 0] = part.labels
            at += n
        if at != rows:
            raise ValueError(f"{path}: counted {rows} lines but read {at} rows; is it a text file?")
        for m in (dense, sparse, labels):
            m.flush()
        del dense, sparse, labels
        written.append((dense_p, sparse_p, labels_p))
        if progress is not None:
            progress(f"day {day}: {rows} rows from {path}")
    return written
