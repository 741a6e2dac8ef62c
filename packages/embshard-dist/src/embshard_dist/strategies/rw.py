"""Row-wise sharding: each table's rows are cut into one contiguous block per rank.

Ids are bucketized by :func:`~embshard_dist.strategies.bucketize.bucketize_kjt` in :class:`RwInputDist`.
Partial bags are summed by a reduce-scatter (MEAN: looked up as SUM, then divided by the bag
size), so the forward matches unsharded up to float reassociation and updates are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_dist.strategies.base import (
    BagTable,
    FeatureSelector,
    ReceivedFeatures,
    ShardingStepContext,
    shard_config,
    to_wire,
)
from embshard_dist.strategies.bucketize import bucketize_kjt
from embshard_dist.strategies.layout import boundaries
from embshard_dist.strategies.lookup import GroupedBagLookup, kernel_feature_order
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.sequence import Block, PooledSequenceSharding, SequenceOutputDist
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, PoolingType, ShardingType


class RwInputDist(nn.Module):
    """Bucketizes ids by row block and sends each block's ids to its rank.

    Args:
        keep_lengths: record the bag sizes in the context (for MEAN pooling).
        keep_permute: record the unbucketize permutation (sequence lookups need it).

    The all-to-all's first exchange carries ``ctx.input_status`` (see ``carries_input_status``).
    """

    carries_input_status = True

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        features: Sequence[str],
        row_boundaries: Sequence[Sequence[int]],
        feature_tables: dict[str, str],
        *,
        is_weighted: bool,
        keep_lengths: bool,
        keep_permute: bool = True,
    ) -> None:
        super().__init__()
        self._select = FeatureSelector(features, feature_tables, is_weighted=is_weighted)
        self._boundaries = [list(b) for b in row_boundaries]
        self._world = len(self._boundaries[0]) - 1
        self._all_to_all = KJTAllToAll(pg, [len(features)] * self._world)
        self._keep_lengths = keep_lengths
        self._keep_permute = keep_permute

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Start sending; the awaitables yield this rank's local ids for the global batch.

        Raises:
            ValueError: a feature is missing or an id is outside its table (before any
                collective).
        """
        selected = self._select(features)
        variable = selected.variable_stride_per_key()
        if self._keep_lengths and not variable:
            ctx.bag_lengths = selected.lengths().view(len(self._boundaries), selected.stride())
        bucketized, ctx.unbucketize_permute = bucketize_kjt(
            selected, self._boundaries, with_permute=self._keep_permute
        )
        ctx.sent_features = to_wire(bucketized)
        started = self._all_to_all(ctx.sent_features, ctx.input_status)
        return ReceivedFeatures(
            started, ctx, selected.stride(), self._world, variable_batch=variable
        )


class RwOutputDist(nn.Module):
    """Sums the partial bags of every rank into each sample's own rank (MEAN: then divides)."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        dims: Sequence[int],
        mean: Sequence[bool],
        *,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        # The 1/N rule, applied by the reduce-scatter's backward.
        self._reduce_scatter = PooledEmbeddingsReduceScatter(
            pg, codecs=codecs, grad_scale=1.0 / dist.get_world_size(pg)
        )
        self._world = dist.get_world_size(pg)
        self._dims = torch.tensor(list(dims), dtype=torch.long)
        self._mean = torch.tensor(list(mean), dtype=torch.bool) if any(mean) else None

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        """Start the reduce-scatter of ``[global batch, sum of dims]`` partial sums."""
        started = self._reduce_scatter(embeddings, ctx.batch_size_per_rank)
        if self._mean is not None:
            assert ctx.bag_lengths is not None
            divisor = self._divisor(ctx.bag_lengths, embeddings.dtype)
            started.callbacks.append(lambda out: out / divisor)
        return started

    def _divisor(self, bag_lengths: Tensor, dtype: torch.dtype) -> Tensor:
        """``[batch, sum of dims]``: the bag size in MEAN features' columns, 1 elsewhere."""
        assert self._mean is not None
        device = bag_lengths.device
        sizes = bag_lengths.t().clamp(min=1).to(dtype)
        sizes = torch.where(self._mean.to(device), sizes, torch.ones_like(sizes))
        return sizes.repeat_interleave(self._dims.to(device), dim=1)


class RwSharding:
    """Row-wise sharding of ``tables`` (each with one row block per rank, in rank order)."""

    sharding_type = ShardingType.ROW_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._tables = list(tables)
        self._options = options
        rank = options.rank
        self._local = []
        for table in self._tables:
            assert table.specs is not None and len(table.specs) == options.world_size
            # MEAN looks up sums (divided after the reduce-scatter); sequences stay unpooled.
            sequence = table.config.pooling is PoolingType.NONE
            pooling = None if sequence else PoolingType.SUM
            self._local.append(shard_config(table, table.specs[rank], options, pooling=pooling))
        self._features = kernel_feature_order(self._local)
        by_feature = {f: t for t in self._tables for f in t.config.feature_names}
        self._by_feature = by_feature

    def feature_names(self) -> list[str]:
        return list(self._features)

    def embedding_dims(self) -> list[int]:
        return [self._by_feature[f].config.embedding_dim for f in self._features]

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return {t.name: list(t.specs or ()) for t in self._tables}

    def _mean(self) -> list[bool]:
        return [self._by_feature[f].config.pooling is PoolingType.MEAN for f in self._features]

    def row_boundaries(self) -> list[list[int]]:
        """Per feature (in :meth:`feature_names` order), its table's row block boundaries."""
        out = []
        for f in self._features:
            specs = self._by_feature[f].specs
            assert specs is not None
            out.append(boundaries([s.sizes[0] for s in specs]))
        return out

    def create_input_dist(self) -> nn.Module:
        return RwInputDist(
            self._options.pg,
            self._features,
            self.row_boundaries(),
            {f: t.name for f, t in self._by_feature.items()},
            is_weighted=self._options.is_weighted,
            keep_lengths=any(self._mean()),
            # Only sequences put looked-up rows back in id order.
            keep_permute=any(t.config.pooling is PoolingType.NONE for t in self._tables),
        )

    def create_lookup(self) -> GroupedBagLookup:
        return GroupedBagLookup(self._local, self._options)

    def create_output_dist(self) -> nn.Module:
        return RwOutputDist(
            self._options.pg,
            self.embedding_dims(),
            self._mean(),
            codecs=self._options.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER),
        )


class RwSequenceSharding(PooledSequenceSharding[RwSharding]):
    """Row-wise sharding of sequence ``tables`` (one row block per rank, in rank order)."""

    sharding_type = ShardingType.ROW_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(RwSharding(tables, options), options, _output_dist)


def _output_dist(pooled: RwSharding, options: ShardingOptions) -> nn.Module:
    """Every rank holds a row block of every feature: the blocks go back bucketized."""
    features = pooled.feature_names()
    dims = pooled.embedding_dims()
    blocks = [Block(f, d) for f, d in zip(features, dims, strict=True)]
    return SequenceOutputDist(
        options.pg,
        [blocks] * options.world_size,
        bucketized=True,
        codecs=options.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
    )
