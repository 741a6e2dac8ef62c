"""Dists of strategies that place whole columns of a table on one rank (TW, CW).

Features go out by one KJT all-to-all, pooled rows come back by one pooled all-to-all whose
backward applies the 1/N rule. Exact; ranks may have different batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.strategies.base import (
    FeatureSelector,
    ReceivedFeatures,
    ShardingStepContext,
    to_wire,
)
from embshard_types.awaitables import Awaitable
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


class RoutedInputDist(nn.Module):
    """Sends each rank the features of the shards it holds, in its lookup's order.

    The all-to-all's first exchange carries ``ctx.input_status`` (see ``carries_input_status``).
    """

    carries_input_status = True

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
        started = self._all_to_all(ctx.sent_features, ctx.input_status)
        return ReceivedFeatures(
            started,
            ctx,
            selected.stride(),
            self._world,
            variable_batch=selected.variable_stride_per_key(),
        )


class PooledOutputDist(nn.Module):
    """Returns pooled rows to the ranks whose samples they are.

    Args:
        columns: output column ``j`` is received column ``columns[j]`` (``None``: in order).
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
        # The 1/N rule, applied by the all-to-all's backward.
        self._all_to_all = PooledEmbeddingsAllToAll(
            pg, dim_sum_per_rank, codecs=codecs, columns=columns, grad_scale=1.0 / self._world
        )

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        """Start the all-to-all of ``[sum of batches, local width]`` pooled rows."""
        return self._all_to_all(embeddings, ctx.batch_size_per_rank)
