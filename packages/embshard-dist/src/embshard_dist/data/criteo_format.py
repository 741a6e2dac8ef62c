"""The Criteo click-log format and the transforms that turn its raw fields into model inputs.

A raw line is ``label \\t 13 integers \\t 26 hex strings``; any field may be empty (missing).
Missing integers read as 0 and missing categories as id 0, as TorchRec's readers do. The
transforms here are the one definition every path uses (the TSV reader, the converter to NumPy),
so the two paths give identical batches:

* dense: ``log(max(x, 0) + 1)`` as float32 (negatives clamped to 0);
* categorical: the raw 32-bit id modded (``"mod"``) or mixed by a fixed 64-bit hash and then
  modded (``"hash"``) to each feature's table size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DEFAULT_INT_NAMES: tuple[str, ...] = tuple(f"int_{i}" for i in range(INT_FEATURE_COUNT))
DEFAULT_CAT_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(CAT_FEATURE_COUNT))
COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT

HashMode = Literal["mod", "hash"]
HASH_MODES: tuple[str, ...] = ("mod", "hash")

_U64 = np.uint64


@dataclass(frozen=True)
class RawRows:
    """Parsed but untransformed rows: labels [n], integers [n, 13], category ids [n, 26]."""

    labels: npt.NDArray[np.int32]
    ints: npt.NDArray[np.int64]
    cats: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def parse_lines(lines: Sequence[str], *, source: str = "<lines>", first_line: int = 0) -> RawRows:
    """Parse raw TSV lines (with or without the trailing newline).

    Raises:
        ValueError: a line without 40 tab-separated fields or with a malformed field; the message
            names ``source`` and the 1-based line number.
    """
    n = len(lines)
    labels = np.zeros(n, dtype=np.int32)
    ints = np.zeros((n, INT_FEATURE_COUNT), dtype=np.int64)
    cats = np.zeros((n, CAT_FEATURE_COUNT), dtype=np.int64)
    for i, line in enumerate(lines):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != COLUMNS:
            raise ValueError(
                f"{source}, line {first_line + i + 1}: expected {COLUMNS} tab-separated fields "
                f"(label, {INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hex categories), "
                f"got {len(fields)}; is this a Criteo-format TSV file?"
            )
        try:
            labels[i] = int(fields[0] or "0")
            ints[i] = [int(f or "0") for f in fields[1 : 1 + INT_FEATURE_COUNT]]
            cats[i] = [int(f or "0", 16) for f in fields[1 + INT_FEATURE_COUNT :]]
        except ValueError as e:
            raise ValueError(f"{source}, line {first_line + i + 1}: malformed field ({e})") from e
    return RawRows(labels=labels, ints=ints, cats=cats)


@dataclass(frozen=True)
class CriteoTransform:
    """How raw fields become model inputs.

    Args:
        num_embeddings_per_feature: table size of each of the 26 categorical features.
        hash_mode: ``"mod"`` (id modulo the size) or ``"hash"`` (a fixed 64-bit mix, then modulo).
        log_dense: apply ``log(max(x, 0) + 1)`` to the integers (else they are cast to float32).
    """

    num_embeddings_per_feature: tuple[int, ...]
    hash_mode: HashMode = "mod"
    log_dense: bool = True

    def __post_init__(self) -> None:
        sizes = self.num_embeddings_per_feature
        if len(sizes) != CAT_FEATURE_COUNT:
            raise ValueError(
                f"num_embeddings_per_feature needs {CAT_FEATURE_COUNT} sizes (one per "
                f"categorical feature), got {len(sizes)}"
            )
        bad = [(DEFAULT_CAT_NAMES[i], s) for i, s in enumerate(sizes) if s <= 0]
        if bad:
            raise ValueError(f"table sizes must be positive; got {bad}")
        if self.hash_mode not in HASH_MODES:
            raise ValueError(f"hash_mode must be one of {HASH_MODES}, got {self.hash_mode!r}")

    @classmethod
    def uniform(cls, num_embeddings: int, **kwargs: object) -> CriteoTransform:
        """The same table size for every categorical feature."""
        return cls((num_embeddings,) * CAT_FEATURE_COUNT, **kwargs)  # type: ignore[arg-type]

    def dense(self, ints: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """[n, 13] integers -> [n, 13] float32 features."""
        if not self.log_dense:
            return ints.astype(np.float32)
        return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)

    def sparse(self, cats: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """[n, 26] raw ids -> [n, 26] ids in ``[0, num_embeddings)`` of each feature."""
        sizes = np.asarray(self.num_embeddings_per_feature, dtype=np.int64)
        if self.hash_mode == "mod":
            return cats % sizes
        mixed = _mix64(cats.astype(_U64))
        return (mixed % sizes.astype(_U64)).astype(np.int64)


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser: a fixed, well-spread bijection of 64-bit values."""
    with np.errstate(over="ignore"):
        z = x + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))
