"""Training metrics reduced across ranks, with TorchRec's names (``torchrec.metrics``).

Built on torchmetrics: each task's metric is a ``torchmetrics.Metric`` whose states are
fixed-size tables of weighted sums (for AUC a score histogram), synced by one all-reduce per
state, so every rank gets the value of the concatenated predictions while ranks exchange only
these partial statistics, never predictions. Keys read
``{namespace}-{task}|{lifetime|window}_{name}``, e.g. ``ne-DefaultTask|lifetime_ne``.
Importing this package imports torchmetrics; ``import embshard_dist`` does not.
"""

from embshard_dist.metrics.auc import AUCMetric, AUCMetricComputation
from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.computation import RecMetricComputation
from embshard_dist.metrics.ne import NEMetric, NEMetricComputation
from embshard_dist.metrics.pointwise import (
    AccuracyMetric,
    AccuracyMetricComputation,
    CalibrationMetric,
    CalibrationMetricComputation,
)
from embshard_dist.metrics.throughput import ThroughputMetric

__all__ = [
    "AUCMetric",
    "AUCMetricComputation",
    "AccuracyMetric",
    "AccuracyMetricComputation",
    "CalibrationMetric",
    "CalibrationMetricComputation",
    "NEMetric",
    "NEMetricComputation",
    "RecMetric",
    "RecMetricComputation",
    "ThroughputMetric",
]
