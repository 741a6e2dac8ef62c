"""What a metric module computes, with TorchRec's names (``torchrec.metrics.metrics_config``).

Plain configuration: frozen dataclasses and enums, no tensors, nothing computed at import.
:func:`~embshard_dist.metrics.metric_module.generate_metric_module` turns a :class:`MetricsConfig`
into a :class:`~embshard_dist.metrics.metric_module.RecMetricModule`. ``RecMetricEnum`` lists
every TorchRec metric so that configs written for TorchRec import; embshard computes NE, AUC,
accuracy and calibration, and naming another one fails when the module is generated, with the
list of those it computes. Defaults are TorchRec's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

DEFAULT_WINDOW_SIZE = 10_000_000
DEFAULT_THROUGHPUT_WINDOW_SECONDS = 100
DEFAULT_THROUGHPUT_WARMUP_STEPS = 100


class RecMetricEnumBase(Enum):
    """Base of metric enums; ``str()`` of a member is its value (``"ne"``)."""

    def __str__(self) -> str:
        return str(self.value)


class RecMetricEnum(RecMetricEnumBase):
    """TorchRec's metrics; embshard computes ``NE``, ``AUC``, ``ACCURACY`` and ``CALIBRATION``."""

    NE = "ne"
    NE_POSITIVE = "ne_positive"
    RECALIBRATED_NE = "recalibrated_ne"
    RECALIBRATED_CALIBRATION = "recalibrated_calibration"
    SEGMENTED_NE = "segmented_ne"
    LOG_LOSS = "log_loss"
    CTR = "ctr"
    AUC = "auc"
    AUPRC = "auprc"
    RAUC = "rauc"
    CALIBRATION = "calibration"
    MSE = "mse"
    MAE = "mae"
    MULTICLASS_RECALL = "multiclass_recall"
    RECALL_SESSION_LEVEL = "recall_session_level"
    PRECISION_SESSION_LEVEL = "precision_session_level"
    WEIGHTED_AVG = "weighted_avg"
    TOWER_QPS = "tower_qps"
    ACCURACY = "accuracy"
    NDCG = "ndcg"
    XAUC = "xauc"
    SCALAR = "scalar"
    PRECISION = "precision"
    RECALL = "recall"
    SERVING_NE = "serving_ne"
    SERVING_CALIBRATION = "serving_calibration"
    SERVING_AE_LOSS = "serving_ae_loss"
    OUTPUT = "output"
    TENSOR_WEIGHTED_AVG = "tensor_weighted_avg"
    CALI_FREE_NE = "cali_free_ne"
    UNWEIGHTED_NE = "unweighted_ne"
    HINDSIGHT_TARGET_PR = "hindsight_target_pr"
    NMSE = "nmse"
    AVERAGE = "average"
    MULTI_LABEL_PRECISION = "multi_label_precision"
    NUM_POSITIVE_SAMPLES = "num_positive_samples"
    SUM_WEIGHTS = "sum_weights"
    NUM_MISSING_LABELS = "num_missing_labels"
    WEIGHTED_SUM_PREDICTIONS = "weighted_sum_predictions"


class StateMetricEnum(Enum):
    """Components whose own metrics a module reports (``optimizers-optimizers|...`` keys)."""

    OPTIMIZERS = "optimizers"
    MODEL_CONFIGURATOR = "model_configurator"

    def __str__(self) -> str:
        return str(self.value)


class RecComputeMode(Enum):
    """TorchRec's ways to batch the work of several tasks; every mode gives the same values
    here (embshard keeps one table per task and metric)."""

    FUSED_TASKS_COMPUTATION = 1
    UNFUSED_TASKS_COMPUTATION = 2
    FUSED_TASKS_AND_STATES_COMPUTATION = 3


