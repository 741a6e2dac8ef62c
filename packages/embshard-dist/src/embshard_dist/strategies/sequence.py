"""What the sequence-embedding strategies share: their protocol, context and output dists.

A sequence strategy is a pooled one (input dist, layout, lookup) with its own output dist,
which sends every id's row back to its rank, in the caller's id order. The forward is exact;
the 1/N rule is applied once, by :func:`~embshard_dist.strategies.base.scale_grad`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.sequence_all_to_all import SequenceEmbeddingsAllToAll
from embshard_dist.strategies.base import EmbeddingBagSharding, ShardingStepContext, scale_grad
from embshard_dist.strategies.options import ShardingOptions
from embshard_kernels.grouping import ShardedTableConfig
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, ShardingType

if TYPE_CHECKING:
    from embshard_dist.strategies.lookup import GroupedBagLookup

__all__ = [
    "Block",
    "DpSequenceOutputDist",
    "EmbeddingSequenceSharding",
    "PooledSequenceSharding",
    "SequenceOutputDist",
    "SequenceStepContext",
    "blocks_per_rank",
    "blocks_output_dist",
    "id_counts",
    "lookup_input",
]


@dataclass
class SequenceStepContext(ShardingStepContext):
    """A sequence strategy's step context: the pooled one's, plus the KJT its lookup took."""

    lookup_input: KeyedJaggedTensor | None = None


@runtime_checkable
class EmbeddingSequenceSharding(Protocol):
    """One sequence strategy (see the module docstring)."""

    @property
    def sharding_type(self) -> ShardingType: ...

    def feature_names(self) -> list[str]: ...

    def shard_specs(self) -> dict[str, list[ShardSpec]] | None:
        """Every shard of every table (``None``: data-parallel, whole tables everywhere)."""
        ...

    def create_input_dist(self) -> nn.Module:
        """``(caller's KJT, ctx) -> Awaitable[Awaitable[KJT]]``: this rank's lookup input."""
        ...

    def create_lookup(self) -> GroupedBagLookup:
        """``KJT -> Tensor``: the rows of every id, flattened (see :func:`lookup_input`)."""
        ...

    def create_output_dist(self) -> nn.Module:
        """``(rows, ctx) -> Awaitable[{feature: [its ids here, dim]}]``."""
        ...


P = TypeVar("P", bound=EmbeddingBagSharding)


class PooledSequenceSharding(Generic[P]):
    """A sequence strategy made of a pooled one and its own output dist."""

    def __init__(
        self,
        pooled: P,
        options: ShardingOptions,
        output_dist: Callable[[P, ShardingOptions], nn.Module],
    ) -> None:
        self._pooled = pooled
        self._options = options
        self._output_dist = output_dist

    def feature_names(self) -> list[str]:
        return self._pooled.feature_names()

    def shard_specs(self) -> dict[str, list[ShardSpec]] | None:
        return self._pooled.shard_specs()

    def create_input_dist(self) -> nn.Module:
        return self._pooled.create_input_dist()

    def create_lookup(self) -> GroupedBagLookup:
        return self._pooled.create_lookup()

    def create_output_dist(self) -> nn.Module:
        return self._output_dist(self._pooled, self._options)


class _PerRankLayout(Protocol):
    def features_per_rank(self) -> list[list[str]]: ...

    def tables_per_rank(self) -> list[list[ShardedTableConfig]]: ...


def blocks_output_dist(pooled: _PerRankLayout, options: ShardingOptions) -> SequenceOutputDist:
    """The output dist of table- and column-wise strategies: each rank's blocks sent back."""
    return SequenceOutputDist(
        options.pg,
        blocks_per_rank(pooled.features_per_rank(), pooled.tables_per_rank()),
        bucketized=False,
        codecs=options.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
    )


@dataclass(frozen=True)
class Block:
    """The rows of one feature that one rank's lookup produces (``column``: the shard's first)."""

    feature: str
    width: int
    column: int = 0


def blocks_per_rank(
    features_per_rank: Sequence[Sequence[str]],
    tables_per_rank: Sequence[Sequence[ShardedTableConfig]],
) -> list[list[Block]]:
    """Per rank, a :class:`Block` per feature its lookup takes (table- and column-wise)."""
    out = []
    for features, tables in zip(features_per_rank, tables_per_rank, strict=True):
        by_feature = {f: t for t in tables for f in t.feature_names}
        blocks = []
        for feature in features:
            table = by_feature[feature]
            assert table.local_metadata is not None
            blocks.append(Block(feature, table.cols, table.local_metadata.offsets[1]))
        out.append(blocks)
    return out


def lookup_input(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """What a sequence lookup takes: ``features``, or one bag per feature if batches vary.

    FBGEMM's sequence TBE refuses variable batch sizes, and only the ids matter.
    """
    if not features.variable_stride_per_key():
        return features
    counts = features.length_per_key()
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        lengths=torch.tensor(counts, dtype=features.lengths().dtype, device=features.device()),
        stride=1,
        length_per_key=counts,
        allow_duplicate_keys=len(set(features.keys())) < len(features.keys()),
    )


def id_counts(features: KeyedJaggedTensor, ctx: ShardingStepContext) -> list[list[int]]:
    """Per key of a received KJT, how many of its ids came from each rank (one device read)."""
    if features.variable_stride_per_key():
        strides = features.stride_per_key_per_rank()
    else:
        assert ctx.batch_size_per_rank is not None
        strides = [list(ctx.batch_size_per_rank)] * len(features.keys())
    world = len(strides[0]) if strides else 0
    sizes = torch.tensor([s for per_key in strides for s in per_key], dtype=torch.long)
    lengths = features.lengths().long()
    segment = torch.repeat_interleave(
        torch.arange(sizes.numel(), device=lengths.device), sizes.to(lengths.device)
    )
    counts = torch.zeros(sizes.numel(), dtype=torch.long, device=lengths.device)
    counts.index_add_(0, segment, lengths)
    flat = counts.tolist()
    return [flat[k * world : (k + 1) * world] for k in range(len(strides))]


class SequenceOutputDist(nn.Module):
    """Sends every id's row back to the rank it came from.

    Args:
        bucketized: row-wise: put each feature's blocks one after the other and undo the
            bucketization.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        blocks_per_rank: Sequence[Sequence[Block]],
        *,
        bucketized: bool,
        codecs: QuantizedCommCodecs | None = None,
    ) -> None:
        super().__init__()
        self._all_to_all = SequenceEmbeddingsAllToAll(pg, codecs=codecs)
        self._blocks = [list(b) for b in blocks_per_rank]
        self._world = len(self._blocks)
        self._rank = dist.get_rank(pg)
        self._bucketized = bucketized
        self._features = list(dict.fromkeys(b.feature for bs in self._blocks for b in bs))

    def forward(self, rows: Tensor, ctx: SequenceStepContext) -> Awaitable[dict[str, Tensor]]:
        """Start the all-to-all of this rank's flattened rows (its lookup's output)."""
        rows = scale_grad(rows.reshape(-1), self._world)
        send, input_splits = self._send_layout(rows, ctx)
        assert ctx.sent_features is not None
        sent = ctx.sent_features.length_per_key()
        counts: list[list[int]] = []
        for blocks in self._blocks:
            counts.append(sent[: len(blocks)])
            sent = sent[len(blocks) :]
        output_splits = [
            sum(n * b.width for n, b in zip(c, blocks, strict=True))
            for c, blocks in zip(counts, self._blocks, strict=True)
        ]
        started = self._all_to_all(send, input_splits, output_splits)
        return _Assembled(started, self, counts, output_splits, ctx.unbucketize_permute)

    def _send_layout(self, rows: Tensor, ctx: SequenceStepContext) -> tuple[Tensor, list[int]]:
        """``rows`` reordered rank by rank, then feature by feature, and the elements per rank."""
        mine = self._blocks[self._rank]
        if not mine:
            return rows, [0] * self._world
        assert ctx.lookup_input is not None
        counts = id_counts(ctx.lookup_input, ctx)
        sizes = [sum(c) * b.width for c, b in zip(counts, mine, strict=True)]
        pieces: list[list[Tensor]] = [[] for _ in range(self._world)]
        for block_rows, c, b in zip(rows.split(sizes), counts, mine, strict=True):
            for r, piece in enumerate(block_rows.split([n * b.width for n in c])):
                pieces[r].append(piece)
        per_rank = zip(*counts, strict=True)
        splits = [sum(n * b.width for n, b in zip(cs, mine, strict=True)) for cs in per_rank]
        return torch.cat([p for per_rank in pieces for p in per_rank]), splits

    def assemble(
        self, received: Tensor, counts: list[list[int]], splits: list[int], permute: Tensor | None
    ) -> dict[str, Tensor]:
        """Per feature, its rows in the caller's id order, from what arrived."""
        parts: dict[str, list[tuple[int, Tensor]]] = {f: [] for f in self._features}
        for part, c, blocks in zip(received.split(splits), counts, self._blocks, strict=True):
            pieces = part.split([n * b.width for n, b in zip(c, blocks, strict=True)])
            for piece, b in zip(pieces, blocks, strict=True):
                parts[b.feature].append((b.column, piece.view(-1, b.width)))
        if self._bucketized:
            assert permute is not None
            return _unbucketize(parts, counts, permute)
        return {
            f: blocks[0][1]
            if len(blocks) == 1
            else torch.cat([t for _, t in sorted(blocks, key=lambda b: b[0])], dim=1)
            for f, blocks in parts.items()
        }


