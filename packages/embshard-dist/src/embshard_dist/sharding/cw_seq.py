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

from torch import nn

from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.cw import CwSharding
from embshard_dist.sharding.sequence import SequenceOutputDist, blocks_per_rank
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, ShardingType

__all__ = ["CwSequenceSharding"]


class CwSequenceSharding:
    """Column-wise sharding of sequence ``tables`` (blocks spanning all rows, one per rank at most).

    Args:
        tables: the column-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

    sharding_type = ShardingType.COLUMN_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._pooled = CwSharding(tables, options)
        self._options = options

    def feature_names(self) -> list[str]:
        """Features in the collection's order."""
        return self._pooled.feature_names()

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return self._pooled.shard_specs()

    def create_input_dist(self) -> nn.Module:
        return self._pooled.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        return self._pooled.create_lookup()

    def create_output_dist(self) -> nn.Module:
        return SequenceOutputDist(
            self._options.pg,
            blocks_per_rank(self._pooled.features_per_rank(), self._pooled.tables_per_rank()),
            bucketized=False,
            codecs=self._options.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
        )
