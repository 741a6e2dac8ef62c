"""Table-wise sharding of sequence tables: each table lives whole on one rank.

Composed from :class:`~embshard_dist.sharding.tw.TwSharding`: its input dist (one permutation,
then a KJT all-to-all to the table's rank), its layout and its lookup (sequence kernels for the
sequence tables); only the output dist differs: a sequence all-to-all returns every id's row to
the rank it came from (:class:`~embshard_dist.sharding.sequence.SequenceOutputDist`).

Math: every row lives on one rank and all ids that touch it meet in one kernel backward, so
the fused optimizer applies exactly the unsharded update for ``L = (1/N) * sum_i L_i``; the
forward moves rows without arithmetic (exact).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.sequence import PooledSequenceSharding, blocks_output_dist
from embshard_dist.sharding.tw import TwSharding
from embshard_types.vocab import ShardingType

__all__ = ["TwSequenceSharding"]


class TwSequenceSharding(PooledSequenceSharding[TwSharding]):
    """Table-wise sharding of sequence ``tables`` (each with one shard).

    Features come rank by rank, each rank's in its kernels' order.

    Args:
        tables: the table-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(TwSharding(tables, options), options, blocks_output_dist)