def _unbucketize(
    parts: dict[str, list[tuple[int, Tensor]]], counts: list[list[int]], permute: Tensor
) -> dict[str, Tensor]:
    """Row-wise: every feature's bucket blocks in the caller's id order.

    Shifting id ``i``'s bucketized position ``permute[i]`` by a constant per (bucket, feature)
    block gives its position in the features' received rows put one after the other.
    """
    features = list(parts)
    num_features, buckets = len(features), len(counts)
    per_feature = [sum(counts[s][f] for s in range(buckets)) for f in range(num_features)]
    feature_start = [sum(per_feature[:f]) for f in range(num_features)]
    shifts, at, before = [], 0, [0] * num_features
    for s in range(buckets):
        for f in range(num_features):
            shifts.append(feature_start[f] + before[f] - at)
            at += counts[s][f]
            before[f] += counts[s][f]
    device = permute.device
    sizes = torch.tensor([n for c in counts for n in c], dtype=torch.long, device=device)
    block = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes)
    shift = torch.tensor(shifts, dtype=torch.long, device=device)[block]
    position = permute + shift[permute]
    out = {}
    for f, feature in enumerate(features):
        rows = torch.cat([t for _, t in parts[feature]])
        start = feature_start[f]
        index = position[start : start + per_feature[f]] - start
        out[feature] = rows.index_select(0, index)
    return out


