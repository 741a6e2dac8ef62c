"""AUC across ranks from a fixed-size score histogram, never from gathered predictions.

The table has a row per score cell, ``floor(p * num_bins)`` for ``p`` in ``[0, 1]`` (``p = 1``
has its own cell), holding the weight of positives and of negatives whose prediction falls in
it. Tables add, so the all-reduced table is the table of the concatenated predictions, and its
AUC is that of the concatenated predictions: the weighted probability that a positive
outscores a negative, pairs in one cell counting one half. That is scikit-learn's
``roc_auc_score`` (ties count one half) whenever no cell holds a positive and a negative with
different scores, e.g. for predictions that are multiples of ``1 / num_bins`` (with
``num_bins`` a power of two, the cell of a float32 prediction is computed exactly) or any
predictions whose distinct values are further apart than ``1 / num_bins``. Otherwise each such
pair is off by at most one half, so the AUC is off by at most :func:`auc_tie_bound` of the
table. A set without positives or without negatives has AUC 0.5 (TorchRec's convention).
Communication per ``compute()`` is one all-reduce of ``2 * (num_bins + 1)`` float64 per table,
whatever the number of samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from embshard_dist.metrics.base import DEFAULT_TASK, DEFAULT_WINDOW_SIZE, RecMetric
from embshard_dist.metrics.computation import RecMetricComputation, Rows

DEFAULT_NUM_BINS = 1 << 20


def score_cells(p: torch.Tensor, num_bins: int) -> torch.Tensor:
    """The cell (int64) of each probability in ``p``: ``floor(p * num_bins)``, at most ``num_bins``."""
    return torch.floor(p.double() * num_bins).long().clamp_(0, num_bins)


def histogram_rows(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, num_bins: int) -> Rows:
    """The occupied cells of a batch and their ``[positive, negative]`` weights."""
    cells, inverse = torch.unique(score_cells(p, num_bins), sorted=True, return_inverse=True)
    values = torch.zeros(cells.numel(), 2, dtype=torch.float64, device=p.device)
    values.index_add_(0, inverse, torch.stack([w * y, w * (1 - y)], dim=1).double())
    return cells, values


def auc_of_table(table: torch.Tensor) -> torch.Tensor:
    """Probability that a positive outscores a negative (one cell: one half), weighted."""
    pos, neg = table[:, 0], table[:, 1]
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return torch.tensor(0.5, dtype=torch.float64, device=table.device)
    neg_below = torch.cumsum(neg, 0) - neg
    return (pos * (neg_below + 0.5 * neg)).sum() / (total_pos * total_neg)


def auc_tie_bound(table: torch.Tensor) -> torch.Tensor:
    """How far :func:`auc_of_table` can be from the exact AUC: half the weight share of
    positive-negative pairs that share a cell (0 when no cell holds both)."""
    pos, neg = table[:, 0], table[:, 1]
    total = pos.sum() * neg.sum()
    if total <= 0:
        return torch.tensor(0.0, dtype=torch.float64, device=table.device)
    return 0.5 * (pos * neg).sum() / total


class AUCMetricComputation(RecMetricComputation):
    """AUC of one task (a ``torchmetrics.Metric``; see the module doc)."""

    higher_is_better = True

    def __init__(
        self,
        *,
        num_bins: int = DEFAULT_NUM_BINS,
        window_size: int,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        if num_bins < 1:
            raise ValueError(f"{name or 'AUC'}: num_bins must be >= 1, got {num_bins}")
        super().__init__(
            num_bins + 1, 2, window_size=window_size, process_group=process_group, name=name
        )
        self.num_bins = num_bins

    def batch_stats(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Rows:
        return histogram_rows(p, y, w, self.num_bins)

    def value(self, table: torch.Tensor) -> torch.Tensor:
        return auc_of_table(table)


class AUCMetric(RecMetric):
    """``auc-{task}|lifetime_auc`` / ``window_auc`` (see the module doc).

    Args:
        num_bins: score cells over ``[0, 1]`` (a power of two keeps cells exact for float32).
    """

    namespace = "auc"
    metric_name = "auc"

    def __init__(
        self,
        tasks: Sequence[str] = (DEFAULT_TASK,),
        *,
        num_bins: int = DEFAULT_NUM_BINS,
        window_size: int = DEFAULT_WINDOW_SIZE,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.num_bins = num_bins
        super().__init__(tasks, window_size=window_size, group=group)

    def make_computation(
        self, *, window_size: int, group: dist.ProcessGroup | None, name: str
    ) -> AUCMetricComputation:
        return AUCMetricComputation(
            num_bins=self.num_bins, window_size=window_size, process_group=group, name=name
        )
