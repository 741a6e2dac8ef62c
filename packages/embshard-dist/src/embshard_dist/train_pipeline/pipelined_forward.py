"""A sharded module's input dist started ahead of its forward, and the forward that uses it.

:func:`start_input_dist` runs the module's ``input_dist`` for a batch (phase 1: the splits
all-to-all, and for row-wise tables the bucketizing); :meth:`PreparedInput.start_values` waits
for the splits and starts phase 2 (lengths, ids, weights). Within :func:`serving`, the module's
``forward`` is a :class:`PipelinedForward`: it takes the prepared input instead of distributing
the argument again, and refuses any argument but the very KeyedJaggedTensor that was
distributed, so the pipeline can never look up another batch's ids. Outside it the module's own
forward is back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from embshard_dist.train_pipeline.sparse_inputs import AnyShardedModule
from embshard_dist.train_pipeline.streams import hand_over, on_stream
from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = ["PipelinedForward", "PreparedInput", "serving", "start_input_dist"]

_OWNER = "TrainPipelineSparseDist"


@dataclass
class PreparedInput:
    """One module's input dist for one batch.

    Attributes:
        features: the KeyedJaggedTensor distributed (the model must pass this very object).
        context: the module's context for this batch, from ``create_context()``.
        splits: phase 1 in flight; ``tensors``: phase 2 in flight, once started.
    """

    features: KeyedJaggedTensor
    context: Any
    splits: Awaitable[Awaitable[Any]]
    tensors: Awaitable[Any] | None = None

    def start_values(self) -> Awaitable[Any]:
        """Wait for the splits and start sending lengths and ids (once); phase 2's awaitable."""
        if self.tensors is None:
            self.tensors = self.splits.wait()
        return self.tensors


def start_input_dist(module: AnyShardedModule, features: KeyedJaggedTensor) -> PreparedInput:
    """Start ``module``'s input dist of ``features`` with a fresh context."""
    context = module.create_context()
    return PreparedInput(features, context, module.input_dist(context, features))


class PipelinedForward:
    """Stands in for a sharded module's ``forward`` during one pipelined step.

    Called once, with the prepared input's KeyedJaggedTensor, it waits for phase 2 (on the
    input-dist stream, then handed over to the current one) and returns
    ``compute_and_output_dist``, exactly what the module's own forward returns: a
    ``LazyAwaitable`` whose output all-to-all is in flight until the model first uses it, so the
    dense layers the model runs before that (DLRM's dense arch) overlap it.
    """

    def __init__(
        self,
        path: str,
        module: AnyShardedModule,
        prepared: PreparedInput,
        dist_stream: torch.cuda.Stream | None,
    ) -> None:
        self._path = path
        self._module = module
        self._prepared: PreparedInput | None = prepared
        self._dist_stream = dist_stream

    @property
    def consumed(self) -> bool:
        """Whether the model called the module in this step."""
        return self._prepared is None

    def __call__(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Any]:
        prepared = self._prepared
        if prepared is None:
            raise RuntimeError(
                f"{_OWNER}: the sharded module {self._path!r} was called twice in one forward; "
                "the pipeline distributes one input per module per batch, so a model that "
                "calls a sharded module more than once cannot be pipelined: leave it out of "
                "sparse_of's mapping, or train with the plain loop"
            )
        if len(input) != 1 or kwargs or input[0] is not prepared.features:
            raise ValueError(
                f"{_OWNER}: the sharded module {self._path!r} was called with "
                f"{_describe(input, kwargs)}, not with the KeyedJaggedTensor the pipeline read "
                "from the batch and distributed ahead (batch.sparse_features, or sparse_of); it "
                "can only prefetch an input the model passes on unchanged. Give sparse_of the "
                "very KeyedJaggedTensor the model passes this module, leave the module out of "
                "sparse_of's mapping (it then distributes its own input), or train with the "
                "plain loop"
            )
        self._prepared = None
        with on_stream(self._dist_stream):
            data = prepared.start_values().wait()
        hand_over(data, self._dist_stream)
        hand_over(prepared.context, self._dist_stream)
        return self._module.compute_and_output_dist(prepared.context, data)


def _describe(input: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    parts = [type(a).__name__ for a in input] + [f"{k}=..." for k in kwargs]
    if len(input) == 1 and not kwargs and isinstance(input[0], KeyedJaggedTensor):
        return "another KeyedJaggedTensor"
    return f"({', '.join(parts)})"


@contextmanager
def serving(
    modules: Mapping[str, AnyShardedModule],
    prepared: Mapping[str, PreparedInput],
    dist_stream: torch.cuda.Stream | None,
) -> Iterator[None]:
    """Within the block, each module in ``prepared`` forwards its prepared input.

    The modules' forwards are restored on leaving, also on an error.

    Raises:
        RuntimeError: the block ended without calling a module whose input was prepared.
    """
    forwards = {
        path: PipelinedForward(path, modules[path], one, dist_stream)
        for path, one in prepared.items()
    }
    saved = {path: modules[path].__dict__.get("forward") for path in forwards}
    try:
        for path, forward in forwards.items():
            modules[path].forward = forward  # type: ignore[method-assign]
        yield
        missed = [path for path, forward in forwards.items() if not forward.consumed]
    finally:
        for path, own in saved.items():
            if own is None:
                modules[path].__dict__.pop("forward", None)
            else:
                modules[path].forward = own  # type: ignore[method-assign]
    if missed:
        raise RuntimeError(
            f"{_OWNER}: the model's forward did not call the sharded modules {missed}, whose "
            "input the pipeline had distributed; a module the forward may skip cannot be "
            "pipelined: leave it out of sparse_of's mapping"
        )
