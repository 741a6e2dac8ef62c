"""``TrainPipelineBase``: the plain training loop behind TorchRec's pipeline interface.

Each :meth:`~TrainPipelineBase.progress` call takes the next batch while the current one runs
(on CUDA its copy to the device runs on a side stream), then runs the current batch's forward,
backward and optimizer step (forward only when the model is in eval mode) and returns its
output. Nothing else overlaps, so it is exactly ``loss, out = model(batch); loss.backward();
optimizer.step()`` and works with any model, sharded or not: the baseline to measure
``TrainPipelineSparseDist`` against, and the pipeline for models with nothing to distribute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.train_pipeline.interface import (
    In,
    Out,
    TrainPipeline,
    next_on_device,
    total_loss,
)
from embshard_dist.train_pipeline.streams import SideStreams, hand_over

__all__ = ["TrainPipelineBase"]


class TrainPipelineBase(TrainPipeline[In, Out]):
    """The plain loop, with the next batch's copy to the device overlapped (on CUDA).

    Args:
        model: ``forward(batch)`` returns ``(loss, output)``, as ``DLRMTrain``'s does.
        optimizer: zeroed before and stepped after each backward.
        device: where batches are copied and the step runs.
        custom_model_fwd: ``batch -> (loss, output)`` to call instead of ``model``.
        enable_inplace_copy_batch: TorchRec's memory hint; batches are copied to fresh
            tensors here, with the same results.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        enable_inplace_copy_batch: bool = False,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._model_fwd: Callable[[In], tuple[Tensor, Out]] = custom_model_fwd or model
        self._copy = SideStreams.for_device(self._device).copy
        self._batches: deque[Any] = deque()
        self._exhausted = False

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Run one step on the oldest batch taken and return its output.

        Raises:
            StopIteration: every batch of the iterator has been run.
        """
        if not self._batches:
            self._exhausted = False
            self._enqueue(dataloader_iter)
        if not self._batches:
            raise StopIteration
        self._enqueue(dataloader_iter)
        batch = self._batches.popleft()
        hand_over(batch, self._copy)
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        losses, output = self._model_fwd(batch)
        if training:
            total_loss(losses).backward()
            self._optimizer.step()
        return output

    def _enqueue(self, dataloader_iter: Iterator[In]) -> None:
        """Take the next batch and start its copy to the device (nothing at the end)."""
        if self._exhausted:
            return
        moved = next_on_device(dataloader_iter, self._device, self._copy)
        if moved is None:
            self._exhausted = True
        else:
            self._batches.append(moved)
