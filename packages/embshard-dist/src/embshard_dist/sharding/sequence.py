"""What the sequence-embedding strategies share: their protocol, context and output dists.

An EmbeddingCollection returns one row per id. Its strategies (``dp_seq``, ``tw_seq``,
``rw_seq``, ``cw_seq``) reuse the embedding-bag strategies' input dists, layouts and lookups
(the lookup builds sequence kernels for tables with pooling NONE) and differ only in the
output dist::

    KeyedJaggedTensor (caller's local batch)
      -> input dist   the pooled strategy's: select, permute / bucketize, KJT all-to-all
      -> lookup       the pooled strategy's grouped kernels: every id's row, flattened
      -> output dist  sequence all-to-all of the rows back to the ranks whose ids they are
                      (none for data-parallel); Awaitable[{feature: [ids, dim] rows}]

:class:`SequenceOutputDist` does it for TW, CW and RW: rank ``s`` cuts each feature's rows by
the rank the ids came from and sends rank ``r`` its rows, feature by feature (a flat payload,
so shards of different widths travel together); rank ``r`` cuts what it receives into
``(source, feature)`` blocks, whose sizes it knows from what it sent, and puts each feature
together: table-wise, one block; column-wise, the blocks side by side in column order;
row-wise, the blocks one after the other (bucket order), then back into the caller's id order
(from the bucketization's ``unbucketize_permute``).

The math, as for embedding bags (:mod:`.base`): gradients reaching the rows are divided by the
world size (:func:`~embshard_dist.sharding.base.scale_grad`, once per output dist), and every
row's ids meet in one kernel backward (data-parallel replicas exchange their rows), so a step
equals the unsharded collection's with ``L = (1/N) * sum_i L_i``. The forward moves rows
without arithmetic: exact.

Batch sizes may vary per feature: the input dists keep every feature's batch size per rank;
sequence kernels only need the ids, so :func:`lookup_input` hands them one bag per feature
(FBGEMM's sequence TBE refuses variable batch sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.sequence_all_to_all import SequenceEmbeddingsAllToAll
from embshard_dist.sharding.base import (
    EmbeddingBagSharding,
    ShardingOptions,
    ShardingStepContext,
    scale_grad,
)
from embshard_kernels.grouping import ShardedTableConfig
from embshard_types.awaitables import Awaitable, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.shard_spec import ShardSpec
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.vocab import CommOp, ShardingType

if TYPE_CHECKING:
    from embshard_dist.sharding._lookup import GroupedBagLookup

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
    """A sequence strategy's step context: the pooled one's, plus its lookup's input.

    Attributes:
        lookup_input: the KJT the lookup took (recorded by the sharded collection's compute);
            the output dist reads how many ids each rank sent of each feature.
    """

    lookup_input: KeyedJaggedTensor | None = None


@runtime_checkable
class EmbeddingSequenceSharding(Protocol):
    """One sequence strategy (see the module docstring)."""

    @property
    def sharding_type(self) -> ShardingType:
        """The strategy."""
        ...

    def feature_names(self) -> list[str]:
        """The features this strategy serves."""
        ...

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
    """A sequence strategy made of a pooled one and its own output dist (see the module docstring).

    The input dist, the layout (features, shard specs) and the lookup are the pooled
    strategy's; each strategy module (``dp_seq``, ``tw_seq``, ``rw_seq``, ``cw_seq``) names its
    sharding type and says how its output dist is built.

    Args:
        pooled: the pooled strategy over the same tables.
        options: where to run and how to build kernels.
        output_dist: builds the output dist from ``pooled`` and ``options``.
    """

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
        """The pooled strategy's features, in its lookup's order."""
        return self._pooled.feature_names()

    def shard_specs(self) -> dict[str, list[ShardSpec]] | None:
        """The pooled strategy's shards (``None``: data-parallel)."""
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
    """The output dist of table- and column-wise strategies: each rank's blocks sent back.

    Args:
        pooled: the pooled strategy (its features and shards per rank).
        options: its options (process group, codecs).
    """
    return SequenceOutputDist(
        options.pg,
        blocks_per_rank(pooled.features_per_rank(), pooled.tables_per_rank()),
        bucketized=False,
        codecs=options.codecs(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL),
    )


@dataclass(frozen=True)
class Block:
    """The rows of one feature that one rank's lookup produces.

    Attributes:
        feature: the feature.
        width: the local width of its table's shard.
        column: the shard's first column (column-wise), else 0.
    """

    feature: str
    width: int
    column: int = 0


def blocks_per_rank(
    features_per_rank: Sequence[Sequence[str]],
    tables_per_rank: Sequence[Sequence[ShardedTableConfig]],
) -> list[list[Block]]:
    """Per rank, a :class:`Block` per feature its lookup takes (table- and column-wise).

    Args:
        features_per_rank: per rank, its lookup's features in order.
        tables_per_rank: per rank, the shards it holds.
    """
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

    A sequence kernel returns one row per id, whatever the bags; FBGEMM's refuses batch sizes
    that vary per feature, so such a batch becomes one bag per feature holding all its ids.
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
    """Per key of a received KJT, how many of its ids came from each rank (one device read).

    Args:
        features: the lookup's input (each key's samples stacked by source rank).
        ctx: the step's context (every rank's batch size, when they do not vary per key).
    """
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
    """Sends every id's row back to the rank it came from (see the module docstring).

    Args:
        pg: the process group.
        blocks_per_rank: per rank, the blocks its lookup produces, in its lookup's order.
        bucketized: row-wise: every rank holds a row block of every feature; put each
            feature's blocks one after the other and undo the bucketization.
        codecs: quantized comm codecs of the sequence all-to-all.
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
        """``rows`` reordered rank by rank (then feature by feature), and the elements per rank."""
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

    Bucketized ids are ordered bucket, then feature, then sample; the received rows of feature
    ``f`` are ordered bucket, then sample. ``permute[i]`` is input id ``i``'s bucketized
    position ``p``; shifting ``p`` by a constant per ``(bucket, feature)`` block gives its
    position in the features' received rows put one after the other.
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
    """Data-parallel: divides the gradient by the world size (the 1/N rule); no communication.

    Args:
        features: the lookup's features, in order.
        widths: their embedding widths.
        world_size: N.
    """

    def __init__(self, features: Sequence[str], widths: Sequence[int], world_size: int) -> None:
        super().__init__()
        self._features = list(features)
        self._widths = list(widths)
        self._world = world_size

    def forward(self, rows: Tensor, ctx: SequenceStepContext) -> Awaitable[dict[str, Tensor]]:
        """Per feature, its ``[ids, dim]`` rows (this rank's batch)."""
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
