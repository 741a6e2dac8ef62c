"""Row-wise quantized inference that equals the unsharded collection exactly: rows are fetched.

Summing partial pools across ranks (the training strategy's reduce-scatter) changes the order
of a bag's fp32 sum. Here the flow is instead:

    input dist   bucketize each id to the rank that owns its row (``RwInputDist``)
    lookup       the owner gathers each id's packed row as stored (scale, bias, padding)
    output dist  the packed rows go back (``SequenceOutputDist``), in the caller's id order,
                 and the caller pools them with FBGEMM's quantized kernel

so every bag is pooled by the same kernel, from the same bytes, in the same order as in the
unsharded ``QuantEmbeddingBagCollection``. An id costs its packed row on the wire (``dim`` bytes
plus 4 for INT8) instead of a share of a pooled fp32 row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from embshard_dist.strategies.base import BagTable, FeatureSelector, ShardingStepContext
from embshard_dist.strategies.lookup import GroupedBagLookup
from embshard_dist.strategies.options import ShardingOptions
from embshard_dist.strategies.rw import RwInputDist, RwSharding
from embshard_dist.strategies.sequence import Block, SequenceOutputDist, SequenceStepContext
from embshard_kernels.quant import QuantBatchedEmbeddingBag, pool_packed_rows, stored_row_bytes
from embshard_types.awaitables import Awaitable
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, ShardingType

__all__ = ["RwRowFetchSharding", "fetch_rows"]


class RwRowFetchSharding:
    """Row-wise sharding of quantized ``tables`` whose lookups fetch packed rows (see module).

    Args: as :class:`~embshard_dist.strategies.rw.RwSharding`, whose layout, input dist and
    shards it reuses.
    """

    sharding_type = ShardingType.ROW_WISE

    def __init__(self, tables: Sequence[BagTable], options: ShardingOptions) -> None:
        self._rw = RwSharding(tables, options)
        self._options = options
        self._by_feature = {f: t for t in tables for f in t.config.feature_names}

    def feature_names(self) -> list[str]:
        return self._rw.feature_names()

    def embedding_dims(self) -> list[int]:
        return self._rw.embedding_dims()

    def shard_specs(self) -> dict[str, list[ShardSpec]]:
        return self._rw.shard_specs()

    def create_input_dist(self) -> nn.Module:
        features = self.feature_names()
        tables = {f: t.name for f, t in self._by_feature.items()}
        inner = RwInputDist(
            self._options.pg,
            features,
            self._rw.row_boundaries(),
            tables,
            is_weighted=self._options.is_weighted,
            keep_lengths=True,
            keep_permute=True,
        )
        return _KeepInput(
            FeatureSelector(features, tables, is_weighted=self._options.is_weighted), inner
        )

    def create_lookup(self) -> GroupedBagLookup:
        """This rank's row blocks in quantized kernels (read by :func:`fetch_rows`)."""
        return self._rw.create_lookup()

    def create_output_dist(self) -> nn.Module:
        return RowFetchOutputDist(self._options, self.feature_names(), self._by_feature)


class _KeepInput(nn.Module):
    """The row-wise input dist, keeping the caller's selected features for the pooling."""

    carries_input_status = True

    def __init__(self, select: FeatureSelector, inner: RwInputDist) -> None:
        super().__init__()
        self._select = select
        self.inner = inner

    def forward(
        self, features: KeyedJaggedTensor, ctx: ShardingStepContext
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        selected = self._select(features)
        ctx.input_features = selected
        started: Awaitable[Awaitable[KeyedJaggedTensor]] = self.inner(selected, ctx)
        return started


def _stored_rows(lookup: GroupedBagLookup) -> dict[str, Tensor]:
    """Feature -> the stored rows of this rank's block of its table (live views)."""
    out = {}
    for kernel in lookup.kernels:
        if not isinstance(kernel, QuantBatchedEmbeddingBag):
            raise TypeError(f"row fetching reads quantized kernels, got {type(kernel).__name__}")
        tables = kernel.config.embedding_tables
        for table, rows in zip(tables, kernel.full_rows(), strict=True):
            out.update(dict.fromkeys(table.feature_names, rows))
    return out


def fetch_rows(lookup: GroupedBagLookup, features: KeyedJaggedTensor) -> Tensor:
    """Owner side: every received id's packed row as stored (flat uint8, feature by feature).

    ``features`` holds this rank's local row numbers (the row-wise input dist's output).
    """
    stored = _stored_rows(lookup)
    pieces = [
        stored[feature].index_select(0, ids.long()).reshape(-1)
        for feature, ids in zip(
            features.keys(), features.values().split(features.length_per_key()), strict=True
        )
    ]
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=features.device())
    return torch.cat(pieces)


