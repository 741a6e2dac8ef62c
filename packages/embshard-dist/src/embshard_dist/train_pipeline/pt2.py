"""``TrainPipelinePT2``: the plain loop with the model compiled by ``torch.compile`` on one step.

TorchRec's pipeline and :class:`TorchCompileConfig` of those names. Each
:meth:`~TrainPipelinePT2.progress` call takes the next batch, copies it to the device, applies
``input_transformer``, and runs forward, backward and optimizer step (forward only in eval mode)
on one stream. On step ``compile_on_iter`` (counted from 0) the model is compiled in place
(``nn.Module.compile``) between ``pre_compile_fn`` and ``post_compile_fn``; the steps before run
eagerly, so they can be profiled. embshard's sharded modules compile with graph breaks at their
collectives only; dynamo's global settings are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.interface import In, Out, TrainPipeline, total_loss

__all__ = ["TorchCompileConfig", "TrainPipelinePT2"]


@dataclass(frozen=True)
class TorchCompileConfig:
    """How :class:`TrainPipelinePT2` compiles the model.

    Attributes:
        fullgraph: compile the forward as one graph (fails at a graph break; embshard's sharded
            modules break at their collectives, so leave it ``False`` for a sharded model).
        dynamic: dynamic shapes (``None``: dynamo's automatic choice).
        backend: the ``torch.compile`` backend.
        compile_on_iter: the step (from 0) whose forward is the first compiled one.
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    compile_on_iter: int = 3

    def __post_init__(self) -> None:
        step = self.compile_on_iter
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"TorchCompileConfig: compile_on_iter must be an int >= 0, got {step!r}"
            )


class TrainPipelinePT2(TrainPipeline[In, Out]):
    """The plain loop, the model compiled from step ``compile_configs.compile_on_iter`` on.

    Args:
        model: ``forward(batch)`` returns ``(loss, output)``.
        optimizer: zeroed before and stepped after each backward.
        device: where batches are copied and the step runs.
        compile_configs: how and when to compile (default :class:`TorchCompileConfig`).
        pre_compile_fn, post_compile_fn: called with the model just before and after compiling.
        input_transformer: applied to each batch on the device before the forward.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        compile_configs: TorchCompileConfig | None = None,
        pre_compile_fn: Callable[[nn.Module], None] | None = None,
        post_compile_fn: Callable[[nn.Module], None] | None = None,
        input_transformer: Callable[[In], In] | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._config = compile_configs or TorchCompileConfig()
        self._pre_compile_fn = pre_compile_fn
        self._post_compile_fn = post_compile_fn
        self._input_transformer = input_transformer
        self._iter = 0

    @property
    def compiled(self) -> bool:
        """Whether the model has been compiled (from step ``compile_on_iter`` on)."""
        return self._iter > self._config.compile_on_iter

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Run one step on the iterator's next batch and return its output.

        Raises:
            StopIteration: the iterator has ended.
        """
        batch: In = move_batch(next(dataloader_iter), self._device)
        if self._input_transformer is not None:
            batch = self._input_transformer(batch)
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        if self._iter == self._config.compile_on_iter:
            self._compile()
        losses, output = self._model(batch)
        self._iter += 1
        if training:
            total_loss(losses).backward()
            self._optimizer.step()
        return output

    def _compile(self) -> None:
        config = self._config
        if self._pre_compile_fn is not None:
            self._pre_compile_fn(self._model)
        self._model.compile(
            fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend
        )
        if self._post_compile_fn is not None:
            self._post_compile_fn(self._model)
