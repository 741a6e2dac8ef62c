"""Dists of strategies that cut a table (or column block) row-wise over one node's ranks.

Input: ids bucketized over all ranks with boundaries padded outside the unit's node (whole
features routed where every unit lies on one rank), then one KJT all-to-all whose samples arrive
staggered by local position. Output: partial bags summed
inside the node by a reduce-scatter over its ranks (the one row-wise uses; on gloo an all-to-all
summed in local-rank order), then one all-to-all across nodes; ranks may have different batch
sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.columns import ColumnOrder
from embshard_dist.comm.kjt_all_to_all import KJTAllToAll
from embshard_dist.comm.placement import Placeable, SharedOutput
from embshard_dist.comm.pooled_all_to_all import PooledEmbeddingsAllToAll
from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_dist.strategies.base import (
    FeatureSelector,
    ReceivedFeatures,
    ShardingStepContext,
    scale_grad,
    to_wire,
)
from embshard_dist.strategies.bucketize import bucketize_kjt
from embshard_dist.strategies.nodes import NodeGroups, NodeTopology
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


def padded_boundaries(
    row_boundaries: Sequence[int], node: int, topology: NodeTopology
) -> list[int]:
    """Row boundaries over all ranks of a unit cut over ``node``: other nodes' blocks are empty."""
    rows = int(row_boundaries[-1])
    before = node * topology.local_world_size
    after = (topology.num_nodes - node - 1) * topology.local_world_size
    return [0] * before + [int(b) for b in row_boundaries] + [rows] * after


def staggered_batches(
    batches: Sequence[int], topology: NodeTopology
) -> tuple[list[int], list[int]]:
    """From the staggered batch sizes: every local position's total, and this rank's peers'.

    Returns:
        ``stripes[l]``: samples of the ranks at local position ``l``; ``peers[n]``: batch size
        of node ``n``'s rank at this rank's local position.
    """
    n = topology.num_nodes
    stripes = [sum(batches[lr * n : (lr + 1) * n]) for lr in range(topology.local_world_size)]
    lr = topology.local_rank
    return stripes, list(batches[lr * n : (lr + 1) * n])


class NodeRowWiseInputDist(nn.Module):
    """Bucketizes every unit's ids over its node's ranks and sends them.

    Args:
        features: one entry per (unit, feature); repeats allowed.
        boundaries: per entry of ``features``, its padded row boundaries.
        wire: per rank, the positions in ``features`` its lookup takes, in its order.
        keep_lengths: record the bag sizes for MEAN pooling.

    The all-to-all's first exchange carries ``ctx.input_status`` (see ``carries_input_status``),
    so a batch refused on any rank makes every rank raise the same error before phase 2.
    """

    carries_input_status = True

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
        # Where every rank takes only units whose rows are all its own (one-rank nodes), the ids
        # need no bucketizing: whole features are routed, as table-wise routes them.
        self._whole = (
            [i for sent in wire for i in sent] if _whole_features(boundaries, wire) else None
        )
        self._all_to_all = KJTAllToAll(pg, [len(sent) for sent in wire], stagger=topology.num_nodes)
        self._keep_lengths = keep_lengths

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Start sending; the awaitables yield this rank's local ids for the global batch.

        Raises:
            ValueError: a feature is missing, batch sizes vary per feature, or an id is
                outside its table (before any collective).
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
        if self._whole is not None:
            routed = selected.permute(self._whole)
        else:
            bucketized, _ = bucketize_kjt(selected, self._boundaries, with_permute=False)
            routed = bucketized.permute(self._permute)
        started = self._all_to_all(to_wire(routed), ctx.input_status)
        return ReceivedFeatures(started, ctx, selected.stride(), self._world)


def _whole_features(boundaries: Sequence[Sequence[int]], wire: Sequence[Sequence[int]]) -> bool:
    """Whether each rank's entries in ``wire`` have all their rows in its own block."""
    return all(
        boundaries[i][r] == 0 and boundaries[i][r + 1] == boundaries[i][-1]
        for r, sent in enumerate(wire)
        for i in sent
    )


