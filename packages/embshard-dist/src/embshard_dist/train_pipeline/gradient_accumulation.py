"""TorchRec's ``GradientAccumulationWrapper``: any train pipeline, one optimizer step per cycle.

``GradientAccumulationWrapper(pipeline, optimizer, model, config)`` with TorchRec's
``GradientAccumulationConfig(is_enabled, num_steps, num_warmup_steps)``: each ``progress`` runs
one micro-batch through ``pipeline``; the optimizer's ``zero_grad`` runs at the start of a cycle
of ``num_steps`` micro-batches only, and its ``step`` at the end. Unlike TorchRec's wrapper, whose
fused embedding optimizers still update at every micro-batch, the fused tables accumulate too:
every micro-batch but the last of a cycle runs under
:func:`~embshard_kernels.accumulate.defer_sparse_updates`, so a cycle is one step on the summed
gradient of its micro-batches (their losses are summed, not averaged, as in TorchRec's). DDP
synchronizes as in TorchRec's wrapper: on the first ``num_warmup_steps`` micro-batches and at the
end of each cycle; otherwise under ``no_sync``. When the data ends inside a cycle, the
``StopIteration`` first completes it: the kept sparse gradients applied, the dense gradients
averaged over the ranks, the optimizer stepped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Generic

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from embshard_dist.comm.collectives import all_reduce
from embshard_dist.dmp.accumulation import data_parallel_modules
from embshard_dist.train_pipeline.interface import In, Out, TrainPipeline
from embshard_dist.train_pipeline.semi_sync import TrainPipelineSemiSync
from embshard_kernels.accumulate import defer_sparse_updates, grad_accumulations

__all__ = ["GradientAccumulationConfig", "GradientAccumulationWrapper"]

_OWNER = "GradientAccumulationWrapper"


@dataclass
class GradientAccumulationConfig:
    """TorchRec's gradient accumulation settings.

    Attributes:
        is_enabled: accumulate (turned on by ``num_steps > 1``).
        num_steps: micro-batches per optimizer step.
        num_warmup_steps: the first micro-batches, which always synchronize DDP (at least 1).

    Raises:
        ValueError: ``num_steps`` or ``num_warmup_steps`` below 1.
    """

    is_enabled: bool = False
    num_steps: int = 1
    num_warmup_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("num_steps", "num_warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"GradientAccumulationConfig: {name} must be an int >= 1, got {value!r}"
                )
        if self.num_steps > 1:
            self.is_enabled = True


class _CycleOptimizer:
    """Stands in for the pipeline's optimizer: ``zero_grad`` at a cycle's start, ``step`` at
    its end; everything else is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, num_steps: int) -> None:
        self._optimizer = optimizer
        self._num_steps = num_steps
        self.current_step = 0
        self.needs_zero_grad = True

    def closes_cycle(self) -> bool:
        return (self.current_step + 1) % self._num_steps == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.needs_zero_grad:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            self.needs_zero_grad = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.closes_cycle():
            self._optimizer.step(*args, **kwargs)
            self.needs_zero_grad = True

    def step_now(self) -> None:
        """Step and zero the gradients now, whatever the cycle (to complete a short one)."""
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.needs_zero_grad = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class GradientAccumulationWrapper(Generic[In, Out]):
    """Runs ``pipeline`` one micro-batch per ``progress``, one optimizer step per cycle (see the
    module docstring).

    Args:
        pipeline: a ``TrainPipelineSparseDist``, ``TrainPipelineBase`` or any pipeline whose
            ``progress`` runs one batch's forward and backward and calls its ``_optimizer``.
        optimizer: the pipeline's optimizer.
        model: the model the pipeline trains (its fused tables and DDP modules accumulate).
        config: the settings; when not enabled, ``progress`` is the pipeline's own.

    Raises:
        ValueError: a semi-synchronous pipeline (its next batch's lookup runs inside this
            batch's step, so a cycle's boundary cannot be kept), or a pipeline that already
            accumulates (``accumulate_grad_batches > 1``).
    """

    def __init__(
        self,
        pipeline: TrainPipeline[In, Out],
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        config: GradientAccumulationConfig,
    ) -> None:
        if isinstance(pipeline, TrainPipelineSemiSync):
            raise ValueError(
                f"{_OWNER}: TrainPipelineSemiSync looks up the next batch inside this batch's "
                "step, so a cycle of micro-batches cannot be kept apart; wrap "
                "TrainPipelineSparseDist or TrainPipelineBase"
            )
        accumulate = getattr(pipeline, "_accumulate", 1)
        if accumulate != 1:
            raise ValueError(
                f"{_OWNER}: the pipeline already accumulates (accumulate_grad_batches="
                f"{accumulate}); accumulate in one place: build it with "
                "accumulate_grad_batches=1, or drop the wrapper"
            )
        self._pipeline = pipeline
        self._model = model
        self._config = config
        self._optimizer = _CycleOptimizer(optimizer, config.num_steps)
        self._unsynced = False  # a micro-batch of this cycle skipped DDP's all-reduce
        if config.is_enabled and hasattr(pipeline, "_optimizer"):
            pipeline._optimizer = self._optimizer

    @property
    def current_step(self) -> int:
        """Micro-batches run so far."""
        return self._optimizer.current_step

    def set_step(self, step: int) -> None:
        """Continue counting micro-batches from ``step`` (e.g. after a restore)."""
        self._optimizer.current_step = step

    def reset(self) -> None:
        """Start counting afresh (the next micro-batch opens a cycle)."""
        self._optimizer.current_step = 0
        self._optimizer.needs_zero_grad = True
        self._unsynced = False

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: bool | None = None) -> Out:
        """Run one micro-batch; ``is_last_batch`` closes the cycle after it.

        Raises:
            StopIteration: the data has ended (after completing the open cycle, if any).
        """
        if not self._config.is_enabled:
            return self._pipeline.progress(dataloader_iter)
        closes = bool(is_last_batch) or self._optimizer.closes_cycle()
        syncs = closes or self.current_step < self._config.num_warmup_steps
        with ExitStack() as stack:
            if not closes:
                stack.enter_context(defer_sparse_updates(self._model))
            if not syncs:
                for ddp in data_parallel_modules(self._model):
                    stack.enter_context(ddp.no_sync())
            try:
                output = self._pipeline.progress(dataloader_iter)
            except StopIteration:
                stack.close()
                self._complete_cycle()
                raise
        if closes:
            self._unsynced = False
        elif not syncs:
            self._unsynced = True
        self._optimizer.current_step += 1
        if is_last_batch:
            self._complete_cycle()
        return output

    def _complete_cycle(self) -> None:
        """Apply what the open cycle accumulated (nothing when it is closed); the next
        micro-batch opens a full cycle."""
        k = self._config.num_steps
        if self.current_step % k == 0:
            return
        for accumulation in grad_accumulations(self._model):
            accumulation.apply()
        if self._unsynced:
            for ddp in data_parallel_modules(self._model):
                _average_gradients(ddp)
        self._optimizer.step_now()
        self._unsynced = False
        self._optimizer.current_step += k - self.current_step % k

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)


def _average_gradients(ddp: DistributedDataParallel) -> None:
    """DDP's all-reduce (the mean over its group) of the gradients it manages, by hand,
    through embshard's collectives (bounded by the collective timeout)."""
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    group = ddp.process_group
    world = dist.get_world_size(group)
    for name, param in ddp.module.named_parameters():
        if param.grad is None or not param.requires_grad or name in ignored:
            continue
        all_reduce(param.grad, group=group, name=f"gradient_accumulation.{name}")
        param.grad.div_(world)
