"""Normalized entropy (``ne``): the log loss divided by the entropy of the mean label.

``NE = sum_i w_i CE(y_i, p_i) / (-P log2(q) - N log2(1 - q))`` with ``P`` and ``N`` the
weighted positives and negatives, ``q = P / (P + N)``, predictions and ``q`` clamped to
``[eta, 1 - eta]`` (TorchRec's definition, logs base 2). Below 1: better than always
predicting the mean label. The table is one row of three sums (cross entropy, ``P``, ``N``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.computation import RecMetricComputation, Rows, one_row

ETA = 1e-12


def cross_entropy_sum(
    p: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eta: float = ETA
) -> torch.Tensor:
    """``sum_i w_i * (-y_i log2 p_i - (1 - y_i) log2(1 - p_i))`` in float64."""
    p = p.double().clamp(eta, 1 - eta)
    y, w = y.double(), w.double()
    return (-w * y * torch.log2(p) - w * (1 - y) * torch.log2(1 - p)).sum()


def ne_from_sums(
    ce: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, eta: float = ETA
) -> torch.Tensor:
    """NE from the cross-entropy sum and the weighted positive and negative labels."""
    q = (pos / (pos + neg).clamp_min(eta)).clamp(eta, 1 - eta)
    return ce / (-pos * torch.log2(q) - neg * torch.log2(1 - q))


class NEMetricComputation(RecMetricComputation):
    """NE of one task (a ``torchmetrics.Metric``; see the module doc)."""

    higher_is_better = False

    def __init__(
        self,
        *,
        window_size: int,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(1, 3, window_size=window_size, process_group=process_group, name=name)

    def batch_stats(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Rows:
        return one_row(cross_entropy_sum(p, y, w), (w * y).sum(), (w * (1 - y)).sum())

    def value(self, table: torch.Tensor) -> torch.Tensor:
        return ne_from_sums(table[0, 0], table[0, 1], table[0, 2])


class NEMetric(RecMetric):
    """``ne-{task}|lifetime_ne`` / ``window_ne``."""

    namespace = "ne"
    metric_name = "ne"

    def make_computation(
        self, *, window_size: int, group: dist.ProcessGroup | None, name: str
    ) -> NEMetricComputation:
        return NEMetricComputation(window_size=window_size, process_group=group, name=name)
