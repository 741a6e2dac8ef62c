"""``RecMetricList``: several metrics updated from one batch of per-task tensors, and computed together.

TorchRec's ``torchrec.metrics.rec_metric.RecMetricList`` over embshard's
:class:`~embshard_dist.metrics.base.RecMetric`. ``update`` takes dicts task name -> tensor; a
task absent from a batch (or with empty tensors) is skipped for that batch, as in TorchRec. Every
task's batch is checked before any metric changes, so a bad batch leaves every metric as it was.
``compute()`` is a collective over the metrics' process group and always reduces (no cached
value stands in for a reduction on one rank while another reduces); with
``compute_on_all_ranks=False`` every rank still takes part, and ranks other than 0 get ``{}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from embshard_dist.metrics.base import RecMetric
from embshard_dist.metrics.computation import RecMetricComputation
from embshard_dist.metrics.inputs import Batch, prepare_batch

TaskTensors = Mapping[str, torch.Tensor]
"""One tensor per task name."""


def _is_empty(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.numel() == 0 for t in tensors)


class RecMetricList(nn.Module):
    """Metrics updated and computed together.

    Args:
        rec_metrics: the metrics; no two may report the same key (same metric and task).
        my_rank: this process's rank, for ``compute_on_all_ranks``.
        compute_on_all_ranks: whether ``compute()`` returns the values on every rank (else on
            rank 0 only).
    """

    rec_metrics: nn.ModuleList

    def __init__(
        self,
        rec_metrics: Sequence[RecMetric],
        *,
        my_rank: int = 0,
        compute_on_all_ranks: bool = True,
    ) -> None:
        super().__init__()
        seen: set[tuple[str, str]] = set()
        for metric in rec_metrics:
            if not isinstance(metric, RecMetric):
                raise TypeError(
                    f"RecMetricList: {type(metric).__module__}.{type(metric).__name__} is not an "
                    "embshard_dist.metrics.RecMetric (NEMetric, AUCMetric, AccuracyMetric, "
                    "CalibrationMetric)"
                )
            for task in metric.tasks:
                if (metric.namespace, task) in seen:
                    raise ValueError(
                        f"RecMetricList: two metrics would report {metric.namespace}-{task}; "
                        "keep one metric per namespace and task"
                    )
                seen.add((metric.namespace, task))
        self.rec_metrics = nn.ModuleList(rec_metrics)
        self.my_rank = my_rank
        self.compute_on_all_ranks = compute_on_all_ranks

    def __len__(self) -> int:
        return len(self.rec_metrics)

    def __getitem__(self, idx: int) -> RecMetric:
        metric = self.rec_metrics[idx]
        assert isinstance(metric, RecMetric)
        return metric

    def metrics(self) -> list[RecMetric]:
        """The metrics, in order."""
        return [self[i] for i in range(len(self))]

    def computations(self) -> Iterator[tuple[RecMetric, str, RecMetricComputation]]:
        """Every ``(metric, task, computation)``."""
        for metric in self.metrics():
            for task in metric.tasks:
                yield metric, task, metric.computation(task)

    def get_required_inputs(self) -> list[str] | None:
        """Model outputs the metrics need besides labels, predictions and weights: none."""
        return None

    @torch.no_grad()
    def update(
        self,
        *,
        predictions: TaskTensors,
        labels: TaskTensors,
        weights: TaskTensors | None = None,
    ) -> None:
        """Add a batch: per task, predicted probabilities, labels in [0, 1], sample weights
        (``None``: unit weights for every task).

        Raises:
            ValueError: a task has predictions but no labels (or no weights while ``weights``
                is given), tensors without one value per sample, or values out of range.
        """
        pending: list[tuple[RecMetricComputation, Batch]] = []
        for _, task, computation in self.computations():
            if task not in predictions:
                continue
            where = computation.name
            if task not in labels:
                raise ValueError(
                    f"{where}: predictions has task {task!r} but labels has not (labels has "
                    f"{sorted(labels)})"
                )
            if weights is not None and task not in weights:
                raise ValueError(
                    f"{where}: predictions has task {task!r} but weights has not (weights has "
                    f"{sorted(weights)}); pass weights=None for unit weights"
                )
            p, y = predictions[task], labels[task]
            w = None if weights is None else weights[task]
            if _is_empty(p, y, w):
                continue
            pending.append(
                (computation, prepare_batch(p, y, w, where=where, device=computation.device))
            )
        for computation, batch in pending:  # every batch checked: now change the states
            computation.update(*batch)

    def compute(self) -> dict[str, torch.Tensor]:
        """Every metric's keys, reduced over the ranks (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for metric in self.metrics():
            out.update(metric.compute())
        return out if self.compute_on_all_ranks or self.my_rank == 0 else {}

    def local_compute(self) -> dict[str, torch.Tensor]:
        """This rank's values alone (no communication), keys ``..|local_lifetime_{name}`` and
        ``..|local_window_{name}``."""
        out: dict[str, torch.Tensor] = {}
        for metric, task, computation in self.computations():
            computation.sync(should_sync=False)  # builds the window table, reduces nothing
            for prefix in ("lifetime", "window"):
                table = getattr(computation, prefix)
                key = f"{metric.namespace}-{task}|local_{prefix}_{metric.metric_name}"
                out[key] = computation.value(table).clone()
        return out

    def reset(self) -> None:
        """Forget every update of every metric."""
        for metric in self.metrics():
            metric.reset()
