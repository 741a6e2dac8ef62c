"""Streams raw Criteo TSV files (Kaggle ``train.txt``, 1TB ``day_N``) one block at a time.

Nothing larger than one block of lines is held in memory; lines a rank does not take are never
parsed, and skipping to a saved position reads lines without parsing them. Files are read in the
order given, as one stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from embshard_dist.data.criteo_format import CriteoTransform, parse_lines
from embshard_dist.data.criteo_rows import CriteoRows


@dataclass(frozen=True)
class _Segment:
    path: str
    first_line: int  # 0-based line number in the file of lines[0]
    lines: list[str]


class TsvBlock:
    """Lines of one block (possibly spanning files), parsed only when taken."""

    def __init__(self, segments: list[_Segment], transform: CriteoTransform) -> None:
        self._segments = segments
        self._transform = transform
        self._len = sum(len(s.lines) for s in segments)

    def __len__(self) -> int:
        return self._len

    def take(self, lo: int, hi: int) -> CriteoRows:
        parts = []
        start = 0
        for seg in self._segments:
            a, b = max(lo - start, 0), min(hi - start, len(seg.lines))
            if a < b:
                raw = parse_lines(seg.lines[a:b], source=seg.path, first_line=seg.first_line + a)
                parts.append(
                    CriteoRows(
                        dense=self._transform.dense(raw.ints),
                        sparse=self._transform.sparse(raw.cats),
                        labels=raw.labels.astype(np.float32),
                    )
                )
            start += len(seg.lines)
        if not parts:
            return _empty()
        return parts[0] if len(parts) == 1 else CriteoRows.concat(parts)


def _empty() -> CriteoRows:
    return CriteoRows(
        dense=np.zeros((0, 13), dtype=np.float32),
        sparse=np.zeros((0, 26), dtype=np.int64),
        labels=np.zeros(0, dtype=np.float32),
    )


class TsvSource:
    """Raw Criteo TSV files read as one stream of rows.

    Args:
        paths: the files, in reading order (e.g. ``day_0`` .. ``day_22``).
        transform: how fields become features (table sizes, hashing, log of the dense ones).
    """

    def __init__(self, paths: Sequence[str | Path], transform: CriteoTransform) -> None:
        if not paths:
            raise ValueError("TsvSource needs at least one TSV file")
        missing = [str(p) for p in paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"Criteo TSV files not found: {missing}")
        self.paths = [str(p) for p in paths]
        self.transform = transform

    def blocks(self, skip_rows: int, block_rows: int) -> Iterator[TsvBlock]:
        if block_rows <= 0:
            raise ValueError(f"block_rows must be positive, got {block_rows}")
        to_skip = skip_rows
        segments: list[_Segment] = []
        held = 0
        for path in self.paths:
            with open(path, encoding="ascii", newline="\n") as f:
                line_no = 0
                if to_skip:
                    skipped = sum(1 for _ in islice(f, to_skip))
                    to_skip -= skipped
                    line_no = skipped
                    if to_skip:
                        continue
                while True:
                    lines = list(islice(f, block_rows - held))
                    if not lines:
                        break
                    segments.append(_Segment(path, line_no, lines))
                    line_no += len(lines)
                    held += len(lines)
                    if held == block_rows:
                        yield TsvBlock(segments, self.transform)
                        segments, held = [], 0
        if to_skip:
            raise ValueError(
                f"cannot skip to row {skip_rows}: the files {self.paths} hold only "
                f"{skip_rows - to_skip} rows; the saved position is from other data"
            )
        if segments:
            yield TsvBlock(segments, self.transform)


def find_tsv_days(folder: str | Path) -> list[Path]:
    """The ``day_N`` (or ``day_N.tsv``) files in ``folder``, by ascending ``N``."""
    found: dict[int, Path] = {}
    for p in Path(folder).iterdir():
        stem = p.name.removesuffix(".tsv")
        if p.is_file() and stem.startswith("day_") and stem[4:].isdigit():
            found[int(stem[4:])] = p
    return [found[d] for d in sorted(found)]
