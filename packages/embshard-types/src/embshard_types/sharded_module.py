"""``ShardedModule``: a model-parallel module with data-parallel inputs and outputs.

Its ``forward`` runs ``input_dist`` (data-parallel -> model-parallel), ``compute`` on the local
shards and ``output_dist`` (model-parallel -> data-parallel) and returns a ``LazyAwaitable``.
Also the per-step context types it carries between those stages. Abstract methods stay abstract.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, Generic, Protocol, Self, TypeVar, runtime_checkable

import torch
from torch import nn

from embshard_types.awaitables import Awaitable, LazyAwaitable
from embshard_types.comm_codec import QuantizedCommCodecs

__all__ = [
    "Multistreamable",
    "NullShardedModuleContext",
    "ShardedModule",
    "ShardedModuleContext",
]


@runtime_checkable
class Multistreamable(Protocol):
    """Anything that can tell the caching allocator it is used on another stream."""

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor held as in use on ``stream``."""
        ...


ShardedModuleContext = Multistreamable
"""What a sharded module carries from ``input_dist`` to ``output_dist`` within one step."""


class NullShardedModuleContext:
    """A module context that holds nothing (for modules that need no per-step state)."""

    __slots__ = ()

    def record_stream(self, stream: torch.Stream | None) -> None:
        return None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(
            f"NullShardedModuleContext holds no state (tried to set {key!r}); give the module "
            "a context class with that field"
        )


CompIn = TypeVar("CompIn")
DistOut = TypeVar("DistOut")
Out = TypeVar("Out")
ShrdCtx = TypeVar("ShrdCtx", bound=Multistreamable)


class ShardedModule(abc.ABC, nn.Module, Generic[CompIn, DistOut, Out, ShrdCtx]):
    """A model-parallel module with data-parallel inputs and outputs.

    Args:
        qcomm_codecs_registry: codecs per ``CommOp`` value for the module's collectives.
    """

    def __init__(self, qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None) -> None:
        super().__init__()
        self._qcomm_codecs_registry: dict[str, QuantizedCommCodecs] = (
            {} if qcomm_codecs_registry is None else dict(qcomm_codecs_registry)
        )

    @abc.abstractmethod
    def create_context(self) -> ShrdCtx:
        """A fresh context for one step."""

    @property
    def qcomm_codecs_registry(self) -> dict[str, QuantizedCommCodecs]:
        """The codecs per ``CommOp`` value (empty: no compression)."""
        return self._qcomm_codecs_registry

    @abc.abstractmethod
    def input_dist(self, ctx: ShrdCtx, *input: Any, **kwargs: Any) -> Awaitable[Awaitable[CompIn]]:
        """Start sending inputs to the ranks that hold the shards.

        The outer awaitable waits for the splits (sizes), the inner one for the values.
        """

    @abc.abstractmethod
    def compute(self, ctx: ShrdCtx, dist_input: CompIn) -> DistOut:
        """Look up the local shards for the distributed input."""

    @abc.abstractmethod
    def output_dist(self, ctx: ShrdCtx, output: DistOut) -> LazyAwaitable[Out]:
        """Start sending outputs back to their data-parallel owners."""

    def compute_and_output_dist(self, ctx: ShrdCtx, input: CompIn) -> LazyAwaitable[Out]:
        """``compute`` then ``output_dist``; override to overlap the two per output."""
        return self.output_dist(ctx, self.compute(ctx, input))

    def forward(self, *input: Any, **kwargs: Any) -> LazyAwaitable[Out]:
        """Run input dist, compute and output dist; ``kwargs`` go to ``input_dist``."""
        ctx = self.create_context()
        dist_input = self.input_dist(ctx, *input, **kwargs).wait().wait()
        return self.compute_and_output_dist(ctx, dist_input)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Names of the parameters this module holds (its local shards), after ``prefix``."""
        for name, _ in self.named_parameters(prefix):
            yield name

    def copy(self, device: torch.device) -> Self:
        """Sharded modules place their own shards: moving a model to a device keeps them as is."""
        return self

    @property
    @abc.abstractmethod
    def unsharded_module_type(self) -> type[nn.Module]:
        """The type of module this one shards (used to find the sharder when resharding)."""
