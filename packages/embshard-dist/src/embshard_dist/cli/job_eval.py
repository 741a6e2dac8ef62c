"""Click metrics of ``embshard train`` (NE, AUC, calibration, accuracy, loss) and evaluation.

:class:`ClickMetrics` updates TorchRec-named metrics with a batch's logits and labels and
computes them reduced across ranks (a collective: every rank calls it together).
:func:`evaluate` runs the model on held-out batches without updating it: ``model.eval()``, no
autograd, no backward, no optimizer step; the model's training mode is restored afterwards.
Given an ``EvalPipelineSparseDist``, the next batch's input dist is in flight while a batch
runs forward (``embshard train --pipeline sparse-dist``); the metrics are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from embshard_dist.metrics import AccuracyMetric, AUCMetric, CalibrationMetric, NEMetric
from embshard_dist.metrics.reduce import sum_over_ranks
from embshard_dist.train_pipeline import EvalPipelineSparseDist

__all__ = ["ClickMetrics", "evaluate"]

Forward = Callable[[Any], tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
"""``batch -> (loss, (loss, logits, labels))``, as ``DLRMTrain``'s forward."""


class ClickMetrics:
    """NE, AUC, calibration, accuracy and mean log loss of the batches seen since ``reset``."""

    NAMES = ("ne", "auc", "calibration", "accuracy", "loss")

    def __init__(self) -> None:
        self._metrics = (NEMetric(), AUCMetric(), CalibrationMetric(), AccuracyMetric())
        self.reset()

    def reset(self) -> None:
        for m in self._metrics:
            m.reset()
        self._loss = torch.zeros(2, dtype=torch.float64)  # loss sum, samples

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: logits (before the sigmoid) and 0 / 1 labels, any device."""
        logits, labels = logits.detach().float().cpu(), labels.detach().float().cpu()
        preds = torch.sigmoid(logits)
        for m in self._metrics:
            m.update(preds, labels)
        bce = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self._loss += torch.tensor([float(bce), labels.numel()], dtype=torch.float64)

    def compute(self) -> dict[str, float]:
        """The metrics of every rank's batches since ``reset`` (a collective)."""
        out: dict[str, float] = {}
        for m in self._metrics:
            values = m.compute()
            out[m.metric_name] = float(
                values[f"{m.namespace}-DefaultTask|lifetime_{m.metric_name}"]
            )
        total = sum_over_ranks(self._loss, None, "train.eval_loss")
        out["loss"] = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        return out


def evaluate(
    model: nn.Module,
    forward: Forward,
    batches: Iterable[Any],
    pipeline: EvalPipelineSparseDist[Any, Any] | None = None,
) -> dict[str, float]:
    """The click metrics of ``model`` on ``batches``, reduced across ranks; ``model`` unchanged.

    Every rank must pass the same number of batches (the model's collectives run per batch).
    ``pipeline`` (built over ``model`` with ``custom_model_fwd=forward``) runs the forwards
    with the next batch's input dist in flight; ``None``: one plain forward after another.
    """
    metrics = ClickMetrics()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _, logits, labels in _outputs(forward, batches, pipeline):
                metrics.update(logits, labels)
    finally:
        model.train(was_training)
    return metrics.compute()


def _outputs(
    forward: Forward, batches: Iterable[Any], pipeline: EvalPipelineSparseDist[Any, Any] | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(loss, logits, labels)`` of each batch, in order."""
    if pipeline is None:
        yield from (forward(batch)[1] for batch in batches)
        return
    iterator = iter(batches)
    while True:
        try:
            yield pipeline.progress(iterator)
        except StopIteration:
            return
