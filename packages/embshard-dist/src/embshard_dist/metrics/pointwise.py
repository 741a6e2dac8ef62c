"""Calibration and accuracy: weighted sums of per-sample quantities (TorchRec's definitions).

* ``calibration = sum w p / sum w y`` (1 is calibrated; no positives give inf or NaN,
  as TorchRec);
* ``accuracy = sum w [(p >= threshold) == y] / sum w``.

Each table is one row of two sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from embshard_dist.metrics.base import DEFAULT_TASK, DEFAULT_WINDOW_SIZE, RecMetric
from embshard_dist.metrics.computation import RecMetricComputation, Rows, one_row


class CalibrationMetricComputation(RecMetricComputation):
    """Calibration of one task (a ``torchmetrics.Metric``): ``sum w p / sum w y``."""

    def __init__(
        self,
        *,
        window_size: int,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(1, 2, window_size=window_size, process_group=process_group, name=name)

    def batch_stats(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Rows:
        return one_row((w * p).sum(), (w * y).sum())

    def value(self, table: torch.Tensor) -> torch.Tensor:
        return table[0, 0] / table[0, 1]


class AccuracyMetricComputation(RecMetricComputation):
    """Accuracy of one task (a ``torchmetrics.Metric``); predicted 1 where p >= threshold."""

    higher_is_better = True

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        window_size: int,
        process_group: dist.ProcessGroup | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(1, 2, window_size=window_size, process_group=process_group, name=name)
        self.threshold = threshold

    def batch_stats(self, p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Rows:
        right = ((p >= self.threshold).double() == y).double()
        return one_row((w * right).sum(), w.sum())

    def value(self, table: torch.Tensor) -> torch.Tensor:
        return table[0, 0] / table[0, 1]


class CalibrationMetric(RecMetric):
    """``calibration-{task}|lifetime_calibration`` / ``window_calibration``."""

    namespace = "calibration"
    metric_name = "calibration"

    def make_computation(
        self, *, window_size: int, group: dist.ProcessGroup | None, name: str
    ) -> CalibrationMetricComputation:
        return CalibrationMetricComputation(window_size=window_size, process_group=group, name=name)


class AccuracyMetric(RecMetric):
    """``accuracy-{task}|lifetime_accuracy`` / ``window_accuracy``; predicted 1 where p >= threshold."""

    namespace = "accuracy"
    metric_name = "accuracy"

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

    def make_computation(
        self, *, window_size: int, group: dist.ProcessGroup | None, name: str
    ) -> AccuracyMetricComputation:
        return AccuracyMetricComputation(
            threshold=self.threshold, window_size=window_size, process_group=group, name=name
        )
