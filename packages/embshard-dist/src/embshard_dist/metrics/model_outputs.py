"""Reading each task's labels, predictions and weights out of a model's output dict.

A task (:class:`~embshard_dist.metrics.metrics_config.RecTaskInfo`) names the keys of its
tensors. A missing key, a value that is not a tensor, or tensors without one value per sample
(any shapes with equal element counts, e.g. ``[B, 1]`` predictions and ``[B]`` labels) raise
``ValueError`` naming the task, the keys and what the dict holds, before anything is updated. A
task whose three tensors are all empty is left out of that batch, as TorchRec does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embshard_dist.metrics.metrics_config import RecTaskInfo

TaskOutputs = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""Labels, predictions and weights, each a dict task name -> tensor."""


def _tensor(model_out: Mapping[str, Any], key: str, task: RecTaskInfo, what: str) -> torch.Tensor:
    if key not in model_out:
        raise ValueError(
            f"task {task.name!r}: model_out has no {what} {key!r} (RecTaskInfo.{what}_name); "
            f"its keys are {sorted(map(str, model_out))}"
        )
    value = model_out[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"task {task.name!r}: model_out[{key!r}] ({what}) must be a tensor, got "
            f"{type(value).__name__}"
        )
    return value


def read_task_outputs(tasks: Sequence[RecTaskInfo], model_out: Mapping[str, Any]) -> TaskOutputs:
    """Each task's labels, predictions and weights (unit weights where ``weight_name`` is empty).

    Raises:
        ValueError: see the module doc.
    """
    labels: dict[str, torch.Tensor] = {}
    predictions: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for task in tasks:
        y = _tensor(model_out, task.label_name, task, "label")
        p = _tensor(model_out, task.prediction_name, task, "prediction")
        w = (
            _tensor(model_out, task.weight_name, task, "weight")
            if task.weight_name
            else torch.ones(p.shape, dtype=torch.float32, device=p.device)
        )
        if not p.numel() == y.numel() == w.numel():
            shapes = [
                f"model_out[{task.prediction_name!r}] {tuple(p.shape)}",
                f"model_out[{task.label_name!r}] {tuple(y.shape)}",
            ]
            if task.weight_name:
                shapes.append(f"model_out[{task.weight_name!r}] {tuple(w.shape)}")
            raise ValueError(
                f"task {task.name!r}: {', '.join(shapes)} must hold one value per sample "
                "(the same number of elements)"
            )
        if p.numel() == 0:
            continue
        labels[task.name], predictions[task.name], weights[task.name] = y, p, w
    return labels, predictions, weights
