"""Column-wise sharding of sequence tables: each table's columns are cut into blocks.

Composed from :class:`~embshard_dist.sharding.cw.CwSharding`: its input dist (one permutation, a
feature repeated per block, then a KJT all-to-all), its layout and its lookup (sequence kernels,
with row reductions for row-wise optimizers); only the output dist differs: a sequence all-to-all
returns every block of every id's row to the rank it came from, which puts the blocks side by side
in column order (:class:`~embshard_dist.sharding.sequence.SequenceOutputDist`).

Math: the forward moves column blocks without arithmetic (exact). Point-wise optimizers update
each element from its own gradient, and row-wise statistics are summed over the full row across
the blocks (see :mod:`.cw`), so every block applies the unsharded update for
``L = (1/N) * sum_i L_i``.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.cw import CwSharding
from embshard_dist.sharding.sequence import PooledSequenceSharding, blocks_output_dist
from embshard_types.vocab import ShardingType

__all__ = ["CwSequenceSharding"]


class CwSequenceSharding(PooledSequenceSharding[CwSharding]):
    """Column-wise sharding of sequence ``tables`` (blocks spanning all rows, one per rank at most).

    Features come in the collection's order.

    Args:
        tables: the column-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

    sharding_type = ShardingType.COLUMN_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        super().__init__(CwSharding(tables, options), options, blocks_output_dist)
