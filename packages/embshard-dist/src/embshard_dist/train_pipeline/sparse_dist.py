"""``TrainPipelineSparseDist``: the next batch's input dist runs while this batch trains.

Each :meth:`~TrainPipelineSparseDist.progress` call, for the batch ``i`` whose input dist is
done: start batch ``i+1``'s input dist (phase 1), take and copy batch ``i+2``, run batch ``i``'s
forward (its sharded modules use their prepared inputs), start batch ``i+1``'s phase 2, then
backward and optimizer step. Every rank issues the same collectives in the same order, and an
input dist reads ids only, never weights, so the results are those of the plain loop
``loss, out = model(batch); loss.backward(); optimizer.step()``, bit for bit. On CUDA the copy
and the input dist run on side streams; on the CPU the collectives are simply in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.dmp.accumulation import check_accumulate_grad_batches, no_sync
from embshard_dist.train_pipeline.interface import (
    In,
    Out,
    TrainPipeline,
    next_on_device,
    total_loss,
)
from embshard_dist.train_pipeline.pipelined_forward import (
    PipelinedForward,
    PreparedInput,
    serving,
    start_input_dist,
)
from embshard_dist.train_pipeline.sparse_inputs import (
    AnyShardedModule,
    SparseInputs,
    SparseOf,
    find_sharded_modules,
)
from embshard_dist.train_pipeline.streams import SideStreams, hand_over, on_stream
from embshard_types.awaitables import LazyAwaitable

__all__ = ["EvalPipelineSparseDist", "TrainPipelineSparseDist"]


@dataclass
class _InFlight:
    """A batch on the device (the ``index``-th the pipeline took), its modules' input dists
    once started, and (semi-synchronous pipeline) their lookups once started and the
    embeddings its forward took, each as (tensor in the lookup's graph, detached leaf)."""

    batch: Any
    index: int
    inputs: dict[str, PreparedInput] = field(default_factory=dict)
    started: bool = False
    lookups: dict[str, LazyAwaitable[Any]] = field(default_factory=dict)
    embeddings: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class TrainPipelineSparseDist(TrainPipeline[In, Out]):
    """Overlaps the next batch's input dist (and, on CUDA, its copy) with this batch's step.

    A model in eval mode runs forward only (no backward, no optimizer step).

    Args:
        model: a model holding sharded modules (usually a ``DistributedModelParallel``) whose
            ``forward(batch)`` returns ``(loss, output)``, as ``DLRMTrain``'s does.
        optimizer: stepped after each backward (e.g. ``dmp.optimizer()``).
        device: where batches are copied and the step runs.
        execute_all_batches: when the iterator ends, still run the batches already in the
            pipeline (default); ``False``: the first ``progress`` after the iterator ended
            raises ``StopIteration``, dropping the batch whose input dist had started.
        custom_model_fwd: ``batch -> (loss, output)`` to call instead of ``model``.
        sparse_of: which KeyedJaggedTensor of a batch each sharded module reads (default
            ``batch.sparse_features``); see :mod:`~embshard_dist.train_pipeline.sparse_inputs`.
        accumulate_grad_batches: micro-batches (``progress`` calls) per optimizer step. The
            first ``k - 1`` of each step run inside :func:`~embshard_dist.dmp.accumulation.
            no_sync` (the tables keep their row gradients, DDP does not all-reduce); the
            ``k``-th applies the sparse update once on the summed gradient, then
            ``optimizer.step()``; ``zero_grad`` runs before the first. The pipeline divides each
            micro-batch's loss by ``k`` before its backward (Lightning's convention), so a model
            returning the mean loss of its batch gets the step of one batch ``k`` times larger
            with the mean loss. When the batches end inside a step, its last batch completes it
            (its micro-batches are still divided by ``k``).

    Raises:
        ValueError: ``model`` holds no sharded module; ``accumulate_grad_batches`` is not an
            int >= 1.
    """

    _trains = True
    """Whether a model in training mode gets its backward and optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        execute_all_batches: bool = True,
        *,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        sparse_of: SparseOf | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        self._accumulate = check_accumulate_grad_batches(
            accumulate_grad_batches, "TrainPipelineSparseDist"
        )
        self._micro_batch = 0  # micro-batches of the current optimizer step already run
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._execute_all_batches = execute_all_batches
        self._model_fwd: Callable[[In], tuple[Tensor, Out]] = custom_model_fwd or model
        self._sparse_of = sparse_of
        self._streams = SideStreams.for_device(self._device)
        self._modules = self._find(model)
        self._inputs = SparseInputs(self._modules, sparse_of)
        self._batches: deque[_InFlight] = deque()
        self._exhausted = False
        self._taken = 0  # batches taken from iterators so far

    @property
    def pipelined_modules(self) -> dict[str, AnyShardedModule]:
        """The sharded modules found in the model, by path."""
        return dict(self._modules)

    def detach(self) -> nn.Module:
        """The model, as the user built it.

        The pipeline swaps its sharded modules' forwards only during a step, so the model is
        always usable on its own; batches in flight stay for the next :meth:`progress`.
        """
        return self._model

    def attach(self, model: nn.Module | None = None) -> None:
        """Pipeline ``model`` from now on (``None``: keep the current one).

        Raises:
            RuntimeError: batches are in flight for the current model.
        """
        if model is None or model is self._model:
            return
        if self._batches:
            raise RuntimeError(
                f"TrainPipelineSparseDist.attach: {len(self._batches)} batch(es) are in flight "
                "for the current model; run progress() until StopIteration first"
            )
        self._modules = self._find(model)
        self._inputs = SparseInputs(self._modules, self._sparse_of)
        self._model = model
        self._model_fwd = model

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Run one training step on the oldest batch in flight and return its output.

        Raises:
            StopIteration: every batch has been run (or, with ``execute_all_batches=False``,
                the iterator has ended).
        """
        current = self._oldest(dataloader_iter)
        training = self._model.training and self._trains
        if training and self._micro_batch == 0:
            self._optimizer.zero_grad()
        following = self._batches[1] if len(self._batches) > 1 else None
        if following is not None:
            self._start_dist(following)
        self._enqueue(dataloader_iter)
        steps = not training or self._completes_step()
        with self._accumulating(not steps):
            with serving(self._modules, self._stand_ins(current)):
                losses, output = self._model_fwd(current.batch)
            if following is not None:
                self._start_values(following)
            if training:
                loss = total_loss(losses)
                (loss / self._accumulate if self._accumulate > 1 else loss).backward()
        if training and steps:
            self._optimizer.step()
            self._micro_batch = 0
        elif training:
            self._micro_batch += 1
        self._batches.popleft()
        return output

    def _oldest(self, dataloader_iter: Iterator[In]) -> _InFlight:
        """Fill the pipeline and hand its oldest batch to the current stream.

        Raises:
            StopIteration: no batch is left to run.
        """
        self._fill(dataloader_iter)
        if self._exhausted and not self._execute_all_batches:
            self._drop_in_flight()
        if not self._batches:
            raise StopIteration
        current = self._batches[0]
        hand_over(current.batch, self._streams.dist)
        return current

    def _stand_ins(self, flight: _InFlight) -> dict[str, PipelinedForward]:
        """The forwards that run ``flight``'s modules on their prepared inputs."""
        return {
            path: PipelinedForward(path, self._modules[path], prepared, self._streams.dist)
            for path, prepared in flight.inputs.items()
        }

    def _completes_step(self) -> bool:
        """Whether the current batch is the last micro-batch of its optimizer step: the
        ``k``-th, or the last this pipeline will run."""
        if self._micro_batch + 1 >= self._accumulate:
            return True
        last_left = len(self._batches) == 1 or not self._execute_all_batches
        return self._exhausted and last_left

    def _accumulating(self, defer: bool) -> AbstractContextManager[None]:
        """Keep the gradients of this micro-batch for the step's last one (``defer``)."""
        return no_sync(self._model) if defer else nullcontext()

    def _find(self, model: nn.Module) -> dict[str, AnyShardedModule]:
        modules = find_sharded_modules(model)
        if not modules:
            raise ValueError(
                f"TrainPipelineSparseDist: the {type(model).__name__} model holds no sharded "
                "module, so there is no input dist to pipeline; wrap the model in "
                "DistributedModelParallel first (or train it with a plain loop)"
            )
        return modules

    def _fill(self, dataloader_iter: Iterator[In]) -> None:
        """At the start (or after the end of an iterator): batch 0 distributed, batch 1 copied."""
        if self._batches:
            return
        self._exhausted = False
        if not self._enqueue(dataloader_iter):
            return
        self._start_dist(self._batches[0])
        self._start_values(self._batches[0])
        self._enqueue(dataloader_iter)

    def _enqueue(self, dataloader_iter: Iterator[In]) -> bool:
        """Take the next batch and start its copy to the device; ``False`` at the end."""
        if self._exhausted:
            return False
        moved = next_on_device(dataloader_iter, self._device, self._streams.copy)
        if moved is None:
            self._exhausted = True
            return False
        self._batches.append(_InFlight(moved, self._taken))
        self._taken += 1
        return True

    def _start_dist(self, flight: _InFlight) -> None:
        """Phase 1 of every pipelined module's input dist, on the input-dist stream."""
        if flight.started:
            return
        flight.started = True
        dist = self._streams.dist
        with on_stream(dist):
            hand_over(flight.batch, self._streams.copy, dist)
            for path, features in self._inputs(flight.batch).items():
                flight.inputs[path] = start_input_dist(self._modules[path], features)

    def _start_values(self, flight: _InFlight) -> None:
        """Phase 2 of every pipelined module's input dist, on the input-dist stream."""
        with on_stream(self._streams.dist):
            for prepared in flight.inputs.values():
                prepared.start_values()

    def _drop_in_flight(self) -> None:
        """Finish the collectives already started for the batches left, then forget them."""
        with on_stream(self._streams.dist):
            for flight in self._batches:
                for prepared in flight.inputs.values():
                    prepared.start_values().wait()
        self._batches.clear()


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """TorchRec's evaluation pipeline: forward only, in any mode, with the next batch's input
    dist (and, on CUDA, its copy) overlapped. Gradients are recorded or not as the caller's
    grad mode says (wrap the loop in ``torch.no_grad()``); ``optimizer`` is never used."""

    _trains = False
