"""One training step of ``embshard train``, pipelined or plain.

``--pipeline sparse-dist`` runs :class:`~embshard_dist.train_pipeline.TrainPipelineSparseDist`
(batch ``i+1``'s input dist in flight while batch ``i`` trains); ``--pipeline none`` runs the
plain loop ``zero_grad; loss = forward(batch); backward; step``. Both expose
``progress(batches)`` and give the same results bit for bit (the pipeline's contract).
``--accumulate-grad-batches K`` makes both step once every ``K`` batches (the loss of each
divided by ``K``, the first ``K - 1`` under ``no_sync``; see ``TrainPipelineSparseDist``); a
``progress`` call still runs one batch, so steps, ETA and throughput count batches.
``--pipeline semi-sync`` runs :class:`~embshard_dist.train_pipeline.TrainPipelineSemiSync`
(one step stale from its start batch on; one step per batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from embshard_dist.cli.job_data import JobBatch
from embshard_dist.dmp.accumulation import check_accumulate_grad_batches, no_sync
from embshard_dist.train_pipeline import TrainPipelineSemiSync, TrainPipelineSparseDist, move_batch

__all__ = ["PIPELINES", "ClickForward", "PlainLoop", "Stepper", "make_stepper"]

PIPELINES = ("sparse-dist", "semi-sync", "none")

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
    """The unpipelined step: ``zero_grad``, forward, backward, optimizer step.

    With ``accumulate_grad_batches`` ``k > 1``: ``zero_grad`` before the first batch of each
    step, every loss divided by ``k``, the first ``k - 1`` batches under ``no_sync(model)``, and
    the step after the ``k``-th batch or the last one (it reads one batch ahead to know).
    """

    def __init__(
        self,
        forward: ClickForward,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        model: nn.Module | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        self._forward = forward
        self._optimizer = optimizer
        self._device = device
        self._model = model if model is not None else forward.model
        self._accumulate = check_accumulate_grad_batches(accumulate_grad_batches, "PlainLoop")
        self._micro_batch = 0
        self._ahead: list[Any] = []

    def progress(self, dataloader_iter: Iterator[Any]) -> StepOutput:
        if self._accumulate == 1:
            batch = move_batch(next(dataloader_iter), self._device)
            self._optimizer.zero_grad()
            loss, output = self._forward(batch)
            loss.backward()
            self._optimizer.step()
            return output
        batch = move_batch(
            self._ahead.pop() if self._ahead else next(dataloader_iter), self._device
        )
        last = self._micro_batch + 1 == self._accumulate or not self._peek(dataloader_iter)
        if self._micro_batch == 0:
            self._optimizer.zero_grad()
        with nullcontext() if last else no_sync(self._model):
            loss, output = self._forward(batch)
            (loss / self._accumulate).backward()
        if last:
            self._optimizer.step()
        self._micro_batch = 0 if last else self._micro_batch + 1
        return output

    def _peek(self, dataloader_iter: Iterator[Any]) -> bool:
        """Read the next batch ahead; ``False`` when there is none."""
        try:
            self._ahead.append(next(dataloader_iter))
        except StopIteration:
            return False
        return True


def make_stepper(
    kind: str,
    model: nn.Module,
    forward: ClickForward,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    accumulate_grad_batches: int = 1,
    semi_sync_start_batch: int = 900,
) -> Stepper:
    """The stepper for ``--pipeline kind`` over ``model`` (a ``DistributedModelParallel``),
    stepping the optimizer once every ``accumulate_grad_batches`` batches; ``semi-sync``
    trains semi-synchronously from its ``semi_sync_start_batch``-th batch on.

    Raises:
        ValueError: an unknown kind, ``accumulate_grad_batches`` not an int >= 1, or above 1
            with ``semi-sync``.
    """
    if kind == "none":
        return PlainLoop(
            forward,
            optimizer,
            device,
            model=model,
            accumulate_grad_batches=accumulate_grad_batches,
        )
    if kind == "sparse-dist":
        return TrainPipelineSparseDist(
            model,
            optimizer,
            device,
            custom_model_fwd=forward,
            accumulate_grad_batches=accumulate_grad_batches,
        )
    if kind == "semi-sync":
        if accumulate_grad_batches != 1:
            raise ValueError(
                "--pipeline semi-sync steps once per batch: accumulate_grad_batches must be 1, "
                f"got {accumulate_grad_batches!r}"
            )
        return TrainPipelineSemiSync(
            model,
            optimizer,
            device,
            start_batch=semi_sync_start_batch,
            custom_model_fwd=forward,
        )
    raise ValueError(f"--pipeline {kind!r}: expected one of {', '.join(PIPELINES)}")
