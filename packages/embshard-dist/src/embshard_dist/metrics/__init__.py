"""Training metrics reduced across ranks, with TorchRec's names (``torchrec.metrics``).

Built on torchmetrics: each task's metric is a ``torchmetrics.Metric`` whose states are
fixed-size tables of weighted sums (for AUC a score histogram), synced by one all-reduce per
state, so every rank gets the value of the concatenated predictions while ranks exchange only
these partial statistics, never predictions. Keys read
``{namespace}-{task}|{lifetime|window}_{name}``, e.g. ``ne-DefaultTask|lifetime_ne``.
TorchRec's metric module is here too: ``MetricsConfig`` and its parts, ``generate_metric_module``
and ``RecMetricModule`` (``update(model_out)``, ``compute()`` (a ``DeferrableMetrics``),
``state_dict()``, ``sync()``,
``get_pre_compute_states()`` / ``load_pre_compute_states()``, ...).
Importing this package imports torchmetrics; ``import embshard_dist`` does not.
"""

from embshard_dist.metrics.auc import AUCMetric, AUCMetricComputation
from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.computation import RecMetricComputation
from embshard_dist.metrics.deferrable_metrics import DeferrableMetrics
from embshard_dist.metrics.metric_list import RecMetricList
from embshard_dist.metrics.metric_module import generate_metric_module
from embshard_dist.metrics.metrics_config import (
    DefaultMetricsConfig,
    DefaultTaskInfo,
    EmptyMetricsConfig,
    MetricsConfig,
    RecComputeMode,
    RecMetricDef,
    RecMetricEnum,
    RecMetricEnumBase,
    RecTaskInfo,
    StateMetricEnum,
    ThroughputDef,
)
from embshard_dist.metrics.ne import NEMetric, NEMetricComputation
from embshard_dist.metrics.pointwise import (
    AccuracyMetric,
    AccuracyMetricComputation,
    CalibrationMetric,
    CalibrationMetricComputation,
)
from embshard_dist.metrics.rec_metric_module import (
    RecMetricException,
    RecMetricModule,
    StateMetric,
)
from embshard_dist.metrics.throughput import ThroughputMetric
from embshard_dist.metrics.warmup_throughput import WarmupThroughputMetric

__all__ = [
    "AUCMetric",
    "AUCMetricComputation",
    "AccuracyMetric",
    "AccuracyMetricComputation",
    "CalibrationMetric",
    "CalibrationMetricComputation",
    "DefaultMetricsConfig",
    "DeferrableMetrics",
    "DefaultTaskInfo",
    "EmptyMetricsConfig",
    "MetricsConfig",
    "NEMetric",
    "NEMetricComputation",
    "RecComputeMode",
    "RecMetric",
    "RecMetricComputation",
    "RecMetricDef",
    "RecMetricEnum",
    "RecMetricEnumBase",
    "RecMetricException",
    "RecMetricList",
    "RecMetricModule",
    "RecTaskInfo",
    "StateMetric",
    "StateMetricEnum",
    "ThroughputDef",
    "ThroughputMetric",
    "WarmupThroughputMetric",
    "generate_metric_module",
]
