"""Data-parallel sharding of sequence tables: every rank holds every table whole.

Composed from :class:`~embshard_dist.sharding.dp.DpSharding`: its input dist (select the
features, no communication) and its lookup (embshard's torch kernels, whose backward exchanges
the touched rows' gradients between the replicas); the output dist only divides the gradient by
the world size (:class:`~embshard_dist.sharding.sequence.DpSequenceOutputDist`).

Math: every rank applies the same sparse update to the same rows with the gradients of all
ranks summed in rank order, so the replicas stay identical and equal the unsharded collection
stepped with ``L = (1/N) * sum_i L_i`` (see :mod:`.dp`); the forward is a plain lookup (exact).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.dp import DpSharding
from embshard_dist.sharding.sequence import DpSequenceOutputDist, PooledSequenceSharding
from embshard_types.vocab import ShardingType

__all__ = ["DpSequenceSharding"]


class DpSequenceSharding(PooledSequenceSharding[DpSharding]):
    """Data-parallel sharding of sequence ``tables`` (replicated whole on every rank).

    Features come in the kernels' order; ``shard_specs()`` is ``None`` (every rank holds every
    table whole).

    Args:
        tables: the data-parallel tables, in the collection's order.
        options: where to run and how to build kernels.
    """

    sharding_type = ShardingType.DATA_PARALLEL

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(DpSharding(tables, options), options, _output_dist)


def _output_dist(pooled: DpSharding, options: ShardingOptions) -> nn.Module:
    """No communication: the rows stay; the gradient is divided by the world size."""
    return DpSequenceOutputDist(pooled.feature_names(), pooled.embedding_dims(), options.world_size)
