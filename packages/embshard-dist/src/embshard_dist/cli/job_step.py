"""One training step of ``embshard train``, pipelined or plain.

``--pipeline sparse-dist`` runs :class:`~embshard_dist.train_pipeline.TrainPipelineSparseDist`
(batch ``i+1``'s input dist in flight while batch ``i`` trains); ``--pipeline none`` runs the
plain loop ``zero_grad; loss = forward(batch); backward; step``. Both expose
``progress(batches)`` and give the same results bit for bit (the pipeline's contract).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from embshard_dist.cli.job_data import JobBatch
from embshard_dist.train_pipeline import TrainPipelineSparseDist, move_batch

__all__ = ["PIPELINES", "ClickForward", "PlainLoop", "Stepper", "make_stepper"]

PIPELINES = ("sparse-dist", "none")

StepOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(loss, logits, labels)``, detached."""


class ClickForward:
    """``batch -> (loss, (loss, logits, labels))`` of a model ``(dense, sparse) -> logits``.

    The loss is binary cross-entropy on the logits, as ``DLRMTrain``'s.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def __call__(self, batch: JobBatch) -> tuple[torch.Tensor, StepOutput]:
        logits = self.model(batch.dense_features, batch.sparse_features)
        labels = batch.labels.float()
        loss: torch.Tensor = self.loss_fn(logits, labels)
        return loss, (loss.detach(), logits.detach(), labels.detach())


class Stepper(Protocol):
    """Runs one training step on the next batch and returns its output."""

    def progress(self, dataloader_iter: Iterator[Any]) -> StepOutput: ...


class PlainLoop:
    """The unpipelined step: ``zero_grad``, forward, backward, optimizer step."""

    def __init__(
        self, forward: ClickForward, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> None:
        self._forward = forward
        self._optimizer = optimizer
        self._device = device

    def progress(self, dataloader_iter: Iterator[Any]) -> StepOutput:
        batch = move_batch(next(dataloader_iter), self._device)
        self._optimizer.zero_grad()
        loss, output = self._forward(batch)
        loss.backward()
        self._optimizer.step()
        return output


def make_stepper(
    kind: str,
    model: nn.Module,
    forward: ClickForward,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> Stepper:
    """The stepper for ``--pipeline kind`` over ``model`` (a ``DistributedModelParallel``).

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "none":
        return PlainLoop(forward, optimizer, device)
    if kind == "sparse-dist":
        return TrainPipelineSparseDist(model, optimizer, device, custom_model_fwd=forward)
    raise ValueError(f"--pipeline {kind!r}: expected one of {', '.join(PIPELINES)}")
