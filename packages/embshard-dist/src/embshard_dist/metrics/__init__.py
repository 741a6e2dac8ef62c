"""Training metrics reduced across ranks, with TorchRec's names (``torchrec.metrics``).

Each rank keeps partial statistics (sums, or for AUC sorted unique scores with their positive and
negative weights); ``compute()`` reduces them over the process group, so every rank gets the
value of the concatenated predictions. Keys read ``{namespace}-{task}|{lifetime|window}_{name}``,
e.g. ``ne-DefaultTask|lifetime_ne``.
"""

from embshard_dist.metrics.auc import AUCMetric
from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.ne import NEMetric
from embshard_dist.metrics.pointwise import AccuracyMetric, CalibrationMetric
from embshard_dist.metrics.throughput import ThroughputMetric

__all__ = [
    "AUCMetric",
    "AccuracyMetric",
    "CalibrationMetric",
    "NEMetric",
    "RecMetric",
    "ThroughputMetric",
]