@dataclass(frozen=True)
class RecTaskInfo:
    """One task: its name in metric keys and where its tensors are in the model's output.

    Args:
        name: the task in keys, ``{namespace}-{name}|...``.
        label_name, prediction_name, weight_name: keys of the model output dict holding the
            labels, the predicted probabilities and the sample weights (embshard: an empty
            ``weight_name`` means unit weights).
    """

    name: str = "DefaultTask"
    label_name: str = "label"
    prediction_name: str = "prediction"
    weight_name: str = "weight"


@dataclass(frozen=True)
class RecMetricDef:
    """One metric over some tasks.

    Args:
        rec_tasks: the tasks; or, instead, ``rec_task_indices`` into ``MetricsConfig.rec_tasks``
            (exactly one of the two is non-empty).
        window_size: samples over all ranks the window covers (each rank keeps
            ``ceil(window_size / world_size)``, which must be at least the batch size).
        arguments: keyword arguments of the metric (``threshold`` for accuracy, ``num_bins``
            for AUC).
    """

    rec_tasks: list[RecTaskInfo] = field(default_factory=list)
    rec_task_indices: list[int] = field(default_factory=list)
    window_size: int = DEFAULT_WINDOW_SIZE
    arguments: dict[str, Any] | None = None


@dataclass(frozen=True)
class ThroughputDef:
    """Throughput: ``window_size`` seconds of window; rates count from after ``warmup_steps``."""

    window_size: int = DEFAULT_THROUGHPUT_WINDOW_SECONDS
    warmup_steps: int = DEFAULT_THROUGHPUT_WARMUP_STEPS


@dataclass(frozen=True)
class MetricsConfig:
    """Everything a metric module computes.

    Args:
        rec_tasks: tasks the metrics may refer to by index.
        rec_metrics: each metric and its definition.
        throughput_metric: throughput, or none.
        state_metrics: components whose ``get_metrics()`` the module reports.
        compute_interval_steps: ``should_compute()`` is true every this many updates.
        min_compute_interval, max_compute_interval: seconds; if either is set, the interval in
            steps is adjusted once, at the second ``compute()``, to land between them.
        compute_on_all_ranks: whether every rank gets the metric values (else rank 0 only; all
            ranks take part in ``compute()`` either way).
        rec_compute_mode, fused_update_limit, enable_pt2_compile, should_clone_update_inputs,
            use_cpu_offloaded_rec_metric_module: TorchRec's speed settings; accepted, and the
            values are the same whatever they are.
        should_validate_update: TorchRec's masking of tasks without a weighted sample; not
            supported (``True`` fails when the module is generated).
    """

    rec_tasks: list[RecTaskInfo] = field(default_factory=list)
    rec_metrics: dict[RecMetricEnum, RecMetricDef] = field(default_factory=dict)
    throughput_metric: ThroughputDef | None = None
    rec_compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION
    fused_update_limit: int = 0
    state_metrics: list[StateMetricEnum] = field(default_factory=list)
    compute_interval_steps: int = 100
    min_compute_interval: float = 0.0
    max_compute_interval: float = float("inf")
    compute_on_all_ranks: bool = False
    should_validate_update: bool = False
    enable_pt2_compile: bool = False
    should_clone_update_inputs: bool = False
    use_cpu_offloaded_rec_metric_module: bool | None = None

    def __post_init__(self) -> None:
        for metric, definition in self.rec_metrics.items():
            for index in definition.rec_task_indices:
                if not 0 <= index < len(self.rec_tasks):
                    raise ValueError(
                        f"MetricsConfig: metric {metric} refers to rec_tasks[{index}], but "
                        f"rec_tasks has {len(self.rec_tasks)} tasks"
                    )


DefaultTaskInfo = RecTaskInfo()

DefaultMetricsConfig = MetricsConfig(
    rec_tasks=[DefaultTaskInfo],
    rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[DefaultTaskInfo])},
    throughput_metric=ThroughputDef(),
)

EmptyMetricsConfig = MetricsConfig()
