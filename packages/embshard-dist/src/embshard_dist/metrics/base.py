"""``RecMetric``: one metric over one or more tasks, lifetime and windowed, TorchRec's keys.

A ``RecMetric`` is an ``nn.Module`` holding one
:class:`~embshard_dist.metrics.computation.RecMetricComputation` (a ``torchmetrics.Metric``) per
task, as TorchRec's. ``update`` checks every task's batch before any state changes;
``compute()`` is a collective (every rank of the group calls it together) returning
``{namespace}-{task}|lifetime_{name}`` and ``..|window_{name}``, reduced over the group.
``window_size`` counts samples over the group, as TorchRec's: each rank keeps its latest
``ceil(window_size / world_size)`` samples, and always its latest batch.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from embshard_dist.metrics.computation import RecMetricComputation
from embshard_dist.metrics.inputs import Batch, prepare_batch
from embshard_dist.metrics.reduce import world_size

DEFAULT_TASK = "DefaultTask"
DEFAULT_WINDOW_SIZE = 10_000_000

Preds = torch.Tensor | Mapping[str, torch.Tensor]


class RecMetric(nn.Module):
    """One metric over ``tasks``, lifetime and windowed.

    Args:
        tasks: task names; ``update`` takes a tensor per task (a mapping) or, for one task, a tensor.
        window_size: samples over the group the window covers.
        group: the process group to reduce over (default: the default group, if any).
    """

    namespace: ClassVar[str]
    metric_name: ClassVar[str]

    def __init__(
        self,
        tasks: Sequence[str] = (DEFAULT_TASK,),
        *,
        window_size: int = DEFAULT_WINDOW_SIZE,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"{self.namespace}: need distinct task names, got {list(tasks)}")
        if window_size <= 0:
            raise ValueError(f"{self.namespace}: window_size must be positive, got {window_size}")
        self.tasks = list(tasks)
        self.window_size = window_size
        self.group = group
        local_window = math.ceil(window_size / world_size(group))
        self.computations = nn.ModuleList(  # in the order of ``tasks``
            self.make_computation(
                window_size=local_window, group=group, name=f"{self.namespace}-{t}"
            )
            for t in self.tasks
        )

    @abstractmethod
    def make_computation(
        self, *, window_size: int, group: dist.ProcessGroup | None, name: str
    ) -> RecMetricComputation:
        """The computation of one task."""

    def computation(self, task: str) -> RecMetricComputation:
        """The ``torchmetrics.Metric`` of ``task``."""
        comp = self.computations[self.tasks.index(task)]
        assert isinstance(comp, RecMetricComputation)
        return comp

    def reset(self) -> None:
        """Forget every update."""
        for task in self.tasks:
            self.computation(task).reset()

    def _per_task(self, x: Preds | None, what: str) -> dict[str, torch.Tensor | None]:
        if x is None:
            return dict.fromkeys(self.tasks)
        if isinstance(x, torch.Tensor):
            if len(self.tasks) != 1:
                raise ValueError(
                    f"{self.namespace}: {what} is one tensor but the metric has tasks "
                    f"{self.tasks}; pass a mapping task -> tensor"
                )
            return {self.tasks[0]: x}
        missing = [t for t in self.tasks if t not in x]
        if missing:
            raise ValueError(f"{self.namespace}: {what} lacks tasks {missing}")
        return {t: x[t] for t in self.tasks}

    @torch.no_grad()
    def update(self, predictions: Preds, labels: Preds, weights: Preds | None = None) -> None:
        """Add a batch: predicted probabilities, labels in [0, 1], optional sample weights."""
        preds, labs = self._per_task(predictions, "predictions"), self._per_task(labels, "labels")
        ws = self._per_task(weights, "weights")
        batches: dict[str, Batch] = {}
        for task in self.tasks:  # check every task before any state changes
            p, y = preds[task], labs[task]
            assert p is not None and y is not None
            comp = self.computation(task)
            batches[task] = prepare_batch(p, y, ws[task], where=comp.name, device=comp.device)
        for task, batch in batches.items():
            self.computation(task).update(*batch)

    def compute(self) -> dict[str, torch.Tensor]:
        """``{namespace}-{task}|lifetime_{name}`` and ``..|window_{name}`` for every task."""
        out: dict[str, torch.Tensor] = {}
        for task in self.tasks:
            values = self.computation(task).compute()
            for prefix in ("lifetime", "window"):
                out[f"{self.namespace}-{task}|{prefix}_{self.metric_name}"] = values[prefix]
        return out
