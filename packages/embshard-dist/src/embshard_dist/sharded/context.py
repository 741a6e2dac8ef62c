"""The per-step context of a sharded embedding-bag collection and the awaitables of its flow.

Features are waited for in strategy order (the order every rank started them); the outputs are
assembled in the caller's key order, each all-to-all writing straight into its columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from embshard_dist.comm.placement import PlacedAssembly
from embshard_dist.strategies.base import ShardingStepContext
from embshard_types.awaitables import Awaitable, LazyAwaitable, LazyGetItemMixin
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor


@dataclass
class EmbeddingBagCollectionContext:
    """What one step carries from input dist to output dist: one context per strategy."""

    sharding_contexts: list[ShardingStepContext] = field(default_factory=list)

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the held tensors as used on ``stream``."""
        for ctx in self.sharding_contexts:
            ctx.record_stream(stream)


class FeaturesAwaitable(Awaitable[Awaitable[list[KeyedJaggedTensor]]]):
    """Every strategy's two-phase feature all-to-all, waited for together."""

    def __init__(self, started: Sequence[Awaitable[Awaitable[KeyedJaggedTensor]]]) -> None:
        super().__init__()
        self._started = list(started)

    def _wait_impl(self) -> Awaitable[list[KeyedJaggedTensor]]:
        return _TensorsAwaitable([a.wait() for a in self._started])


class _TensorsAwaitable(Awaitable[list[KeyedJaggedTensor]]):
    def __init__(self, pending: list[Awaitable[KeyedJaggedTensor]]) -> None:
        super().__init__()
        self._pending = pending

    def _wait_impl(self) -> list[KeyedJaggedTensor]:
        return [a.wait() for a in self._pending]


class KeyedTensorAwaitable(LazyGetItemMixin[str, Tensor], LazyAwaitable[KeyedTensor]):
    """The pooled embeddings of every feature, in the caller's key order."""

    def __init__(
        self,
        pending: Sequence[Awaitable[Tensor]],
        keys: list[str],
        dims: list[int],
        assembly: PlacedAssembly,
    ) -> None:
        super().__init__()
        self._pending = list(pending)
        self._keys = keys
        self._dims = dims
        self._assembly = assembly

    def _wait_impl(self) -> KeyedTensor:
        values = self._assembly(self._pending)
        return KeyedTensor(self._keys, self._dims, values)
