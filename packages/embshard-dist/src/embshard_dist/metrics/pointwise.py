"""Calibration and accuracy: weighted sums of per-sample quantities.

* ``calibration = sum w p / sum w y`` (1 is calibrated; no positives give inf or NaN,
  as TorchRec);
* ``accuracy = sum w [(p >= threshold) == y] / sum w``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from embshard_dist.metrics.base import DEFAULT_TASK, DEFAULT_WINDOW_SIZE
from embshard_dist.metrics.sums import SumsMetric


class CalibrationMetric(SumsMetric):
    """``calibration-{task}|lifetime_calibration`` / ``window_calibration``."""

    namespace = "calibration"
    metric_name = "calibration"
    num_sums = 2

    def batch_state(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * p).sum(), (w * y).sum()])

    def value(self, state: torch.Tensor) -> torch.Tensor:
        return state[0] / state[1]


class AccuracyMetric(SumsMetric):
    """``accuracy-{task}|lifetime_accuracy`` / ``window_accuracy``; predicted 1 where p >= threshold."""

    namespace = "accuracy"
    metric_name = "accuracy"
    num_sums = 2

    def __init__(
        self,
        tasks: Sequence[str] = (DEFAULT_TASK,),
        *,
        threshold: float = 0.5,
        window_size: int = DEFAULT_WINDOW_SIZE,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.threshold = threshold
        super().__init__(tasks, window_size=window_size, group=group)

    def batch_state(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        right = ((p >= self.threshold).double() == y).double()
        return torch.stack([(w * right).sum(), w.sum()])

    def value(self, state: torch.Tensor) -> torch.Tensor:
        return state[0] / state[1]
