"""The train-pipeline interface (TorchRec's ``TrainPipeline``) and the steps every pipeline
shares: taking the next batch onto the device, and the loss a step backpropagates."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.streams import on_stream

__all__ = ["In", "Out", "TrainPipeline", "next_on_device", "total_loss"]

In = TypeVar("In")
Out = TypeVar("Out")


class TrainPipeline(abc.ABC, Generic[In, Out]):
    """Runs training steps over the batches of an iterator."""

    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Run one step; ``StopIteration`` once every batch has been run."""


def next_on_device(
    dataloader_iter: Iterator[Any], device: torch.device, copy: torch.cuda.Stream | None
) -> Any | None:
    """The iterator's next batch, its copy to ``device`` started (on ``copy``, non-blocking,
    when given); ``None`` once the iterator has ended (a data loader never yields ``None``)."""
    batch = next(dataloader_iter, None)
    if batch is None:
        return None
    with on_stream(copy):
        return move_batch(batch, device, non_blocking=copy is not None)


def total_loss(losses: Tensor) -> Tensor:
    """The scalar a step backpropagates: the loss, or the sum of per-sample / per-task losses."""
    return losses if losses.dim() == 0 else losses.sum()
