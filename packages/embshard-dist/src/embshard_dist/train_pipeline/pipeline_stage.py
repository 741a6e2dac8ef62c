"""Stages of a :class:`~embshard_dist.train_pipeline.staged.StagedTrainPipeline` (TorchRec's
``torchrec.distributed.train_pipeline.pipeline_stage``).

A :class:`PipelineStage` is one transform of a batch that needs no gradient (the copy to the
device, a GPU postproc, the start of the input dist), run on a stream of its own on CUDA and
inline elsewhere. :class:`SparseDataDistUtil` gives the stage that starts each batch's input dist
ahead of its forward, and makes the model's sharded modules use it:

* ``start_sparse_data_dist(batch)`` (the stage's runnable) starts phase 1 of every pipelined
  module's input dist for ``batch`` and returns ``batch`` unchanged;
* ``wait_sparse_data_dist()`` waits for the splits and starts phase 2 (lengths, ids) of the batches
  started so far; it runs as the stage's fill callback and after every pipelined forward;
* while the model's forward runs on a batch whose input dist was started (the very object the
  stage returned), each sharded module takes that prepared input instead of distributing its
  argument again (:class:`~embshard_dist.train_pipeline.pipelined_forward.PipelinedForward`); the
  lookup and the output dist run inside the forward, on the tables as they are then.

An input dist reads ids only, never weights, and every rank issues the same collectives in the
same order, so a staged loop ``model(pipeline.progress(it))`` + backward + optimizer step gives
the results of the plain loop, bit for bit on the CPU. A forward on any other object (an eval
batch, a model called outside the pipeline) runs as the plain model and leaves the batches in
flight alone. Which KeyedJaggedTensor of a batch feeds each module is learned from the first
batch (which then runs as the plain loop) or given by ``sparse_of``; see
:mod:`~embshard_dist.train_pipeline.sparse_inputs`.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from embshard_dist.train_pipeline.interface import In
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
from embshard_dist.train_pipeline.streams import hand_over

__all__ = [
    "PipelineStage",
    "RunnableType",
    "SparseDataDistUtil",
    "StageOut",
    "StageOutputWithEvent",
    "cuda_stream",
]

logger = logging.getLogger(__name__)

StageOut = TypeVar("StageOut")
"""What a stage returns (TorchRec bounds it by ``Pipelineable``; any batch
:func:`~embshard_dist.train_pipeline.batch.move_batch` can move works here)."""

RunnableType: TypeAlias = Callable[..., Any]
"""A stage's transform: ``batch -> batch``."""

StageOutputWithEvent: TypeAlias = tuple[Any | None, torch.Event | None]
"""A stage's output (``None``: no batch, the data ended or the pipeline is flushing) and the CUDA
event recorded after it on the stage's stream (``None`` off CUDA)."""

_OWNER = "SparseDataDistUtil"


def cuda_stream(stream: object) -> torch.cuda.Stream | None:
    """``stream`` when it is a CUDA stream (work then runs on it); ``None`` for anything else
    (``None``, a CPU ``torch.Stream``): the work runs inline on the current stream."""
    return stream if isinstance(stream, torch.cuda.Stream) else None


@dataclass
class PipelineStage:
    """One gradient-free transform of a batch in a ``StagedTrainPipeline``.

    Args:
        name: the stage's name (in debug logs and profiler ranges).
        runnable: ``batch -> batch``; called once per batch, in the order of the batches.
        stream: a ``torch.cuda.Stream`` to run on (after the previous stage's work for that
            batch); anything else (a CPU ``torch.Stream``, ``None``): run inline.
        fill_callback: called after the runnable's call for each batch while the pipeline
            fills (its first ``progress`` and the one after a flush), never in later calls.
        data_exhausted_callback: called instead of the runnable whenever the stage has no batch
            (the data ended or the pipeline is flushing).
    """

    name: str
    runnable: RunnableType
    stream: torch.Stream | None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None


@dataclass
class _Started:
    """One batch between ``start_sparse_data_dist`` and its forward: its modules' input dists
    (empty while the pipeline does not know where the inputs are) and whether phase 1 ran."""

    batch: Any
    inputs: dict[str, PreparedInput] = field(default_factory=dict)
    started: bool = False


