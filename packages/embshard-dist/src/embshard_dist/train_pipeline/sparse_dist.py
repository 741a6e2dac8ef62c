"""``TrainPipelineSparseDist``: the next batch's input dist runs while this batch trains.

Each :meth:`~TrainPipelineSparseDist.progress` call, for the batch ``i`` whose input dist is
done: start batch ``i+1``'s input dist (phase 1), take and copy batch ``i+2``, run batch ``i``'s
forward (its sharded modules use their prepared inputs), start batch ``i+1``'s phase 2, then
backward and optimizer step. Every rank issues the same collectives in the same order, and an
input dist reads ids only, never weights, so the results are those of the plain loop
``loss, out = model(batch); loss.backward(); optimizer.step()``, bit for bit. On CUDA the copy
and the input dist run on side streams; on the CPU the collectives are simply in flight. Unless
``sparse_of`` names them, the first batch runs as the plain loop while the pipeline learns where
each sharded module's input lives in a batch (:mod:`~embshard_dist.train_pipeline.sparse_inputs`).
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
from embshard_dist.train_pipeline.options import PipelineOptions
from embshard_dist.train_pipeline.pipelined_forward import (
    PipelinedForward,
    PreparedInput,
    serving,
    start_input_dists,
    start_values,
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
        apply_jit, context_type, pipeline_postproc, dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward, enable_inplace_copy_batch,
            free_features_storage_early, clear_data_dist_inputs: TorchRec's, in its order; see
            :mod:`~embshard_dist.train_pipeline.options` for what each does here.
        custom_model_fwd: ``batch -> (loss, output)`` to call instead of ``model``.
        sparse_of: which KeyedJaggedTensor of a batch each sharded module reads; default:
            learned from the first batch, which then runs as the plain loop (TorchRec learns it
            by tracing the model); see :mod:`~embshard_dist.train_pipeline.sparse_inputs`.
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
            int >= 1; an option embshard cannot honour (``apply_jit=True``, a
            ``context_type``).
    """

    _trains = True
    """Whether a model in training mode gets its backward and optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Any = None,
        pipeline_postproc: bool = False,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        dmp_collection_sync_interval_batches: int | None = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        sparse_of: SparseOf | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        owner = type(self).__name__
        self._options = PipelineOptions(
            apply_jit,
            context_type,
            pipeline_postproc,
            dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward,
            enable_inplace_copy_batch,
            free_features_storage_early,
            clear_data_dist_inputs,
        ).check(owner)
        self._accumulate = check_accumulate_grad_batches(accumulate_grad_batches, owner)
        if self._accumulate > 1 and enqueue_batch_after_forward:
            raise ValueError(
                f"{owner}: enqueue_batch_after_forward=True with accumulate_grad_batches > 1: "
                "the pipeline must know before a forward whether the data has ended (the last "
                "micro-batch completes the step); pass one of them only"
            )
        self._steps = 0  # optimizer steps taken
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
        self._at_start(current)
        training = self._model.training and self._trains
        if training and self._micro_batch == 0:
            self._optimizer.zero_grad()
        following = self._batches[1] if len(self._batches) > 1 else None
        if following is not None:
            self._start_dist(following)
        after_forward = self._options.enqueue_batch_after_forward
        if not after_forward:
            self._enqueue(dataloader_iter)
        self._before_forward(current)
        steps = not training or self._completes_step()
        with self._accumulating(not steps):
            with serving(self._modules, self._stand_ins(current)), self._learning(current):
                losses, output = self._model_fwd(current.batch)
            if after_forward:
                self._enqueue(dataloader_iter)
            if following is not None:
                self._start_values(following)
            if training:
                loss = total_loss(losses)
                (loss / self._accumulate if self._accumulate > 1 else loss).backward()
        if training and steps:
            self._sync_replicas()
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
        if not current.started:  # no input dist (the first batch, while learning): from the copy
            hand_over(current.batch, self._streams.copy)
        hand_over(current.batch, self._streams.dist)
        return current

    def _sync_replicas(self) -> None:
        """Before an optimizer step: sync a ``DMPCollection``'s replicas every
        ``dmp_collection_sync_interval_batches`` steps (TorchRec's schedule); count the step."""
        if self._options.syncs_replicas(self._model, self._steps):
            self._model.sync()  # type: ignore[operator]
        self._steps += 1

    def _learning(self, flight: _InFlight) -> AbstractContextManager[None]:
        """Around the first batch's forward, unless ``sparse_of`` was given: learn where each
        sharded module's input lives in a batch (that batch runs as the plain loop)."""
        return self._inputs.learning(flight.batch)

    def _at_start(self, current: _InFlight) -> None:
        """A step's first stage, before ``zero_grad`` (nothing here)."""

    def _before_forward(self, current: _InFlight) -> None:
        """A step's stage after the next batch's input dist started, before the forward
        (nothing here)."""

    def _start_lookups(self, flight: _InFlight) -> None:
        """Every pipelined module's lookup and output dist for ``flight``, on the current
        stream, with the tables as they are now (its input dist first if not started)."""
        self._start_values(flight)
        for path, prepared in flight.inputs.items():
            flight.lookups[path] = prepared.lookup(self._modules[path], self._streams.dist)

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
        """Phase 1 of every pipelined module's input dist, on the input-dist stream (once;
        not before the pipeline knows where the inputs are)."""
        if flight.started or not self._inputs.ready:
            return
        flight.started = True
        dist = self._streams.dist
        hand_over(flight.batch, self._streams.copy, dist)
        flight.inputs = start_input_dists(self._modules, self._inputs(flight.batch), dist)

    def _start_values(self, flight: _InFlight) -> None:
        """Phase 2 of every pipelined module's input dist, on the input-dist stream (phase 1
        first if it has not started)."""
        self._start_dist(flight)
        start_values(flight.inputs, self._streams.dist)

    def _drop_in_flight(self) -> None:
        """Finish the collectives already started for the batches left, then forget them."""
        with on_stream(self._streams.dist):
            for flight in self._batches:
                if flight.lookups:
                    for lookup in flight.lookups.values():
                        lookup.wait()
                else:
                    for prepared in flight.inputs.values():
                        prepared.start_values().wait()
        self._batches.clear()


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """TorchRec's evaluation pipeline: forward only, in any mode, with the next batch's input
    dist (and, on CUDA, its copy) overlapped. Gradients are recorded or not as the caller's
    grad mode says (wrap the loop in ``torch.no_grad()``); ``optimizer`` is never used.
    TorchRec's arguments in TorchRec's order (every batch is run, as TorchRec's does), then
    embshard's ``custom_model_fwd`` and ``sparse_of`` by keyword."""

    _trains = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        sparse_of: SparseOf | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=True,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            custom_model_fwd=custom_model_fwd,
            sparse_of=sparse_of,
        )
