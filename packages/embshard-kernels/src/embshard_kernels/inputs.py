"""From a KeyedJaggedTensor to a TBE's arguments, with the input checked first.

:func:`check_features` raises before any kernel runs (so before any weight or state changes) on a
missing feature, bad dtypes, a broken layout (negative lengths, offsets not from 0 or decreasing,
lengths that do not add up to the values), a non-finite weight or an id out of range, naming the
feature, its table and the value: no input that could make a kernel read or write out of bounds
reaches one, whatever constructor built it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from embshard_kernels.grouping import GroupedEmbeddingConfig
from embshard_types.sparse.input_problems import IdOutOfRangeError
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.kjt_checks import KJTChecker

__all__ = ["FeatureLayout", "IdOutOfRangeError", "TBEInput", "check_features", "to_tbe_input"]


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
        self.is_weighted: bool = config.is_weighted
        self.tables: dict[str, str] = dict(
            zip(self.feature_names, self.feature_tables, strict=True)
        )
        self.checker = KJTChecker(self.feature_names, self.feature_rows, weighted=self.is_weighted)


def check_features(features: KeyedJaggedTensor, layout: FeatureLayout) -> None:
    """Raise unless ``features`` is a valid input for the group described by ``layout``.

    Raises:
        ValueError: a feature is missing, extra or out of order; weights are missing or not
            finite; the lengths or offsets do not describe the values.
        TypeError: ids are not integers or weights are not floating point.
        IdOutOfRangeError: an id is negative or too large (an ``IndexError`` and ``ValueError``).
    """
    keys = features.keys()
    if keys != layout.feature_names and all(f in keys for f in layout.feature_names):
        raise ValueError(
            f"the kernel for features {layout.feature_names} got features {keys}; "
            "select and order them with KeyedJaggedTensor.permute"
        )
    problem = layout.checker.check(features)
    if problem is not None:
        raise problem.error(layout.feature_names, layout.tables)


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
