"""A sharded module's input dist started ahead of its forward, and the forwards that use it.

:func:`start_input_dist` runs the module's ``input_dist`` for a batch (phase 1: the splits
all-to-all, and for row-wise tables the bucketizing); :meth:`PreparedInput.start_values` waits
for the splits and starts phase 2 (lengths, ids, weights); :meth:`PreparedInput.lookup` waits
for phase 2 and starts the lookup and output dist. Within :func:`serving`, the module's
``forward`` is a stand-in (:class:`PipelinedForward`, or the semi-synchronous pipeline's): it
takes the prepared input instead of distributing the argument again, and refuses any argument
but the very KeyedJaggedTensor that was distributed, so a pipeline can never look up another
batch's ids. Outside it the module's own forward is back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from embshard_dist.train_pipeline.sparse_inputs import AnyShardedModule
from embshard_dist.train_pipeline.streams import hand_over, on_stream
from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = [
    "StartedLookup",
    "PipelinedForward",
    "PreparedInput",
    "StandIn",
    "check_call",
    "serving",
    "start_input_dist",
    "start_input_dists",
    "start_values",
]

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

    def lookup(
        self, module: AnyShardedModule, dist_stream: torch.cuda.Stream | None
    ) -> LazyAwaitable[Any]:
        """Wait for phase 2 (on ``dist_stream``, then handed over to the current stream) and
        return ``module.compute_and_output_dist``: exactly what the module's own forward
        returns, its output dist in flight until first used."""
        with on_stream(dist_stream):
            data = self.start_values().wait()
        hand_over(data, dist_stream)
        hand_over(self.context, dist_stream)
        return module.compute_and_output_dist(self.context, data)


def start_input_dist(module: AnyShardedModule, features: KeyedJaggedTensor) -> PreparedInput:
    """Start ``module``'s input dist of ``features`` with a fresh context."""
    context = module.create_context()
    return PreparedInput(features, context, module.input_dist(context, features))


def start_input_dists(
    modules: Mapping[str, AnyShardedModule],
    features: Mapping[str, KeyedJaggedTensor],
    stream: torch.cuda.Stream | None,
) -> dict[str, PreparedInput]:
    """Phase 1 of each module's input dist of its ``features[path]``, on ``stream``."""
    with on_stream(stream):
        return {path: start_input_dist(modules[path], kjt) for path, kjt in features.items()}


def start_values(inputs: Mapping[str, PreparedInput], stream: torch.cuda.Stream | None) -> None:
    """Phase 2 of every prepared input dist (each once), on ``stream``."""
    with on_stream(stream):
        for prepared in inputs.values():
            prepared.start_values()


class StandIn(Protocol):
    """What stands in for a sharded module's ``forward`` during one pipelined step."""

    @property
    def consumed(self) -> bool:
        """Whether the model called the module in this step."""
        ...

    def __call__(self, *input: Any, **kwargs: Any) -> Any: ...


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
        check_call(self._path, None if prepared is None else prepared.features, input, kwargs)
        assert prepared is not None
        self._prepared = None
        return prepared.lookup(self._module, self._dist_stream)


class StartedLookup:
    """Stands in for a sharded module's ``forward`` when its lookup started before the model's
    forward: called once, with the prepared KeyedJaggedTensor, it returns that lookup
    (``compute_and_output_dist``'s awaitable, exactly what the module's own forward returns)."""

    def __init__(
        self, path: str, features: KeyedJaggedTensor, lookup: LazyAwaitable[Any], owner: str
    ) -> None:
        self._path = path
        self._features = features
        self._lookup: LazyAwaitable[Any] | None = lookup
        self._owner = owner

    @property
    def consumed(self) -> bool:
        """Whether the model called the module in this step."""
        return self._lookup is None

    def __call__(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Any]:
        lookup = self._lookup
        features = None if lookup is None else self._features
        check_call(self._path, features, input, kwargs, self._owner)
        assert lookup is not None
        self._lookup = None
        return lookup


def check_call(
    path: str,
    features: KeyedJaggedTensor | None,
    input: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    owner: str = _OWNER,
) -> None:
    """Refuse a call of the sharded module at ``path`` with anything but ``features``, the
    KeyedJaggedTensor the pipeline prepared (``None``: already called in this step).

    Raises:
        RuntimeError: a second call in one forward.
        ValueError: a call with other arguments.
    """
    if features is None:
        raise RuntimeError(
            f"{owner}: the sharded module {path!r} was called twice in one forward; "
            "the pipeline distributes one input per module per batch, so a model that "
            "calls a sharded module more than once cannot be pipelined: leave it out of "
            "sparse_of's mapping, or train with the plain loop"
        )
    if len(input) != 1 or kwargs or input[0] is not features:
        raise ValueError(
            f"{owner}: the sharded module {path!r} was called with "
            f"{_describe(input, kwargs)}, not with the KeyedJaggedTensor the pipeline read "
            "from the batch and distributed ahead (where the first batch held it, or sparse_of); it "
            "can only prefetch an input the model passes on unchanged. Give sparse_of the "
            "very KeyedJaggedTensor the model passes this module, leave the module out of "
            "sparse_of's mapping (it then distributes its own input), or train with the "
            "plain loop"
        )


def _describe(input: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    parts = [type(a).__name__ for a in input] + [f"{k}=..." for k in kwargs]
    if len(input) == 1 and not kwargs and isinstance(input[0], KeyedJaggedTensor):
        return "another KeyedJaggedTensor"
    return f"({', '.join(parts)})"


@contextmanager
def serving(
    modules: Mapping[str, AnyShardedModule],
    stand_ins: Mapping[str, StandIn],
    owner: str = _OWNER,
) -> Iterator[None]:
    """Within the block, each module in ``stand_ins`` forwards through its stand-in.

    The modules' forwards are restored on leaving, also on an error.

    Raises:
        RuntimeError: the block ended without calling a module that has a stand-in.
    """
    saved = {path: modules[path].__dict__.get("forward") for path in stand_ins}
    try:
        for path, forward in stand_ins.items():
            modules[path].forward = forward  # type: ignore[method-assign]
        yield
        missed = [path for path, forward in stand_ins.items() if not forward.consumed]
    finally:
        for path, own in saved.items():
            if own is None:
                modules[path].__dict__.pop("forward", None)
            else:
                modules[path].forward = own  # type: ignore[method-assign]
    if missed:
        raise RuntimeError(
            f"{owner}: the model's forward did not call the sharded modules {missed}, whose "
            "input the pipeline had distributed; a module the forward may skip cannot be "
            "pipelined: leave it out of sparse_of's mapping"
        )