class _Assembled(Awaitable[dict[str, Tensor]]):
    def __init__(
        self,
        started: Awaitable[Tensor],
        dist_module: SequenceOutputDist,
        counts: list[list[int]],
        splits: list[int],
        permute: Tensor | None,
    ) -> None:
        super().__init__()
        self._started = started
        self._dist = dist_module
        self._counts = counts
        self._splits = splits
        self._permute = permute

    def _wait_impl(self) -> dict[str, Tensor]:
        return self._dist.assemble(self._started.wait(), self._counts, self._splits, self._permute)


class DpSequenceOutputDist(nn.Module):
    """Data-parallel: divides the gradient by the world size (the 1/N rule); no communication."""

    def __init__(self, features: Sequence[str], widths: Sequence[int], world_size: int) -> None:
        super().__init__()
        self._features = list(features)
        self._widths = list(widths)
        self._world = world_size

    def forward(self, rows: Tensor, ctx: SequenceStepContext) -> Awaitable[dict[str, Tensor]]:
        if not self._features:
            return NoWait({})
        assert ctx.lookup_input is not None
        counts = ctx.lookup_input.length_per_key()
        rows = scale_grad(rows.reshape(-1), self._world)
        pieces = rows.split([n * w for n, w in zip(counts, self._widths, strict=True)])
        return NoWait(
            {
                f: piece.view(-1, w)
                for f, w, piece in zip(self._features, self._widths, pieces, strict=True)
            }
        )
