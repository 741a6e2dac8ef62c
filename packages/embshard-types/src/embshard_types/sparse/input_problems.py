"""What can be wrong with a batch of sparse features, as a record every rank can read the same.

An :class:`InputProblem` is a fixed number of integers (:meth:`InputProblem.encode`), so a
distributed caller can send it to its peers beside the batch's sizes; :meth:`InputProblem.error`
turns it into the same exception, with the same message, on every rank. Features are named by
their position in a feature list every rank shares (the collection's), never by the input's own
key order, which may differ per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from enum import IntEnum


class Problem(IntEnum):
    """The kinds of bad input, in the order they are looked for."""

    NONE = 0
    NOT_A_KJT = 1
    IDS_NOT_INTEGER = 2
    WEIGHTS_NOT_FLOAT = 3
    MISSING_FEATURE = 4
    WEIGHTS_MISSING = 5
    NEGATIVE_LENGTH = 6
    OFFSETS_NOT_FROM_ZERO = 7
    OFFSETS_DECREASE = 8
    LENGTHS_OFFSETS_DIFFER = 9
    TOO_FEW_VALUES = 10
    UNCOVERED_VALUES = 11
    ID_OUT_OF_RANGE = 12
    WEIGHT_NOT_FINITE = 13


NO_FEATURE = -1
"""``InputProblem.feature`` when the problem concerns no single feature."""

NON_FINITE = {0: "nan", 1: "inf", 2: "-inf"}
"""``InputProblem.value`` of a ``WEIGHT_NOT_FINITE`` problem -> the weight."""


class InvalidInputError(ValueError):
    """A batch of sparse features was refused before any collective, kernel or state change.

    Attributes:
        problem: what was wrong and where (the same record on every rank).
        rank: the rank whose input it was (``None`` in a single process).
    """

    def __init__(self, message: str, problem: InputProblem, rank: int | None) -> None:
        super().__init__(message)
        self.problem = problem
        self.rank = rank


class InvalidInputTypeError(InvalidInputError, TypeError):
    """The input, its ids or its weights have the wrong type."""


class IdOutOfRangeError(InvalidInputError, IndexError):
    """An id is negative or not below the row count of its table."""


_TYPE_PROBLEMS = {Problem.NOT_A_KJT, Problem.IDS_NOT_INTEGER, Problem.WEIGHTS_NOT_FLOAT}


@dataclass(frozen=True)
class InputProblem:
    """One problem of one input batch.

    Attributes:
        code: the kind of problem.
        feature: position in the shared feature list; ``NO_FEATURE``; or ``-2 - k`` for the
            input's key ``k`` when that key is not in the list.
        sample: the sample of that feature (``-1`` if none).
        position: the offending entry of lengths, offsets or values (``-1`` if none).
        value: the offending number (a length, an offset, an id, a dtype code ...).
        limit: what it was compared with (a table's rows, the number of values ...).
    """

    code: Problem
    feature: int = NO_FEATURE
    sample: int = -1
    position: int = -1
    value: int = 0
    limit: int = 0

    WORDS = 6
    """How many integers :meth:`encode` gives."""

    def encode(self) -> list[int]:
        """The record as ``WORDS`` integers (``[0] * WORDS`` means no problem)."""
        return [int(x) for x in astuple(self)]

    @staticmethod
    def decode(words: Sequence[int]) -> InputProblem | None:
        """The record :meth:`encode` gave, or ``None`` for no problem."""
        if len(words) != InputProblem.WORDS:
            raise ValueError(f"an input problem is {InputProblem.WORDS} integers, got {words}")
        if words[0] == Problem.NONE:
            return None
        code, *rest = (int(w) for w in words)
        return InputProblem(Problem(code), *rest)

    def message(
        self,
        features: Sequence[str],
        tables: Mapping[str, str] | None = None,
        rank: int | None = None,
    ) -> str:
        """The error text: where (rank, feature, table, sample), what, and how to fix it.

        Args:
            features: the shared feature list ``feature`` indexes.
            tables: feature -> table name, for the message.
        """
        where = "" if rank is None else f"the input on rank {rank}: "
        what = self._feature(features, tables or {})
        if self.sample >= 0:
            what += f", sample {self.sample}"
        body = _TEXT[self.code](self)
        if what:
            joint = " " if self.code is Problem.MISSING_FEATURE else ": "
            return f"{where}{what}{joint}{body}"
        return f"{where}{body}"

    def error(
        self,
        features: Sequence[str],
        tables: Mapping[str, str] | None = None,
        rank: int | None = None,
    ) -> InvalidInputError:
        """The exception to raise for this problem (same type and text on every rank)."""
        text = self.message(features, tables, rank)
        if self.code in _TYPE_PROBLEMS:
            return InvalidInputTypeError(text, self, rank)
        if self.code is Problem.ID_OUT_OF_RANGE:
            return IdOutOfRangeError(text, self, rank)
        return InvalidInputError(text, self, rank)

    def _feature(self, features: Sequence[str], tables: Mapping[str, str]) -> str:
        if self.feature == NO_FEATURE:
            return ""
        if self.feature < NO_FEATURE:
            return f"input key #{-2 - self.feature} (not a feature of this collection)"
        name = features[self.feature]
        table = tables.get(name)
        return f"feature {name!r}" + ("" if table is None else f" (table {table!r})")


DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float8",
    "another dtype",
)
"""``InputProblem.value`` of a dtype problem -> the dtype's name."""


def dtype_index(name: str) -> int:
    """The code of a dtype name for :data:`DTYPE_NAMES` (its last entry if unlisted)."""
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else len(DTYPE_NAMES) - 1


def _dtype(code: int) -> str:
    return DTYPE_NAMES[code] if 0 <= code < len(DTYPE_NAMES) else "an unknown dtype"


_TEXT = {
    Problem.NOT_A_KJT: lambda p: (
        "the input is not a KeyedJaggedTensor; pass a KeyedJaggedTensor (e.g. "
        "KeyedJaggedTensor.from_lengths_sync(keys, values, lengths))"
    ),
    Problem.IDS_NOT_INTEGER: lambda p: (
        f"ids have dtype {_dtype(p.value)}; ids must be an integer tensor (int64 or "
        "int32): cast them with .long()"
    ),
    Problem.WEIGHTS_NOT_FLOAT: lambda p: (
        f"weights have dtype {_dtype(p.value)}; they must be floating point"
    ),
    Problem.MISSING_FEATURE: lambda p: (
        "is missing from the input; every feature of the collection must be among the input's "
        "keys (check its spelling)"
    ),
    Problem.WEIGHTS_MISSING: lambda p: (
        "the collection is weighted but the input has no weights; pass weights= to the "
        "KeyedJaggedTensor"
    ),
    Problem.NEGATIVE_LENGTH: lambda p: (
        f"lengths[{p.position}] = {p.value} is negative; bag lengths must be >= 0"
    ),
    Problem.OFFSETS_NOT_FROM_ZERO: lambda p: f"offsets must start at 0 but offsets[0] = {p.value}",
    Problem.OFFSETS_DECREASE: lambda p: (
        f"offsets decrease from offsets[{p.position}] = {p.limit} to offsets[{p.position + 1}] "
        f"= {p.value}; offsets must be non-decreasing"
    ),
    Problem.LENGTHS_OFFSETS_DIFFER: lambda p: (
        f"lengths[{p.position}] = {p.value} but the offsets give {p.limit}; lengths and offsets "
        "must describe the same bags"
    ),
    Problem.TOO_FEW_VALUES: lambda p: (
        f"the lengths add up to {p.value} but values has {p.limit} entries "
        f"({p.value - p.limit} too few values); lengths must add up to the number of values"
    ),
    Problem.UNCOVERED_VALUES: lambda p: (
        f"the lengths add up to {p.value} but values has {p.limit} entries "
        f"({p.limit - p.value} values not in any bag); lengths must add up to the number of values"
    ),
    Problem.ID_OUT_OF_RANGE: lambda p: (
        f"id {p.value} "
        + ("is negative" if p.value < 0 else f"is not below the table's {p.limit} rows")
        + f"; ids must be in [0, {p.limit}) (hash or clamp them before the collection)"
    ),
    Problem.WEIGHT_NOT_FINITE: lambda p: (
        f"weights[{p.position}] is {NON_FINITE.get(p.value, 'not finite')}; per-sample weights "
        "must be finite"
    ),
}
