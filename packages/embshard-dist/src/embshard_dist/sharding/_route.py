"""The dists of strategies that place whole columns of a table on one rank (TW, CW).

:class:`RoutedInputDist` sends every feature to each rank that holds a shard it reads: one
permutation of the caller's KJT (cached; a feature read by several ranks is repeated), then
one KJT all-to-all. :class:`PooledOutputDist` sends every rank the pooled rows of its own
samples with a pooled-embeddings all-to-all, which puts the received columns in the output's
order as it assembles them and, in the backward, divides the gradient by the world size (the
1/N rule of :mod:`embshard_dist.sharding.base`: the same product ``grad * (1/N)``) as it cuts it
into per-rank chunks.

Guarantees: exact (no arithmetic in either direction besides the 1/N of the gradient); ranks
may have different batch sizes (learned from the features' all-to-all).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.sharding.base import (
    FeatureSelector,
    ReceivedFeatures,
    ShardingStepContext,
    to_wire,
)
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


class RoutedInputDist(nn.Module):
    """Sends each rank the features of the shards it holds.

    Args:
        pg: the process group.
        features_per_rank: per rank, the features its lookup takes, in its order.
        feature_tables: feature -> table, for messages.
        is_weighted: send the per-id weights.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        features_per_rank: Sequence[Sequence[str]],
        feature_tables: dict[str, str],
        *,
        is_weighted: bool,
    ) -> None:
        super().__init__()
        wire = [f for features in features_per_rank for f in features]
        self._select = FeatureSelector(wire, feature_tables, is_weighted=is_weighted)
        self._all_to_all = KJTAllToAll(pg, [len(f) for f in features_per_rank])
        self._world = len(features_per_rank)

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Start sending; the awaitables yield this rank's lookup input (batch of all ranks).

        Raises:
            ValueError: a feature is missing from ``features`` (before any collective).
        """
        selected = self._select(features)
        ctx.sent_features = to_wire(selected)
        started = self._all_to_all(ctx.sent_features)
        return ReceivedFeatures(
            started,
            ctx,
            selected.stride(),
            self._world,
            variable_batch=selected.variable_stride_per_key(),
        )


class PooledOutputDist(nn.Module):
    """Returns pooled rows to the ranks whose samples they are (see the module docstring).

    Args:
        pg: the process group.
        dim_sum_per_rank: the width each rank's lookup produces.
        columns: if given, the received column order: output column ``j`` is received
            column ``columns[j]``.
        codecs: quantized comm codecs of the all-to-all.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        dim_sum_per_rank: Sequence[int],
        *,
        columns: Sequence[int] | None = None,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._world = len(dim_sum_per_rank)
        # the 1/N rule, applied by the all-to-all's backward as it cuts the gradient per rank
        self._all_to_all = PooledEmbeddingsAllToAll(
            pg, dim_sum_per_rank, codecs=codecs, columns=columns, grad_scale=1.0 / self._world
        )

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        """Start the all-to-all of ``[sum of batches, local width]`` pooled rows."""
        return self._all_to_all(embeddings, ctx.batch_size_per_rank)
