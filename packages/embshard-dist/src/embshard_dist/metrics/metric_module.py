"""``generate_metric_module``: the ``RecMetricModule`` a ``MetricsConfig`` describes, as TorchRec's.

Same signature and keyword names as ``torchrec.metrics.metric_module.generate_metric_module``;
this module also holds the names a TorchRec script imports from there (``RecMetricModule``,
``StateMetric``). Each ``RecMetricDef`` becomes one embshard metric over its tasks, reducing over
``process_group``; the throughput counts ``batch_size`` examples per update after
``ThroughputDef.warmup_steps``. Where TorchRec would fail late or silently, this raises up front
with what to change: a metric embshard does not compute (naming those it does), arguments a
metric does not take, tasks given twice differently, a per-rank window smaller than a batch, a
``world_size`` the process group disagrees with, settings embshard does not support.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from embshard_dist.metrics.auc import AUCMetric
from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.metric_list import RecMetricList
from embshard_dist.metrics.metrics_config import (
    MetricsConfig,
    RecMetricDef,
    RecMetricEnum,
    RecTaskInfo,
    StateMetricEnum,
)
from embshard_dist.metrics.ne import NEMetric
from embshard_dist.metrics.pointwise import AccuracyMetric, CalibrationMetric
from embshard_dist.metrics.rec_metric_module import (
    MetricValue,
    RecMetricModule,
    StateMetric,
    distinct_tasks,
)
from embshard_dist.metrics.reduce import world_size as group_size
from embshard_dist.metrics.warmup_throughput import WarmupThroughputMetric

__all__ = [
    "REC_METRICS_MAPPING",
    "MetricValue",
    "RecMetricList",
    "RecMetricModule",
    "StateMetric",
    "generate_metric_module",
]

REC_METRICS_MAPPING: dict[RecMetricEnum, type[RecMetric]] = {
    RecMetricEnum.NE: NEMetric,
    RecMetricEnum.AUC: AUCMetric,
    RecMetricEnum.ACCURACY: AccuracyMetric,
    RecMetricEnum.CALIBRATION: CalibrationMetric,
}
"""The metrics embshard computes."""


def _metric_tasks(
    metric: RecMetricEnum, definition: RecMetricDef, config: MetricsConfig
) -> list[RecTaskInfo]:
    if definition.rec_tasks and definition.rec_task_indices:
        raise ValueError(f"RecMetricDef of {metric}: give rec_tasks or rec_task_indices, not both")
    if definition.rec_tasks:
        return list(definition.rec_tasks)
    if definition.rec_task_indices:
        return [config.rec_tasks[i] for i in definition.rec_task_indices]
    raise ValueError(f"RecMetricDef of {metric}: rec_tasks and rec_task_indices are both empty")


def _build_metric(
    metric: RecMetricEnum,
    definition: RecMetricDef,
    tasks: list[RecTaskInfo],
    *,
    batch_size: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
) -> RecMetric:
    if not isinstance(metric, RecMetricEnum):
        raise TypeError(
            f"MetricsConfig.rec_metrics: key {metric!r} is not an embshard_dist.metrics."
            "RecMetricEnum; import RecMetricEnum from embshard_dist.metrics"
        )
    cls = REC_METRICS_MAPPING.get(metric)
    if cls is None:
        supported = ", ".join(f"RecMetricEnum.{m.name}" for m in REC_METRICS_MAPPING)
        raise ValueError(
            f"RecMetricEnum.{metric.name} is not computed by embshard; it computes {supported}"
        )
    arguments = dict(definition.arguments or {})
    accepted = {
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in ("window_size", "group")
    }
    if set(arguments) - accepted:
        raise ValueError(
            f"RecMetricDef.arguments of {metric}: {sorted(set(arguments) - accepted)} not "
            f"taken; {cls.__name__} takes {sorted(accepted) or 'none'}"
        )
    if math.ceil(definition.window_size / world_size) < batch_size:
        raise ValueError(
            f"RecMetricDef of {metric}: window_size {definition.window_size} over {world_size} "
            f"ranks leaves each rank a window of {math.ceil(definition.window_size / world_size)}"
            f" samples, less than batch_size {batch_size}; raise window_size"
        )
    names = [t.name for t in tasks]
    return cls(names, window_size=definition.window_size, group=process_group, **arguments)


def _state_metrics(
    config: MetricsConfig, mapping: Mapping[StateMetricEnum, StateMetric]
) -> dict[str, StateMetric]:
    out: dict[str, StateMetric] = {}
    for kind in config.state_metrics:
        component = mapping.get(kind)
        if component is None:
            raise ValueError(
                f"MetricsConfig.state_metrics lists {kind}, but state_metrics_mapping has no "
                f"component for it (it has {[str(k) for k in mapping]})"
            )
        if not isinstance(component, StateMetric):
            raise TypeError(f"state_metrics_mapping[{kind}] has no get_metrics() method")
        out[f"{kind.value}-{kind.value}"] = component
    return out


def generate_metric_module(
    metric_class: type[RecMetricModule],
    metrics_config: MetricsConfig,
    batch_size: int,
    world_size: int,
    my_rank: int,
    state_metrics_mapping: Mapping[StateMetricEnum, StateMetric],
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
    batch_size_stages: Sequence[Any] | None = None,
    module_kwargs: Mapping[str, Any] | None = None,
) -> RecMetricModule:
    """The metric module ``metrics_config`` describes, on ``device``, reducing over
    ``process_group`` (default: the default group), as TorchRec's function.

    Raises:
        ValueError: the config names a metric embshard does not compute, arguments a metric does
            not take, tasks badly, a window smaller than a batch; ``world_size`` or ``my_rank``
            disagree with the process group; ``batch_size_stages`` or
            ``should_validate_update`` (not supported).
        TypeError: ``metric_class`` is not a ``RecMetricModule``.
    """
    if not (isinstance(metric_class, type) and issubclass(metric_class, RecMetricModule)):
        raise TypeError(
            f"generate_metric_module: metric_class must be embshard_dist.metrics.RecMetricModule "
            f"or a subclass, got {metric_class!r}"
        )
    ranks = group_size(process_group)
    if world_size != ranks or not 0 <= my_rank < world_size:
        raise ValueError(
            f"generate_metric_module: world_size={world_size}, my_rank={my_rank}, but the "
            f"process group has {ranks} rank(s)"
            + ("" if dist.is_initialized() else " (torch.distributed is not initialised)")
        )
    if batch_size_stages:
        raise ValueError("generate_metric_module: batch_size_stages is not supported by embshard")
    if metrics_config.should_validate_update:
        raise ValueError(
            "generate_metric_module: MetricsConfig.should_validate_update is not supported by "
            "embshard; leave it False"
        )
    resolved = {
        metric: _metric_tasks(metric, definition, metrics_config)
        for metric, definition in metrics_config.rec_metrics.items()
    }
    tasks = distinct_tasks([metrics_config.rec_tasks, *resolved.values()], "MetricsConfig")
    metrics = [
        _build_metric(
            metric,
            definition,
            resolved[metric],
            batch_size=batch_size,
            world_size=world_size,
            process_group=process_group,
        )
        for metric, definition in metrics_config.rec_metrics.items()
    ]
    throughput = None
    if metrics_config.throughput_metric is not None:
        throughput = WarmupThroughputMetric(
            batch_size,
            warmup_steps=metrics_config.throughput_metric.warmup_steps,
            window_seconds=float(metrics_config.throughput_metric.window_size),
            group=process_group,
        )
    module = metric_class(
        batch_size=batch_size,
        world_size=world_size,
        rec_tasks=tasks,
        rec_metrics=RecMetricList(
            metrics, my_rank=my_rank, compute_on_all_ranks=metrics_config.compute_on_all_ranks
        ),
        throughput_metric=throughput,
        state_metrics=_state_metrics(metrics_config, state_metrics_mapping),
        compute_interval_steps=metrics_config.compute_interval_steps,
        min_compute_interval=metrics_config.min_compute_interval,
        max_compute_interval=metrics_config.max_compute_interval,
        **dict(module_kwargs or {}),
    )
    return module.to(device)
