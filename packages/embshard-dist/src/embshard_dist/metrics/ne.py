"""Normalized entropy (``ne``): the log loss divided by the entropy of the mean label.

``NE = sum_i w_i CE(y_i, p_i) / (-P log2(q) - N log2(1 - q))`` with ``P`` and ``N`` the
weighted positives and negatives, ``q = P / (P + N)``, predictions and ``q`` clamped to
``[eta, 1 - eta]`` (TorchRec's definition, logs base 2). Below 1: better than always
predicting the mean label.
"""

from __future__ import annotations

import torch

from embshard_dist.metrics.sums import SumsMetric

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
    q = (pos / (pos + neg)).clamp(eta, 1 - eta)
    return ce / (-pos * torch.log2(q) - neg * torch.log2(1 - q))


class NEMetric(SumsMetric):
    """``ne-{task}|lifetime_ne`` / ``window_ne``. States: CE sum, positives, negatives."""

    namespace = "ne"
    metric_name = "ne"
    num_sums = 3

    def batch_state(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.stack([cross_entropy_sum(p, y, w), (w * y).sum(), (w * (1 - y)).sum()])

    def value(self, state: torch.Tensor) -> torch.Tensor:
        return ne_from_sums(state[0], state[1], state[2])
