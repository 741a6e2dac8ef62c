"""``StagedTrainPipeline``: gradient-free stages of the next batches run before this batch's step.

TorchRec's staged pipeline. With ``n`` stages, ``n`` batches are in flight: each
:meth:`~StagedTrainPipeline.progress` call takes the output of the last stage for the oldest
batch, then runs stage 0 on a new batch from the iterator, stage 1 on the batch after the
oldest's successor, ..., stage ``n-1`` on the next batch, and returns that output; the training
loop runs the model's forward, backward and optimizer step on it::

    while (batch := pipeline.progress(dataloader_iter)) is not None:
        loss, out = model(batch); loss.backward(); optimizer.step()

Each batch goes through the stages in order, each stage sees the batches in order, and every
stage's output is exactly what its runnable returned, so the loop sees what running the stages
one after another on each batch would give. On CUDA a stage runs on its stream, after the
previous stage's work for that batch (an event) and the batch's tensors are recorded on it; the
returned batch is made ready on the compute stream the same way. Elsewhere the stages run inline.

The first ``progress`` fills the pipeline (stage ``k`` runs for batches ``0..n-1-k``, with each
stage's ``fill_callback``). Once the iterator ends, ``progress`` returns ``None``, on every later
call with that iterator; a stage without a batch calls its ``data_exhausted_callback`` instead of
its runnable. :meth:`~StagedTrainPipeline.set_flush` stops taking batches; once the batches in
flight are out, ``on_flush_end`` is called and the pipeline fills again from the iterator.
With :class:`~embshard_dist.train_pipeline.pipeline_stage.SparseDataDistUtil`'s stage last, the
results are the plain loop's, bit for bit on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import record_function

from embshard_dist.train_pipeline.interface import In, Out, TrainPipeline
from embshard_dist.train_pipeline.pipeline_stage import (
    PipelineStage,
    RunnableType,
    SparseDataDistUtil,
    StageOut,
    StageOutputWithEvent,
    cuda_stream,
)
from embshard_dist.train_pipeline.streams import record_stream

__all__ = [
    "In",
    "Out",
    "PipelineStage",
    "RunnableType",
    "SparseDataDistUtil",
    "StageOut",
    "StageOutputWithEvent",
    "StagedTrainPipeline",
]

logger = logging.getLogger(__name__)


class StagedTrainPipeline(TrainPipeline[In, StageOut | None]):
    """Runs ``pipeline_stages`` on the batches ahead of the one the training loop steps on; see
    the module docstring for the schedule and what is guaranteed.

    Args:
        pipeline_stages: the stages, in the order each batch goes through them (at least one).
        debug_mode: log each stage's run for each batch (``logging.INFO``).
        compute_stream: the CUDA stream the model's forward runs on, where ``progress`` makes
            its output ready; default: the current stream, when the first stage's stream is a
            CUDA stream (off CUDA there is none).
        on_flush_end: called once a flush has emptied the pipeline.

    Raises:
        ValueError: no stage.
    """

    def __init__(
        self,
        pipeline_stages: list[PipelineStage],
        debug_mode: bool = False,
        compute_stream: torch.Stream | None = None,
        on_flush_end: Callable[[], None] | None = None,
    ) -> None:
        if not pipeline_stages:
            raise ValueError("StagedTrainPipeline: pipeline_stages is empty; give it a stage")
        self._pipeline_stages = list(pipeline_stages)
        self._debug_mode = debug_mode
        self._stage_outputs: list[StageOutputWithEvent | None] = [None] * len(pipeline_stages)
        self._initialized = False
        self._num_steps = 0
        self._dataloader_iter: Iterator[In] | None = None
        self._dataloader_exhausted = False
        self._compute_stream = compute_stream
        first = cuda_stream(pipeline_stages[0].stream)
        if compute_stream is None and first is not None:
            self._compute_stream = torch.cuda.current_stream(first.device)
        self._flushing = False
        self.on_flush_end = on_flush_end

    @property
    def num_stages(self) -> int:
        """The number of stages (and of batches in flight)."""
        return len(self._pipeline_stages)

    def progress(self, dataloader_iter: Iterator[In]) -> StageOut | None:
        """The last stage's output for the oldest batch in flight, after running every stage
        once on the batches behind it (stage 0 on a new batch from ``dataloader_iter``).

        Returns ``None`` once ``dataloader_iter`` has ended and its batches are out (again on
        every later call with it). A new iterator after that, or the end of a flush, fills the
        pipeline again from the iterator.
        """
        if not self._initialized or self._restarts_with(dataloader_iter):
            self._fill_pipeline(dataloader_iter)
        oldest = self._advance()
        if oldest is None:
            return None
        self._num_steps += 1
        self._log(f"Starting pipeline step {self._num_steps}")
        for stage_idx in range(self.num_stages):
            self._run_stage(self.num_stages - 1 - stage_idx, stage_idx, dataloader_iter)
        out = self._ready_for_compute(oldest)
        if out is None and self._flushing:
            self.flush_end()
            return self.progress(dataloader_iter)
        self._log(f"Finished pipeline step {self._num_steps}")
        return out

    def set_flush(self, flush: bool) -> None:
        """While ``flush`` is set, take no new batch: ``progress`` returns the batches in
        flight, then calls :meth:`flush_end` and fills the pipeline again."""
        self._flushing = flush

    def flush_end(self) -> None:
        """End a flush: clear the flag, refill on the next ``progress``, call ``on_flush_end``."""
        self.set_flush(False)
        self._initialized = False
        if self.on_flush_end is not None:
            self.on_flush_end()

    def _restarts_with(self, dataloader_iter: Iterator[In]) -> bool:
        """Whether ``dataloader_iter`` is a new iterator and no batch is left in flight (the
        previous one ended): then the pipeline fills from it rather than returning ``None``
        while its first batches go through the stages."""
        if dataloader_iter is self._dataloader_iter:
            return False
        return all(slot is None or slot[0] is None for slot in self._stage_outputs)

    def _fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        """Put ``num_stages`` batches in flight: batch ``b`` through stages ``0..n-1-b``."""
        for batch_offset in range(self.num_stages):
            for stage_idx in range(self.num_stages - batch_offset):
                self._run_stage(batch_offset, stage_idx, dataloader_iter, fill=True)
        self._initialized = True
        self._log("Finished fill pipeline")

    def _advance(self) -> StageOutputWithEvent | None:
        """Take the oldest batch's output and move every other one slot closer."""
        oldest = self._stage_outputs[0]
        self._stage_outputs = [*self._stage_outputs[1:], None]
        return oldest

    def _next_batch(self, dataloader_iter: Iterator[In]) -> In | None:
        """The iterator's next batch; ``None`` once it ended (never asked again: a finished
        loader may hang) or while flushing."""
        if dataloader_iter is not self._dataloader_iter:
            self._dataloader_iter = dataloader_iter
            self._dataloader_exhausted = False
        if self._dataloader_exhausted or self._flushing:
            return None
        with record_function("## next_batch ##"):
            batch = next(dataloader_iter, None)
        if batch is None:
            self._dataloader_exhausted = True
        return batch

    def _run_stage(
        self, batch_offset: int, stage_idx: int, dataloader_iter: Iterator[In], fill: bool = False
    ) -> StageOutputWithEvent:
        """Run stage ``stage_idx`` on the batch in slot ``batch_offset`` (stage 0: a new batch)
        and keep its output there; a stage without a batch calls its data-exhausted callback."""
        stage = self._pipeline_stages[stage_idx]
        label = f"Pipeline Stage {stage_idx} : {stage.name} for batch "
        label += str(batch_offset + self._num_steps)
        with record_function(f"## {label} ##"):
            if stage_idx == 0:
                item: Any = self._next_batch(dataloader_iter)
                event: torch.Event | None = None
            else:
                previous = self._stage_outputs[batch_offset]
                assert previous is not None, f"{label}: the previous stage did not run"
                item, event = previous
            if item is not None:
                self._log(f"Executing ## {label} ##")
                result = self._run_with_event(stage.runnable, event, item, stage.stream)
            else:
                self._log(f"Skipping due to None ## {label} ##")
                result = (None, None)
                if stage.data_exhausted_callback is not None:
                    stage.data_exhausted_callback()
        self._stage_outputs[batch_offset] = result
        if fill and stage.fill_callback is not None:
            stage.fill_callback()
        return result

    @staticmethod
    def _run_with_event(
        runnable: RunnableType, event: torch.Event | None, item: Any, stream: torch.Stream | None
    ) -> StageOutputWithEvent:
        """``runnable(item)`` on ``stream`` (CUDA: after ``event``, ``item`` recorded on it, an
        event recorded after it); inline with no event when no CUDA stream is involved."""
        target = cuda_stream(stream)
        if target is None and event is None:
            return runnable(item), None
        if target is None:
            target = torch.cuda.current_stream()
        with torch.cuda.stream(target):
            if event is not None:
                event.wait(target)
                record_stream(item, target)
            output = runnable(item)
            done = torch.cuda.Event()
            done.record(target)
        return output, done

    def _ready_for_compute(self, oldest: StageOutputWithEvent) -> Any:
        """The oldest batch's output, its last stage waited for on the compute stream."""
        out, event = oldest
        if event is not None:
            compute = cuda_stream(self._compute_stream) or torch.cuda.current_stream()
            event.wait(compute)
            record_stream(out, compute)
        return out

    def _log(self, message: str) -> None:
        if self._debug_mode:
            logger.info(message)
