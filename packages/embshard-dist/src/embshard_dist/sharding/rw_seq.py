"""Row-wise sharding of sequence tables: each table's rows are cut into one block per rank.

Composed from :class:`~embshard_dist.sharding.rw.RwSharding`: its input dist (ids bucketized to
the rank holding their row, :func:`~embshard_dist.sharding.bucketize.bucketize_kjt`, then a KJT
all-to-all), its layout and its lookup (sequence kernels); only the output dist differs: a
sequence all-to-all returns every id's row to the rank it came from, which puts each feature's
bucket blocks one after the other and restores the caller's id order with the bucketization's
``unbucketize_permute`` (:class:`~embshard_dist.sharding.sequence.SequenceOutputDist`).

Math: every row lives on one rank and all ids that touch it meet in one kernel backward, so
the fused optimizer applies exactly the unsharded update for ``L = (1/N) * sum_i L_i``. Unlike
pooled row-wise sharding nothing is summed across ranks: the forward is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.rw import RwSharding
from embshard_dist.sharding.sequence import Block, PooledSequenceSharding, SequenceOutputDist
from embshard_types.vocab import CommOp, ShardingType

__all__ = ["RwSequenceSharding"]


class RwSequenceSharding(PooledSequenceSharding[RwSharding]):
    """Row-wise sharding of sequence ``tables`` (one row block per rank, in rank order).

    Features come in the kernels' order (the same on every rank).

    Args:
        tables: the row-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

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
