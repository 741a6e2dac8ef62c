"""Exact AUC across ranks from a mergeable summary, not from the gathered predictions.

A rank's state is its *score table*: the sorted distinct scores with the weight of positives
and of negatives at each. Tables merge exactly (union of scores, weights added), so the merged
table of every rank's table is the table of the concatenated predictions, and the AUC computed
from it equals the AUC of the concatenated predictions (ties count one half, as scikit-learn's
``roc_auc_score``). Communication per ``compute()`` is three float64 values per distinct score
a rank holds, and a table never grows past the number of distinct scores, which for float32
probabilities is bounded whatever the number of samples. A set without positives or without
negatives has AUC 0.5 (TorchRec's convention).
"""

from __future__ import annotations

import torch

from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.reduce import gather_rows

ScoreTable = torch.Tensor
"""[k, 3] float64: ascending distinct scores, positive weight, negative weight."""


def score_table(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> ScoreTable:
    """The score table of predictions ``p``, labels ``y`` (0 / 1) and weights ``w``."""
    scores, inverse = torch.unique(p.double(), sorted=True, return_inverse=True)
    table = torch.zeros(scores.numel(), 3, dtype=torch.float64)
    table[:, 0] = scores
    table[:, 1].index_add_(0, inverse, (w * y).double())
    table[:, 2].index_add_(0, inverse, (w * (1 - y)).double())
    return table


def merge_tables(tables: list[ScoreTable]) -> ScoreTable:
    """One table for the samples of ``tables`` (exact)."""
    rows = torch.cat(tables)
    scores, inverse = torch.unique(rows[:, 0], sorted=True, return_inverse=True)
    out = torch.zeros(scores.numel(), 3, dtype=torch.float64)
    out[:, 0] = scores
    out[:, 1:].index_add_(0, inverse, rows[:, 1:])
    return out


def auc_of_table(table: ScoreTable) -> torch.Tensor:
    """Probability that a positive outscores a negative (ties: one half), weighted."""
    pos, neg = table[:, 1], table[:, 2]
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return torch.tensor(0.5, dtype=torch.float64)
    neg_below = torch.cumsum(neg, 0) - neg
    return (pos * (neg_below + 0.5 * neg)).sum() / (total_pos * total_neg)


class AUCMetric(RecMetric[ScoreTable]):
    """``auc-{task}|lifetime_auc`` / ``window_auc``, exact (see the module doc)."""

    namespace = "auc"
    metric_name = "auc"

    def empty(self) -> ScoreTable:
        return torch.zeros(0, 3, dtype=torch.float64)

    def batch_state(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> ScoreTable:
        return score_table(p, y, w)

    def merge(self, states: list[ScoreTable]) -> ScoreTable:
        return merge_tables(states)

    def reduce(self, state: ScoreTable, name: str) -> ScoreTable:
        return merge_tables(gather_rows(state, self.group, name))

    def value(self, state: ScoreTable) -> torch.Tensor:
        return auc_of_table(state)