class SparseDataDistUtil(Generic[In]):
    """Starts each batch's input dist as a stage of a ``StagedTrainPipeline``; see the module
    docstring for what is guaranteed.

    The ``start_sparse_data_dist`` stage must come last (TorchRec's rule), or the stages after
    it must return the batch they get, and the model must be called once per ``progress`` with
    the batch it returned.

    Args:
        model: the model the training loop calls (usually a ``DistributedModelParallel``); the
            util hooks its forward from the first ``start_sparse_data_dist`` until
            :meth:`detach`.
        data_dist_stream: the stage's stream (a ``torch.cuda.Stream``; anything else, ``None``
            included: the input dist runs on the current stream, as on the CPU).
        apply_jit, pipeline_postproc: TorchRec's; ``apply_jit=True`` is refused (embshard runs
            the model eagerly), ``pipeline_postproc`` changes nothing (see
            :mod:`~embshard_dist.train_pipeline.options`).
        prefetch_stream, embedding_lookup_stream: must be ``None`` (see Raises).
        sparse_of: embshard's: which KeyedJaggedTensor of a batch each sharded module reads
            (see :mod:`~embshard_dist.train_pipeline.sparse_inputs`); default: learned from the
            first batch, which then runs as the plain loop.

    Raises:
        ValueError: ``model`` holds no sharded module; ``apply_jit=True``; a
            ``prefetch_stream`` or an ``embedding_lookup_stream``.
    """

    def __init__(
        self,
        model: nn.Module,
        data_dist_stream: torch.Stream | None,
        apply_jit: bool = False,
        prefetch_stream: torch.Stream | None = None,
        pipeline_postproc: bool = False,
        embedding_lookup_stream: torch.Stream | None = None,
        *,
        sparse_of: SparseOf | None = None,
    ) -> None:
        PipelineOptions(apply_jit=apply_jit, pipeline_postproc=pipeline_postproc).check(_OWNER)
        _refuse_prefetch_stream(prefetch_stream)
        _refuse_embedding_lookup_stream(embedding_lookup_stream)
        modules = find_sharded_modules(model)
        if not modules:
            raise ValueError(
                f"{_OWNER}: the {type(model).__name__} model holds no sharded module, so there "
                "is no input dist to start ahead; wrap the model in DistributedModelParallel "
                "first, or leave the start_sparse_data_dist stage out"
            )
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.apply_jit = apply_jit
        self.prefetch_stream: torch.Stream | None = None
        self.embedding_lookup_stream: torch.Stream | None = None
        self._dist = cuda_stream(data_dist_stream)
        self._modules = modules
        self._inputs = SparseInputs(modules, sparse_of)
        self._pending: deque[_Started] = deque()
        self._hooks: list[RemovableHandle] = []
        self._forward: ExitStack | None = None
        self._depth = 0  # forwards of the model in progress (nested calls run plainly)
        self._exhausting = False

    @property
    def initialized(self) -> bool:
        """Whether the model's forward is hooked (from the first ``start_sparse_data_dist``
        until :meth:`detach`)."""
        return bool(self._hooks)

    @property
    def pipelined_modules(self) -> dict[str, AnyShardedModule]:
        """The model's sharded modules, by path."""
        return dict(self._modules)

    def start_sparse_data_dist(self, batch: In) -> In:
        """Start phase 1 of every pipelined module's input dist for ``batch`` (on the data-dist
        stream) and return ``batch`` itself; hooks the model's forward first if needed.

        Raises:
            RuntimeError: two batches started earlier still wait for their forwards (the model
                was not called with the batch ``progress`` returned).
        """
        if len(self._pending) >= 2:
            raise RuntimeError(
                f"{_OWNER}.start_sparse_data_dist: {len(self._pending)} batches whose input "
                "dist started still wait for their forwards: call the model once per "
                "progress() with the very batch progress() returned, and put the "
                "start_sparse_data_dist stage last (a later stage must return the batch it gets)"
            )
        self._attach()
        started = _Started(batch)
        self._pending.append(started)
        self._start(started)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Wait for the splits of every batch started so far and start phase 2 of their input
        dists (lengths, ids), on the data-dist stream; what was started already is left as is."""
        for started in self._pending:
            self._start(started, handed_over=False)
            start_values(started.inputs, self._dist)

    def wait_sdd_fill_callback(self) -> None:
        """The stage's fill callback: :meth:`wait_sparse_data_dist` (no forward runs while the
        pipeline fills, so nothing else would)."""
        self.wait_sparse_data_dist()

    def data_exhausted_callback(self) -> None:
        """The stage's data-exhausted callback: notes that the data ended (nothing to do)."""
        self._exhausting = True

    def prefetch(self, batch: In) -> In:
        """TorchRec's cache prefetch stage, refused.

        Raises:
            RuntimeError: always; embshard's sharded modules have no prefetch step.
        """
        raise RuntimeError(_PREFETCH_REFUSAL)

    def load_prefetch(self) -> None:
        """TorchRec's deprecated fill callback of the prefetch stage: does nothing."""

    def start_embedding_lookup(self, batch: In) -> In:
        """TorchRec's semi-synchronous lookup stage, refused.

        Raises:
            RuntimeError: always (see ``embedding_lookup_stream``).
        """
        raise RuntimeError(_LOOKUP_REFUSAL)

    def start_sparse_data_dist_stage(
        self, name: str = "start_sparse_data_dist", runnable: RunnableType | None = None
    ) -> PipelineStage:
        """The stage that starts the input dist: ``runnable`` (default
        :meth:`start_sparse_data_dist`) on the data-dist stream, with this util's fill and
        data-exhausted callbacks."""
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )

    def start_embedding_lookup_stage(
        self, name: str = "start_embedding_lookup", runnable: RunnableType | None = None
    ) -> PipelineStage:
        """TorchRec's lookup stage, refused.

        Raises:
            ValueError: always (see ``embedding_lookup_stream``).
        """
        raise ValueError(_LOOKUP_REFUSAL)

    def detach(self) -> nn.Module:
        """Unhook the model's forward and return the model, as the user built it.

        Batches in flight stay: the next ``start_sparse_data_dist`` hooks the forward again and
        the pipeline goes on where it was. Meanwhile the model trains as a plain model.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        return self.model

    def _attach(self) -> None:
        if self._hooks:
            return
        self._forward, self._depth = None, 0
        self._hooks = [
            self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.model.register_forward_hook(self._after_forward, always_call=True),
        ]

    def _start(self, started: _Started, handed_over: bool = True) -> None:
        """Phase 1 of ``started``'s input dists on the data-dist stream (once, and not before
        the inputs' places are known). ``handed_over``: the batch is ready on that stream (the
        stage waited for it); otherwise the stream first waits for the current one."""
        if started.started or not self._inputs.ready:
            return
        started.started = True
        if not handed_over and self._dist is not None:
            hand_over(started.batch, torch.cuda.current_stream(self._dist.device), self._dist)
        started.inputs = start_input_dists(self._modules, self._inputs(started.batch), self._dist)

    def _before_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """Forward pre-hook: a forward on the oldest started batch uses its input dists (or, on
        the first batch, learns where the inputs are); any other forward, and a call of the
        model inside its own forward, runs plainly."""
        self._depth += 1
        if self._depth > 1 or not self._pending:
            return
        started = self._pending[0]
        if not any(value is started.batch for value in (*args, *kwargs.values())):
            return
        self._pending.popleft()
        stack = ExitStack()
        if self._inputs.ready:
            self._start(started, handed_over=False)
            start_values(started.inputs, self._dist)
            stand_ins = {
                path: PipelinedForward(path, self._modules[path], prepared, self._dist)
                for path, prepared in started.inputs.items()
            }
            stack.enter_context(serving(self._modules, stand_ins, _OWNER))
        else:
            stack.enter_context(self._inputs.learning(started.batch))
        self._forward = stack

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook (also run when the forward raised): restore the modules' forwards; after
        a forward that succeeded, start phase 2 of the next batch (TorchRec's order)."""
        self._depth -= 1
        if self._depth > 0:
            return
        stack, self._forward = self._forward, None
        if stack is None:
            return
        error = sys.exc_info()
        if output is None and error[1] is not None:  # the forward raised
            stack.__exit__(*error)
            return
        stack.close()
        self.wait_sparse_data_dist()


def _refuse_prefetch_stream(prefetch_stream: torch.Stream | None) -> None:
    if prefetch_stream is not None:
        raise ValueError(f"{_OWNER}: prefetch_stream was given. {_PREFETCH_REFUSAL}")


def _refuse_embedding_lookup_stream(embedding_lookup_stream: torch.Stream | None) -> None:
    if embedding_lookup_stream is not None:
        raise ValueError(f"{_OWNER}: embedding_lookup_stream was given. {_LOOKUP_REFUSAL}")


_PREFETCH_REFUSAL = (
    "embshard's sharded modules have no cache prefetch step to run as a stage (a "
    "fused_uvm_caching table fills its cache inside the lookup, in the forward). Pass "
    "prefetch_stream=None and drop the prefetch stage: the start_sparse_data_dist stage alone "
    "gives the same results"
)
_LOOKUP_REFUSAL = (
    "a start_embedding_lookup stage looks batch i+1 up before batch i's update (TorchRec's "
    "semi-synchronous staged mode), which embshard's StagedTrainPipeline does not run. Pass "
    "embedding_lookup_stream=None and drop that stage (the lookup then runs in the forward, "
    "results equal the plain loop), or use TrainPipelineSemiSync for a semi-synchronous pipeline"
)