class NodeRowWiseOutputDist(nn.Module):
    """Sums partial bags inside the node, then crosses nodes.

    Args:
        node_widths: per node, the width of its ranks' lookups.
        received_features: per received column, its feature's position in the input dist's
            ``features`` (for MEAN pooling).
        mean: per entry of the input dist's ``features``, whether its table pools by MEAN.
        columns: output column ``j`` is received column ``columns[j]`` (``None``: in order).
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
        self._intra: PooledEmbeddingsReduceScatter | None = None
        if groups.intra is not None and self._width > 0:
            # A reduce-scatter over the node: each local rank gets its stripe summed in
            # local-rank order; the 1/N rule is applied by its backward.
            self._intra = PooledEmbeddingsReduceScatter(
                groups.intra, codecs=reduce_codecs, grad_scale=1.0 / topology.world_size
            )
        # Across nodes the all-to-all puts the columns in order as it assembles them, and with
        # one rank per node (no intra stage) it applies the 1/N rule in its backward; no copy
        # follows it. On one node a column order is applied after the reduce-scatter.
        self._scaled_by_cross = groups.cross is not None and topology.local_world_size == 1
        self._cross: PooledEmbeddingsAllToAll | None = None
        if groups.cross is not None:
            self._cross = PooledEmbeddingsAllToAll(
                groups.cross,
                list(node_widths),
                codecs=all_to_all_codecs,
                columns=columns,
                grad_scale=1.0 / topology.world_size if self._scaled_by_cross else 1.0,
            )
            if columns is not None:  # its output is in output order, so are MEAN's flags
                received_features = [received_features[c] for c in columns]
            columns = None
        self._mean: Tensor | None = None
        self._mean_features: Tensor | None = None
        if any(mean):
            flags = torch.tensor([mean[f] for f in received_features], dtype=torch.bool)
            self._mean = flags
            self._mean_features = torch.tensor(list(received_features), dtype=torch.long)
        self._columns = ColumnOrder.of(columns)

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[Tensor]:
        """Start the intra-node exchange of ``[staggered global batch, node width]``."""
        assert ctx.batch_size_per_rank is not None
        topo = self._topology
        stripes, peers = staggered_batches(ctx.batch_size_per_rank, topo)
        stage1: Awaitable[Tensor]
        if self._intra is not None:  # its backward divides by N
            stage1 = self._intra(embeddings, stripes)
        elif topo.local_world_size > 1:  # nothing on this node: a [stripe, 0] tensor
            scaled = scale_grad(embeddings, topo.world_size)
            stage1 = NoWait(scaled.narrow(0, 0, stripes[topo.local_rank]))
        elif self._scaled_by_cross:
            stage1 = NoWait(embeddings)
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

    def _divisor(self, bag_lengths: Tensor, dtype: torch.dtype) -> Tensor:
        """``[batch, received columns]``: the bag size in MEAN columns, 1 elsewhere."""
        assert self._mean is not None and self._mean_features is not None
        device = bag_lengths.device
        sizes = bag_lengths.index_select(0, self._mean_features.to(device)).t()
        sizes = sizes.clamp(min=1).to(dtype)
        return torch.where(self._mean.to(device), sizes, torch.ones_like(sizes))


class _CrossNodes(Awaitable[Tensor]):
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
        self._placement: tuple[SharedOutput, list[int]] | None = None

    def place(self, shared: SharedOutput, destinations: Sequence[int]) -> bool:
        """Have the cross-node all-to-all write into ``shared`` (see ``comm.placement``), where
        there is one and nothing transforms its output."""
        if self._cross is None or self._callbacks:
            return False
        self._placement = (shared, list(destinations))
        return True

    def _wait_impl(self) -> Tensor:
        summed = self._stage1.wait()
        if self._cross is None:
            return summed
        pending = self._cross(summed, self._peers)
        if self._placement is not None:  # a fresh all-to-all always takes it
            placed = isinstance(pending, Placeable) and pending.place(*self._placement)
            assert placed, "node dist: the cross-node all-to-all could not be placed"
        return pending.wait()
