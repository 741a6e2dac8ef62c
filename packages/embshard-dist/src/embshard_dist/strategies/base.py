"""The strategy protocol, its per-step context and the pieces every strategy shares.

A strategy runs each step as::

    KJT (local batch) -> input dist (select, route, KJT all-to-all) -> lookup (local shards)
      -> output dist (pooled all-to-all / reduce-scatter / nothing) -> [local batch, sum of dims]

Math rule: a step on N ranks equals the unsharded module on the global batch with loss
(1/N) sum_i L_i; the 1/N is applied once, in the output dist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from embshard_dist.comm.kjt_all_to_all import InputStatus
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.options import ShardingOptions
from embshard_kernels.fbgemm_mapping import resolve_kernel
from embshard_kernels.grouping import ShardedTableConfig
from embshard_types.awaitables import Awaitable
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import ComputeKernel, PoolingType, ShardingType

__all__ = [
    "BagTable",
    "EmbeddingBagSharding",
    "FeatureSelector",
    "ReceivedFeatures",
    "ShardingStepContext",
    "scale_grad",
    "shard_config",
    "to_wire",
]


@dataclass
class ShardingStepContext:
    """What one strategy carries from its input dist to its output dist within one step.

    Attributes:
        bag_lengths: row-wise MEAN pooling: this rank's bag sizes, ``[features, batch]``.
        sent_features: the KJT sent to the all-to-all (sequence output dists read its splits).
        unbucketize_permute: row-wise: position of each selected id in the bucketized ids.
        batch_size_per_feature_per_rank: variable batch: per lookup feature, its batch per rank.
        input_status: this rank's verdict on the collection's input, sent with the first
            exchange of every KJT all-to-all (see ``comm.kjt_all_to_all.InputStatus``).
    """

    batch_size_per_rank: list[int] | None = None
    bag_lengths: Tensor | None = None
    sent_features: KeyedJaggedTensor | None = None
    unbucketize_permute: Tensor | None = None
    batch_size_per_feature_per_rank: list[list[int]] | None = None
    input_features: KeyedJaggedTensor | None = None
    input_status: InputStatus | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark the held tensors as used on ``stream``."""
        for tensor in (self.bag_lengths, self.unbucketize_permute):
            if tensor is not None:
                tensor.record_stream(stream)
        for kjt in (self.sent_features, self.input_features):
            if kjt is not None:
                kjt.record_stream(stream)


@dataclass(frozen=True)
class BagTable:
    """One table of the collection and how the plan shards it (``specs`` is ``None`` for DP)."""

    config: EmbeddingBagConfig | EmbeddingConfig
    sharding: ParameterSharding
    specs: tuple[ShardSpec, ...] | None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def compute_kernel(self) -> ComputeKernel:
        """The plan's kernel, ``DEFAULT`` resolved to ``FUSED``."""
        return resolve_kernel(self.sharding.compute_kernel, table=self.name)

    def local_specs(self, rank: int) -> list[ShardSpec]:
        """The shards held by ``rank`` (data-parallel: none, see ``specs``)."""
        return [s for s in self.specs or () if s.rank == rank]


def shard_config(
    table: BagTable,
    spec: ShardSpec,
    options: ShardingOptions,
    *,
    pooling: PoolingType | None = None,
    all_specs: Sequence[ShardSpec] | None = None,
) -> ShardedTableConfig:
    """The kernel-side config of one shard of ``table``.

    Args:
        pooling: override the table's pooling (row-wise MEAN looks up with SUM).
        all_specs: every shard of the table (default: ``table.specs``, or ``spec`` alone).
    """
    cfg = table.config
    return ShardedTableConfig(
        name=cfg.name,
        num_embeddings=cfg.num_embeddings,
        embedding_dim=cfg.embedding_dim,
        feature_names=cfg.feature_names,
        data_type=cfg.data_type,
        pooling=pooling or cfg.pooling,
        init_range=cfg.init_range,
        compute_kernel=table.compute_kernel,
        is_weighted=options.is_weighted,
        local_rows=spec.sizes[0],
        local_cols=spec.sizes[1],
        local_metadata=spec,
        global_metadata=tuple(all_specs or table.specs or (spec,)),
        fused_params=options.fused_params,
    )


@runtime_checkable
class EmbeddingBagSharding(Protocol):
    """One sharding strategy over the tables a plan gives it (see the module docstring)."""

    @property
    def sharding_type(self) -> ShardingType: ...

    def feature_names(self) -> list[str]:
        """The features this strategy serves, in the order of its output's column blocks."""
        ...

    def embedding_dims(self) -> list[int]:
        """The (full) embedding width of each feature of ``feature_names()``."""
        ...

    def shard_specs(self) -> dict[str, list[ShardSpec]] | None:
        """Every shard of every table (``None``: data-parallel, whole tables everywhere)."""
        ...

    def create_input_dist(self) -> nn.Module:
        """``(caller's KJT, ctx) -> Awaitable[Awaitable[KJT]]``: this rank's lookup input."""
        ...

    def create_lookup(self) -> GroupedBagLookup:
        """``KJT -> Tensor``: pooled rows of this rank's shards."""
        ...

    def create_output_dist(self) -> nn.Module:
        """``(Tensor, ctx) -> Awaitable[Tensor]``: ``[local batch, sum of dims]``."""
        ...