class RowFetchOutputDist(nn.Module):
    """Sends the fetched rows back and pools them on the caller's rank (see the module)."""

    def __init__(
        self, options: ShardingOptions, features: Sequence[str], by_feature: dict[str, BagTable]
    ) -> None:
        super().__init__()
        self._features = list(features)
        self._tables = [by_feature[f] for f in self._features]
        self._row_bytes = [
            stored_row_bytes(t.config.embedding_dim, t.config.data_type, options.device)
            for t in self._tables
        ]
        blocks = [Block(f, w) for f, w in zip(self._features, self._row_bytes, strict=True)]
        self._rows = SequenceOutputDist(
            options.pg,
            [blocks] * options.world_size,
            bucketized=True,
            codecs=options.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
        )
        self._device = options.device

    def forward(self, rows: Tensor, ctx: SequenceStepContext) -> Awaitable[Tensor]:
        return _Pooled(self._rows(rows, ctx), self, ctx)

    def pool(self, rows: dict[str, Tensor], ctx: ShardingStepContext) -> Tensor:
        """``[batch, sum of dims]``: each feature's bags pooled from its fetched rows."""
        selected = ctx.input_features
        assert selected is not None and ctx.bag_lengths is not None
        lengths = ctx.bag_lengths
        weights = selected.weights_or_none()
        per_weight = weights.split(selected.length_per_key()) if weights is not None else None
        modes = sorted({t.config.pooling.value for t in self._tables})
        if len(modes) == 1:
            return self._pool(range(len(self._features)), rows, lengths, per_weight)
        blocks: list[Tensor | None] = [None] * len(self._features)
        for mode in modes:
            members = [i for i, t in enumerate(self._tables) if t.config.pooling.value == mode]
            out = self._pool(members, rows, lengths, per_weight)
            dims = [self._tables[i].config.embedding_dim for i in members]
            for i, block in zip(members, out.split(dims, dim=1), strict=True):
                blocks[i] = block
        return torch.cat([b for b in blocks if b is not None], dim=1)

    def _pool(
        self,
        members: Sequence[int],
        rows: dict[str, Tensor],
        lengths: Tensor,
        weights: Sequence[Tensor] | None,
    ) -> Tensor:
        fetched = [rows[self._features[i]] for i in members]
        counts = [r.shape[0] for r in fetched]
        dims = [self._tables[i].config.embedding_dim for i in members]
        data_type = self._tables[members[0]].config.data_type
        bags = lengths[list(members)].reshape(-1).long()
        offsets = torch.zeros(bags.numel() + 1, dtype=torch.long, device=bags.device)
        torch.cumsum(bags, 0, out=offsets[1:])
        indices = torch.cat([torch.arange(n, device=bags.device) for n in counts])
        flat = torch.cat([r.reshape(-1) for r in fetched])
        starts = [0]
        for r in fetched:
            starts.append(starts[-1] + r.numel())
        picked = None if weights is None else torch.cat([weights[i] for i in members]).float()
        return pool_packed_rows(
            flat,
            starts[:-1],
            dims,
            data_type,
            indices,
            offsets,
            self._tables[members[0]].config.pooling,
            picked,
        )


class _Pooled(Awaitable[Tensor]):
    def __init__(
        self, rows: Awaitable[dict[str, Tensor]], dist: RowFetchOutputDist, ctx: ShardingStepContext
    ) -> None:
        super().__init__()
        self._rows = rows
        self._dist = dist
        self._ctx = ctx

    def _wait_impl(self) -> Tensor:
        return self._dist.pool(self._rows.wait(), self._ctx)
