"""Model-ready Criteo rows and the block interface the per-rank dataset reads sources through.

A source (TSV files, NumPy days) hands out consecutive *blocks* of rows; the dataset picks its
rank's slice of a block and asks for only those rows, so a rank decodes no more than its part.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class CriteoRows:
    """Transformed rows: dense [n, 13] float32, sparse [n, 26] int64 ids, labels [n] float32."""

    dense: npt.NDArray[np.float32]
    sparse: npt.NDArray[np.int64]
    labels: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concat(parts: Sequence[CriteoRows]) -> CriteoRows:
        """The rows of ``parts`` one after the other."""
        return CriteoRows(
            dense=np.concatenate([p.dense for p in parts]),
            sparse=np.concatenate([p.sparse for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
        )


class RowBlock(Protocol):
    """Consecutive rows of a source; only the rows asked for are decoded."""

    def __len__(self) -> int: ...

    def take(self, lo: int, hi: int) -> CriteoRows:
        """Rows ``[lo, hi)`` of the block, transformed."""
        ...


class RowSource(Protocol):
    """Anything the per-rank dataset can read: a stream of rows cut into blocks."""

    def blocks(self, skip_rows: int, block_rows: int) -> Iterator[RowBlock]:
        """Blocks of ``block_rows`` rows (the last may be shorter), after skipping ``skip_rows``.

        Raises:
            ValueError: the source has fewer than ``skip_rows`` rows.
        """
        ...