class FeatureSelector:
    """Picks, orders and repeats features of the caller's KJT; caches one permutation per key order.

    Weights are dropped when the collection is unweighted (they would only be sent and ignored).
    """

    _MAX_CACHED = 16

    def __init__(
        self, wanted: Sequence[str], feature_tables: dict[str, str], *, is_weighted: bool
    ) -> None:
        self._wanted = list(wanted)
        self._tables = feature_tables
        self._weighted = is_weighted
        self._cache: dict[tuple[str, ...], list[int] | None] = {}

    def __call__(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """This strategy's features out of ``features``.

        Raises:
            ValueError: a feature is missing, or a weighted collection gets no weights.
        """
        keys = tuple(features.keys())
        if keys not in self._cache:
            if len(self._cache) >= self._MAX_CACHED:
                self._cache.clear()
            self._cache[keys] = self._plan(keys)
        if self._weighted and features.weights_or_none() is None and self._wanted:
            raise ValueError(
                f"the collection is weighted (tables {sorted(set(self._tables.values()))}) but the "
                "input has no weights; pass weights= to the KeyedJaggedTensor"
            )
        permutation = self._cache[keys]
        selected = features if permutation is None else features.permute(permutation)
        if not self._weighted and selected.weights_or_none() is not None:
            selected = _without_weights(selected)
        return selected

    def _plan(self, keys: tuple[str, ...]) -> list[int] | None:
        if list(keys) == self._wanted:
            return None
        position = {k: i for i, k in enumerate(keys)}
        for feature in self._wanted:
            if feature not in position:
                raise ValueError(
                    f"feature {feature!r} (table {self._tables.get(feature)!r}) is missing from "
                    f"the input; the input has features {list(keys)}"
                )
        return [position[f] for f in self._wanted]


def _without_weights(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys,
        kjt.values(),
        lengths=kjt.lengths(),
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key_or_none(),
        allow_duplicate_keys=len(set(keys)) < len(keys),
    )


def to_wire(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt`` with its batch size stated per key, so the all-to-all tells receivers every rank's."""
    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys,
        kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        stride_per_key_per_rank=[[s] for s in kjt.stride_per_key()],
        length_per_key=kjt.length_per_key_or_none(),
        allow_duplicate_keys=len(set(keys)) < len(keys),
    )


class ReceivedFeatures(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """The two phases of a KJT all-to-all of :func:`to_wire` KJTs; records every rank's batch.

    The result is a plain KJT (the sources' batches in rank order); with ``variable_batch`` it
    keeps each source rank's batch size per key.
    """

    def __init__(
        self,
        splits: Awaitable[Awaitable[KeyedJaggedTensor]],
        ctx: ShardingStepContext,
        local_batch: int,
        world_size: int,
        *,
        variable_batch: bool = False,
    ) -> None:
        super().__init__()
        self._splits = splits
        self._ctx = ctx
        self._local_batch = local_batch
        self._world = world_size
        self._variable = variable_batch

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        return _ReceivedTensors(
            self._splits.wait(), self._ctx, self._local_batch, self._world, self._variable
        )


class _ReceivedTensors(Awaitable[KeyedJaggedTensor]):
    def __init__(
        self,
        tensors: Awaitable[KeyedJaggedTensor],
        ctx: ShardingStepContext,
        local_batch: int,
        world_size: int,
        variable_batch: bool,
    ) -> None:
        super().__init__()
        self._tensors = tensors
        self._ctx = ctx
        self._local_batch = local_batch
        self._world = world_size
        self._variable = variable_batch

    def _wait_impl(self) -> KeyedJaggedTensor:
        received = self._tensors.wait()
        keys = received.keys()
        if self._variable and keys:
            per_rank = received.stride_per_key_per_rank()
            self._ctx.batch_size_per_feature_per_rank = per_rank
            return KeyedJaggedTensor(
                keys,
                received.values(),
                weights=received.weights_or_none(),
                lengths=received.lengths(),
                stride_per_key_per_rank=per_rank,
                length_per_key=received.length_per_key_or_none(),
                allow_duplicate_keys=len(set(keys)) < len(keys),
            )
        if not keys:  # nothing comes to or goes from this rank: any batch sizes fit
            self._ctx.batch_size_per_rank = [self._local_batch] * self._world
            return KeyedJaggedTensor(
                [],
                received.values(),
                lengths=received.lengths(),
                stride=self._local_batch * self._world,
            )
        batches = received.stride_per_key_per_rank()[0]
        self._ctx.batch_size_per_rank = list(batches)
        return KeyedJaggedTensor(
            keys,
            received.values(),
            weights=received.weights_or_none(),
            lengths=received.lengths(),
            stride=sum(batches),
            length_per_key=received.length_per_key_or_none(),
            allow_duplicate_keys=len(set(keys)) < len(keys),
        )


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by ``1 / divisor``, bit-equal to autograd's ``/ N``."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, divisor: int) -> Tensor:
        ctx.factor = 1.0 / divisor
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(embeddings: Tensor, world_size: int) -> Tensor:
    """``embeddings`` unchanged, whose gradient is divided by ``world_size`` (the 1/N rule).

    Collectives with a ``grad_scale`` apply the rule themselves and skip this.
    """
    if world_size == 1 or not embeddings.requires_grad:
        return embeddings
    out = _ScaleGrad.apply(embeddings, world_size)
    assert isinstance(out, Tensor)
    return out
