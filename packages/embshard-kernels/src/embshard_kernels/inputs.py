"""From a KeyedJaggedTensor to a TBE's arguments, with the input checked first.

:func:`check_features` raises before any kernel runs (so before any weight or state changes) on a
missing feature, bad dtypes or an id out of range, naming the feature, its table and the value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


class IdOutOfRangeError(IndexError, ValueError):
    """An id is negative or not below the row count of its table (shard)."""


class TBEInput(NamedTuple):
    """The arguments of a table-batched embedding call.

    Attributes:
        indices: int64 ids of every bag, feature-major.
        offsets: int64 bag boundaries, one more than the number of bags.
        per_sample_weights: float32 per-id weights, or ``None``.
        batch_size_per_feature_per_rank: per feature, its batch size on each rank when batch
            sizes vary per feature; ``None`` otherwise.
    """

    indices: Tensor
    offsets: Tensor
    per_sample_weights: Tensor | None
    batch_size_per_feature_per_rank: list[list[int]] | None


class FeatureLayout:
    """What a group of tables expects of its input, precomputed once per kernel."""

    def __init__(self, config: GroupedEmbeddingConfig) -> None:
        self.feature_names: list[str] = config.feature_names()
        tables = config.embedding_tables
        self.feature_tables: list[str] = [tables[t].name for t in config.feature_table_map()]
        self.feature_rows: list[int] = [tables[t].rows for t in config.feature_table_map()]
        self.min_rows: int = min(self.feature_rows)
        self.is_weighted: bool = config.is_weighted

    def describe(self, f: int) -> str:
        return f"feature {self.feature_names[f]!r} (table {self.feature_tables[f]!r})"


def check_features(features: KeyedJaggedTensor, layout: FeatureLayout) -> None:
    """Raise unless ``features`` is a valid input for the group described by ``layout``.

    Raises:
        ValueError: a feature is missing, extra or out of order; weights are missing.
        TypeError: ids are not integers or weights are not floating point.
        IdOutOfRangeError: an id is negative or too large (an ``IndexError`` and ``ValueError``).
    """
    keys = features.keys()
    if keys != layout.feature_names:
        missing = [f for f in layout.feature_names if f not in keys]
        if missing:
            f = layout.feature_names.index(missing[0])
            raise ValueError(
                f"{layout.describe(f)} is missing from the input; the input has features {keys}"
            )
        raise ValueError(
            f"the kernel for features {layout.feature_names} got features {keys}; "
            "select and order them with KeyedJaggedTensor.permute"
        )
    values = features.values()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(
            f"ids of features {keys} (tables {sorted(set(layout.feature_tables))}) have dtype "
            f"{values.dtype}; ids must be an integer tensor (int64 or int32)"
        )
    if layout.is_weighted:
        weights = features.weights_or_none()
        if weights is None:
            raise ValueError(
                f"tables {sorted(set(layout.feature_tables))} are weighted but the input for "
                f"features {keys} has no weights; pass weights= to the KeyedJaggedTensor"
            )
        if not weights.is_floating_point():
            raise TypeError(
                f"weights of features {keys} have dtype {weights.dtype}; they must be floating point"
            )
    check_ids(features, layout)


def check_ids(features: KeyedJaggedTensor, layout: FeatureLayout) -> None:
    """Raise :class:`IdOutOfRangeError` unless every id is in ``[0, rows of its table)``."""
    values = features.values()
    if values.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(values)).tolist()
    if low >= 0 and high < layout.min_rows:
        return
    offsets = features.offset_per_key()
    for f, rows in enumerate(layout.feature_rows):
        segment = values[offsets[f] : offsets[f + 1]]
        if segment.numel() == 0:
            continue
        low, high = torch.stack(torch.aminmax(segment)).tolist()
        if low < 0 or high >= rows:
            _raise_bad_id(features, layout, f, segment, rows)


def _raise_bad_id(
    features: KeyedJaggedTensor, layout: FeatureLayout, f: int, segment: Tensor, rows: int
) -> None:
    bad = ((segment < 0) | (segment >= rows)).nonzero()[0, 0]
    value = int(segment[bad])
    bounds = features.lengths_offset_per_key()
    lengths = features.lengths()[bounds[f] : bounds[f + 1]]
    sample = int(torch.searchsorted(lengths.cumsum(0), bad, right=True))
    problem = "is negative" if value < 0 else f"is not below the table's {rows} rows"
    raise IdOutOfRangeError(
        f"{layout.describe(f)}: id {value} (sample {sample}, position {int(bad)} of the "
        f"feature's ids) {problem}; ids must be in [0, {rows})"
    )


def to_tbe_input(features: KeyedJaggedTensor, *, weighted: bool) -> TBEInput:
    """The TBE arguments for ``features`` (no copy when ids and offsets are already int64).

    ``features`` must have passed :func:`check_features`; ``weighted`` passes its weights.
    """
    weights = features.weights_or_none() if weighted else None
    if weights is not None and weights.dtype != torch.float32:
        weights = weights.float()
    return TBEInput(
        indices=features.values().long(),
        offsets=features.offsets().long(),
        per_sample_weights=weights,
        batch_size_per_feature_per_rank=(
            features.stride_per_key_per_rank() if features.variable_stride_per_key() else None
        ),
    )
