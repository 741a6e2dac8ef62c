"""What every embedding-bag sharding strategy shares: its protocol, its per-step context, the
description of the tables it shards, and the small pieces each strategy is built from.

A strategy (``dp.py``, ``tw.py``, ``rw.py``, ``cw.py``) serves the tables a plan gives it and
exposes three modules, run in this order every step::

    KeyedJaggedTensor (caller's local batch)
      -> input dist   select this strategy's features, route them (permute / bucketize, then a
                      KJT all-to-all); Awaitable[Awaitable[KJT]]
      -> lookup       grouped kernels on this rank's shards; Tensor [rows, local width]
      -> output dist  pooled all-to-all (TW, CW), reduce-scatter (RW), nothing (DP);
                      Awaitable[Tensor [local batch, sum of dims]] in ``feature_names()`` order

The one rule for the math, whatever the plan: a step on N ranks with local batches ``b_i`` and
losses ``L_i`` leaves every table's weights and optimizer state equal to those of the unsharded
module stepped on the concatenated global batch with loss ``L = (1/N) * sum_i L_i`` (DDP's
convention for dense gradients). Every strategy therefore divides the embedding gradients that
rank ``i``'s loss sends back by N, in exactly one place, its output dist: either the
collective's backward scales the gradient as it moves it (``grad_scale`` of the pooled
all-to-all and of the reduce-scatter), or :func:`scale_grad` does.

Guarantees of the pieces here: :class:`FeatureSelector` computes a permutation once per input
key order and raises a ``ValueError`` naming the missing feature and its table before any
collective; :func:`to_wire` / :class:`ReceivedFeatures` send every rank's batch size along with
its features, so ranks may hold batches of different sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from embshard_kernels.fbgemm_mapping import resolve_kernel
from embshard_kernels.fused_params import FusedParams
from embshard_kernels.grouping import ShardedTableConfig
from embshard_optim.sharded_state import StateFormat
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, ComputeKernel, PoolingType, ShardingType

if TYPE_CHECKING:
    from embshard_dist.sharding._lookup import GroupedBagLookup

__all__ = [
    "BagTable",
    "EmbeddingBagSharding",
    "FeatureSelector",
    "ReceivedFeatures",
    "ShardingOptions",
    "ShardingStepContext",
    "scale_grad",
    "shard_config",
    "to_wire",
]


@dataclass
class ShardingStepContext:
    """What one strategy carries from its input dist to its output dist within one step.

    Attributes:
        batch_size_per_rank: every rank's local batch size (known once the features arrived).
        bag_lengths: row-wise MEAN pooling: this rank's bag sizes, ``[features, batch]``.
        sent_features: the KJT this rank handed to the features' all-to-all (sequence output
            dists read how many ids of each feature went to each rank).
        unbucketize_permute: row-wise: position in the bucketized ids of each id of the
            selected features (see :mod:`.bucketize`).
        batch_size_per_feature_per_rank: batch sizes that vary per feature: per feature of
            this rank's lookup input, its batch size on each rank.
        input_features: batch sizes that vary per feature: the caller's batch.
    """

    batch_size_per_rank: list[int] | None = None
    bag_lengths: Tensor | None = None
    sent_features: KeyedJaggedTensor | None = None
    unbucketize_permute: Tensor | None = None
    batch_size_per_feature_per_rank: list[list[int]] | None = None
    input_features: KeyedJaggedTensor | None = None

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
    """One table of the collection and how the plan shards it.

    Args:
        config: the user's table config (pooled, or sequence for an EmbeddingCollection).
        sharding: the plan's entry for the table.
        specs: every shard of the table (``None`` for data-parallel: whole on every rank).
    """

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


@dataclass(frozen=True)
class ShardingOptions:
    """Where a strategy runs and how it builds its kernels and collectives.

    Args:
        device: the compute device of this rank.
        pg: the process group the shard placements refer to.
        fused_params: the fused kernels' options (optimizer, output dtype...).
        is_weighted: whether features carry per-id weights.
        state_format: how fused optimizers expose weights and state.
        world_size: ranks in the sharding group.
        rank: this rank.
        qcomm_codecs_registry: quantized comm codecs per ``CommOp`` value.
    """

    device: torch.device
    pg: Any
    fused_params: FusedParams
    is_weighted: bool
    state_format: StateFormat
    world_size: int
    rank: int
    qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] = field(default_factory=dict)

    def codecs(self, op: CommOp) -> QuantizedCommCodecs | None:
        """The codecs registered for ``op``, if any."""
        return self.qcomm_codecs_registry.get(op.value)


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
        table: the table.
        spec: the shard (its sizes are the kernel's local rows and columns).
        options: the kernels' options.
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
    def sharding_type(self) -> ShardingType:
        """The strategy."""
        ...

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
    """Picks (and orders, and repeats) features out of the caller's KeyedJaggedTensor.

    The permutation is computed once per input key order and cached. Weights are dropped
    when the collection is unweighted (they would only be sent and ignored).

    Args:
        wanted: the features to produce, in order (repeats allowed).
        feature_tables: feature -> its table (for messages).
        is_weighted: keep the weights.
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

        Batch sizes may vary per feature (the sharded collections check that their strategies
        support it before selecting).

        Raises:
            ValueError: a feature is missing (named with its table), or a weighted collection
                gets no weights.
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
    """``kjt`` with its batch size stated per key, so that the receivers learn every rank's.

    (A KJT all-to-all of KJTs with a stride per key and rank delivers, per key, the batch size
    of each source rank.) Batch sizes that vary per key are kept. No tensor is copied.
    """
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
    """The two phases of a KJT all-to-all of :func:`to_wire` KJTs.

    The result is a plain KJT (batch = the sources' batches, in rank order) and the step's
    context learns every rank's batch size. A rank that receives no features cannot learn
    them and records its own batch size for every rank (nothing is sent to or from it).
    With ``variable_batch`` (batch sizes that vary per feature, on every rank alike) the
    result keeps, per key, the batch size of each source rank, and the context records them
    (``batch_size_per_feature_per_rank``).

    Args:
        splits: the all-to-all's first phase (``KJTAllToAll(...)(to_wire(kjt))``).
        ctx: the step's context of this strategy.
        local_batch: this rank's batch size.
        world_size: ranks in the group.
        variable_batch: the features' batch sizes vary per feature.
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
    """Identity forward; backward multiplies the gradient by ``1 / divisor``.

    (Multiplying by the reciprocal is what autograd does for ``loss / N``, so the gradient
    has the same bits as that of the unsharded ``(sum_i L_i) / N``.)
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, divisor: int) -> Tensor:
        ctx.factor = 1.0 / divisor
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(embeddings: Tensor, world_size: int) -> Tensor:
    """``embeddings`` unchanged, whose gradient is divided by ``world_size`` (the 1/N rule).

    Output dists whose collective can scale the gradient as it moves it (the pooled
    all-to-all's and the reduce-scatter's ``grad_scale``) do that instead: the same products,
    without a pass of their own.

    Args:
        embeddings: pooled embeddings on their way to (or back from) the output dist.
        world_size: N, the number of ranks whose losses are averaged.
    """
    if world_size == 1 or not embeddings.requires_grad:
        return embeddings
    out = _ScaleGrad.apply(embeddings, world_size)
    assert isinstance(out, Tensor)
    return out
