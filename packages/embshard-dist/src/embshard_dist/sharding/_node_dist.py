"""The dists of strategies that cut tables row-wise over the ranks of one node (TWRW, grid).

A *unit* is a table (table-row-wise) or one column block of a table (grid) placed on one node
and cut into one row block per rank of that node. With ``N`` nodes of ``L`` ranks (``W = N L``):

Input (:class:`NodeRowWiseInputDist`): every unit's features are selected (a feature read by
units on several nodes is repeated), their ids are bucketized over the ``W`` ranks with the
unit's row boundaries padded by empty blocks outside its node
(:func:`~embshard_dist.sharding.bucketize.bucketize_kjt`), each rank keeps only the features of
its node's units (one ``permute``) and one KJT all-to-all delivers them. The all-to-all orders
the received samples *staggered* (``KJTAllToAll(stagger=N)``): first the samples of the ranks
at local position 0 of every node, node by node, then those at position 1, ... so that the
partial sums a rank computes come grouped by the local position of the samples' ranks. The
step's ``batch_size_per_rank`` is recorded in that staggered order.

Output (:class:`NodeRowWiseOutputDist`), the reduce inside the node before crossing nodes:

1. the gradient is divided by ``W`` (the 1/N rule of :mod:`embshard_dist.sharding.base`);
2. inside the node, an all-to-all gives local rank ``l`` every node rank's partial sums for
   the samples of the ranks at position ``l`` of every node, and adds them in local-rank order
   (a reduce-scatter whose sum has a fixed order: every rank computes the same bits, whatever
   the backend);
3. across nodes, an all-to-all among the ranks at the same local position sends each node's
   summed columns to the samples' own ranks: ``[local batch, sum over nodes of their widths]``;
4. MEAN tables are divided by the full bag size (known to the samples' rank), and the columns
   are put in the strategy's output order (one ``index_select``).

Backward: the reverse all-to-alls (step 3, then the gradient of each node rank's partials,
which is the all-gather of step 2). Ranks of a node without units skip step 2 (nothing to sum);
a single node or a single rank per node skips the step that has nothing to cross.

Guarantees: exact up to the order of the sums of a bag's partial sums (per bag: the node ranks'
partials added in local-rank order); ranks may have different batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.columns import ColumnOrder
from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.sharding.base import (
    FeatureSelector,
    ReceivedFeatures,
    ShardingStepContext,
    scale_grad,
    to_wire,
)
from embshard_dist.sharding.bucketize import bucketize_kjt
from embshard_dist.sharding.nodes import NodeGroups, NodeTopology
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


def padded_boundaries(
    row_boundaries: Sequence[int], node: int, topology: NodeTopology
) -> list[int]:
    """Row boundaries over all ``W`` ranks of a unit cut over the ranks of ``node``.

    The blocks of the other nodes' ranks are empty, so bucketizing over ``W`` buckets sends
    every id to a rank of ``node``.

    Args:
        row_boundaries: the unit's ``L + 1`` boundaries over its node's ranks.
        node: the unit's node.
        topology: the nodes.
    """
    rows = int(row_boundaries[-1])
    before = node * topology.local_world_size
    after = (topology.num_nodes - node - 1) * topology.local_world_size
    return [0] * before + [int(b) for b in row_boundaries] + [rows] * after


def staggered_batches(
    batches: Sequence[int], topology: NodeTopology
) -> tuple[list[int], list[int]]:
    """From the staggered batch sizes: every local position's total, and this rank's peers'.

    Args:
        batches: every rank's batch size in the staggered order (see the module docstring).
        topology: the nodes.

    Returns:
        ``(stripes, peers)``: ``stripes[l]`` = samples of the ranks at local position ``l``;
        ``peers[n]`` = batch size of the rank of node ``n`` at this rank's local position.
    """
    n = topology.num_nodes
    stripes = [sum(batches[lr * n : (lr + 1) * n]) for lr in range(topology.local_world_size)]
    lr = topology.local_rank
    return stripes, list(batches[lr * n : (lr + 1) * n])


class NodeRowWiseInputDist(nn.Module):
    """Bucketizes every unit's ids over its node's ranks and sends them (see module docstring).

    Args:
        pg: the sharding group.
        topology: its nodes.
        features: the selected features, one entry per (unit, feature); repeats allowed.
        boundaries: per entry of ``features``, its ``W + 1`` padded row boundaries.
        wire: per rank, the positions in ``features`` its lookup takes, in its order.
        feature_tables: feature -> table, for messages.
        is_weighted: send the per-id weights.
        keep_lengths: record the bag sizes (``[len(features), batch]``) for MEAN pooling.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        topology: NodeTopology,
        features: Sequence[str],
        boundaries: Sequence[Sequence[int]],
        wire: Sequence[Sequence[int]],
        feature_tables: dict[str, str],
        *,
        is_weighted: bool,
        keep_lengths: bool,
    ) -> None:
        super().__init__()
        self._select = FeatureSelector(features, feature_tables, is_weighted=is_weighted)
        self._boundaries = [list(b) for b in boundaries]
        self._count = len(features)
        self._world = topology.world_size
        self._permute = [r * self._count + i for r, sent in enumerate(wire) for i in sent]
        self._all_to_all = KJTAllToAll(pg, [len(sent) for sent in wire], stagger=topology.num_nodes)
        self._keep_lengths = keep_lengths

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Start sending; the awaitables yield this rank's local ids for the global batch.

        Raises:
            ValueError: a feature is missing, batch sizes vary per feature, or an id is
                outside its table (before any collective; the message names the feature).
        """
        selected = self._select(features)
        if selected.variable_stride_per_key():
            raise ValueError(
                "table-row-wise and grid sharding pool one row per sample for every feature, "
                f"so all features need one batch size; got {selected.stride_per_key()} for "
                f"{selected.keys()}"
            )
        if self._keep_lengths:
            ctx.bag_lengths = selected.lengths().view(self._count, selected.stride())
        bucketized, _ = bucketize_kjt(selected, self._boundaries)
        routed = bucketized.permute(self._permute)
        started = self._all_to_all(to_wire(routed))
        return ReceivedFeatures(started, ctx, selected.stride(), self._world)


class NodeRowWiseOutputDist(nn.Module):
    """Sums partial bags inside the node, then crosses nodes (see the module docstring).

    Args:
        topology: the nodes.
        groups: this rank's intra- and cross-node groups.
        node_widths: per node, the width of its ranks' lookups (the same on each of its ranks).
        received_features: per received column (node by node), the position in the input
            dist's ``features`` of the feature it belongs to (for MEAN pooling).
        mean: per entry of the input dist's ``features``, whether its table pools by MEAN.
        columns: output column ``j`` is received column ``columns[j]`` (``None``: in order).
        reduce_codecs: codecs of the intra-node exchange (the reduce-scatter's).
        all_to_all_codecs: codecs of the cross-node all-to-all.
    """

    def __init__(
        self,
        topology: NodeTopology,
        groups: NodeGroups,
        node_widths: Sequence[int],
        received_features: Sequence[int],
        mean: Sequence[bool],
        *,
        columns: Sequence[int] | None = None,
        reduce_codecs: QuantizedCommCodecs | None = None,
        all_to_all_codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._topology = topology
        self._width = int(node_widths[topology.node])
        lws = topology.local_world_size
        self._intra: PooledEmbeddingsAllToAll | None = None
        if groups.intra is not None and self._width > 0:
            # the 1/N rule, applied by its backward as it cuts the gradient per rank
            self._intra = PooledEmbeddingsAllToAll(
                groups.intra,
                [self._width] * lws,
                codecs=reduce_codecs,
                grad_scale=1.0 / topology.world_size,
            )
        self._cross: PooledEmbeddingsAllToAll | None = None
        if groups.cross is not None:
            self._cross = PooledEmbeddingsAllToAll(
                groups.cross, list(node_widths), codecs=all_to_all_codecs
            )
        self._mean: Tensor | None = None
        self._mean_features: Tensor | None = None
        if any(mean):
            flags = torch.tensor([mean[f] for f in received_features], dtype=torch.bool)
            self._mean = flags
            self._mean_features = torch.tensor(list(received_features), dtype=torch.long)
        self._columns = ColumnOrder.of(columns)

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        """Start the intra-node exchange of ``[sum of batches (staggered), node width]``."""
        assert ctx.batch_size_per_rank is not None
        topo = self._topology
        stripes, peers = staggered_batches(ctx.batch_size_per_rank, topo)
        stage1: Awaitable[Tensor]
        if self._intra is not None:  # its backward divides by N
            stage1 = self._intra(embeddings, stripes)
            stage1.callbacks.append(self._sum_partials)
        elif topo.local_world_size > 1:  # nothing on this node: a [stripe, 0] tensor
            scaled = scale_grad(embeddings, topo.world_size)
            stage1 = NoWait(scaled.narrow(0, 0, stripes[topo.local_rank]))
        else:
            stage1 = NoWait(scale_grad(embeddings, topo.world_size))
        result = _CrossNodes(stage1, self._cross, peers)
        if self._mean is not None:
            assert ctx.bag_lengths is not None
            divisor = self._divisor(ctx.bag_lengths, embeddings.dtype)
            result.callbacks.append(lambda out: out / divisor)
        if self._columns is not None:
            result.callbacks.append(self._columns)
        return result

    def _sum_partials(self, received: Tensor) -> Tensor:
        """``[stripe, L * width]`` (each node rank's partials side by side) -> their sum, in
        local-rank order."""
        parts = received.split(self._width, dim=1)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _divisor(self, bag_lengths: Tensor, dtype: torch.dtype) -> Tensor:
        """``[batch, received columns]``: the bag size in MEAN columns, 1 elsewhere."""
        assert self._mean is not None and self._mean_features is not None
        device = bag_lengths.device
        sizes = bag_lengths.index_select(0, self._mean_features.to(device)).t()
        sizes = sizes.clamp(min=1).to(dtype)
        return torch.where(self._mean.to(device), sizes, torch.ones_like(sizes))


class _CrossNodes(Awaitable[Tensor]):
    """Waits for the intra-node stage, then runs the cross-node all-to-all."""

    def __init__(
        self,
        stage1: Awaitable[Tensor],
        cross: PooledEmbeddingsAllToAll | None,
        peers: list[int],
    ) -> None:
        super().__init__()
        self._stage1 = stage1
        self._cross = cross
        self._peers = peers

    def _wait_impl(self) -> Tensor:
        summed = self._stage1.wait()
        if self._cross is None:
            return summed
        return self._cross(summed, self._peers).wait()
