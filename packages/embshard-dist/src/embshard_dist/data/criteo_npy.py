"""Reads the preprocessed Criteo NumPy format, memory-mapped.

Per day ``N`` a folder holds ``day_N_dense.npy`` (float32 [rows, 13], already transformed),
``day_N_sparse.npy`` (integer [rows, 26] ids) and ``day_N_labels.npy`` (integer [rows] or
[rows, 1]), the layout TorchRec's Criteo tools write. Files are opened with ``mmap_mode="r"``:
a block reads only the rows taken from it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from embshard_dist.data.criteo_format import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from embshard_dist.data.criteo_rows import CriteoRows


def npy_day_paths(folder: str | Path, day: int) -> tuple[Path, Path, Path]:
    """The dense, sparse and labels files of ``day`` in ``folder``."""
    base = Path(folder)
    return tuple(base / f"day_{day}_{kind}.npy" for kind in ("dense", "sparse", "labels"))  # type: ignore[return-value]


def find_npy_days(folder: str | Path) -> list[int]:
    """The days whose three files are all present in ``folder``, ascending."""
    days = []
    for p in Path(folder).glob("day_*_dense.npy"):
        day = p.name[len("day_") : -len("_dense.npy")]
        if day.isdigit() and all(q.is_file() for q in npy_day_paths(folder, int(day))):
            days.append(int(day))
    return sorted(days)


@dataclass(frozen=True)
class _Day:
    dense: npt.NDArray[np.float32]
    sparse: npt.NDArray[np.integer]
    labels: npt.NDArray[np.integer]


class NpyBlock:
    """Rows ``[start, stop)`` of the concatenated days."""

    def __init__(self, source: NpySource, start: int, stop: int) -> None:
        self._source, self._start, self._stop = source, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def take(self, lo: int, hi: int) -> CriteoRows:
        return self._source.rows(self._start + lo, self._start + min(hi, len(self)))


class NpySource:
    """Preprocessed Criteo days read as one stream of rows.

    Args:
        folder: the folder holding ``day_N_{dense,sparse,labels}.npy``.
        days: which days, in reading order (default: every complete day found, ascending).
        num_embeddings_per_feature: if given, ids are taken modulo these sizes as they are read.
    """

    def __init__(
        self,
        folder: str | Path,
        days: Sequence[int] | None = None,
        *,
        num_embeddings_per_feature: Sequence[int] | None = None,
    ) -> None:
        days = list(find_npy_days(folder) if days is None else days)
        if not days:
            raise FileNotFoundError(
                f"no day_N_dense/sparse/labels.npy files in {str(folder)!r}; write them with "
                "`embshard data preprocess`"
            )
        self._days = [self._open(folder, d) for d in days]
        self._starts = np.cumsum([0] + [len(d.labels) for d in self._days])
        self.num_rows = int(self._starts[-1])
        self._sizes = (
            None
            if num_embeddings_per_feature is None
            else np.asarray(num_embeddings_per_feature, dtype=np.int64)
        )

    @staticmethod
    def _open(folder: str | Path, day: int) -> _Day:
        paths = npy_day_paths(folder, day)
        absent = [str(p) for p in paths if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"day {day}: missing {absent}")
        dense, sparse, labels = (np.load(p, mmap_mode="r") for p in paths)
        n = dense.shape[0]
        if (
            dense.shape != (n, INT_FEATURE_COUNT)
            or sparse.shape != (n, CAT_FEATURE_COUNT)
            or labels.reshape(-1).shape != (n,)
        ):
            raise ValueError(
                f"day {day} in {str(folder)!r}: expected dense [n, {INT_FEATURE_COUNT}], sparse "
                f"[n, {CAT_FEATURE_COUNT}] and labels [n] or [n, 1]; got {dense.shape}, "
                f"{sparse.shape}, {labels.shape}"
            )
        return _Day(dense=dense, sparse=sparse, labels=labels.reshape(-1))

    def rows(self, start: int, stop: int) -> CriteoRows:
        """Rows ``[start, stop)`` of the concatenated days, copied out of the maps."""
        parts = []
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        for i in range(max(first, 0), len(self._days)):
            lo, hi = (
                max(start - self._starts[i], 0),
                min(stop - self._starts[i], len(self._days[i].labels)),
            )
            if lo >= hi:
                if self._starts[i] >= stop:
                    break
                continue
            day = self._days[i]
            sparse = np.array(day.sparse[lo:hi], dtype=np.int64)
            if self._sizes is not None:
                sparse = sparse % self._sizes
            parts.append(
                CriteoRows(
                    dense=np.array(day.dense[lo:hi], dtype=np.float32),
                    sparse=sparse,
                    labels=np.array(day.labels[lo:hi], dtype=np.float32),
                )
            )
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return CriteoRows(
                dense=np.zeros((0, INT_FEATURE_COUNT), np.float32),
                sparse=np.zeros((0, CAT_FEATURE_COUNT), np.int64),
                labels=np.zeros(0, np.float32),
            )
        return CriteoRows.concat(parts)

    def blocks(self, skip_rows: int, block_rows: int) -> Iterator[NpyBlock]:
        if block_rows <= 0:
            raise ValueError(f"block_rows must be positive, got {block_rows}")
        if skip_rows > self.num_rows:
            raise ValueError(
                f"cannot skip to row {skip_rows}: the days hold only {self.num_rows} rows; the "
                "saved position is from other data"
            )
        for start in range(skip_rows, self.num_rows, block_rows):
            yield NpyBlock(self, start, min(start + block_rows, self.num_rows))
