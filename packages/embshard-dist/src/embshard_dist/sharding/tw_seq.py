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

from torch import nn

from embshard_dist.sharding._lookup import GroupedBagLookup
from embshard_dist.sharding.base import BagTable, ShardingOptions
from embshard_dist.sharding.sequence import SequenceOutputDist, blocks_per_rank
from embshard_dist.sharding.tw import TwSharding
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import CommOp, ShardingType

__all__ = ["TwSequenceSharding"]


class TwSequenceSharding:
    """Table-wise sharding of sequence ``tables`` (each with one shard).

    Args:
        tables: the table-wise tables, in the collection's order.
        options: where to run and how to build kernels.
    """

    sharding_type = ShardingType.TABLE_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._pooled = TwSharding(tables, options)
        self._options = options

    def feature_names(self) -> list[str]:
        """Features rank by rank, each rank's in its kernels' order."""
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
