"""Batch sizes that vary per feature (TorchRec's VBE) for sharded embedding-bag collections.

Output dists for the variable-batch layout of DP, TW, CW and RW; every feature's bags are then
gathered into the batch's rows with its ``inverse_indices`` (required), so the output has one
row per sample. Training equals the unsharded collection's on the full batch to float rounding;
every rank must pass the same kind of batch. A variable batch that cannot be served is refused
on every rank alike (:func:`variable_batch_verdict` adds its reason to the input status the KJT
all-to-all carries); :func:`check_variable_batch` is the same check on this rank alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from embshard_dist.comm.kjt_all_to_all import STATUS_WORDS, InputStatus
from embshard_dist.comm.reduce_scatter import PooledEmbeddingsReduceScatter
from embshard_dist.comm.sequence_all_to_all import SequenceEmbeddingsAllToAll
from embshard_dist.strategies.base import BagTable, ShardingStepContext, scale_grad
from embshard_dist.strategies.sequence import Block, blocks_per_rank
from embshard_types.awaitables import Awaitable, LazyAwaitable, LazyGetItemMixin, NoWait
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.vocab import CommOp, PoolingType, ShardingType

__all__ = [
    "VARIABLE_BATCH_SHARDING_TYPES",
    "VariableBatchKeyedTensorAwaitable",
    "VariableBatchError",
    "check_variable_batch",
    "variable_batch_verdict",
    "variable_batch_output_dists",
]

VARIABLE_BATCH_SHARDING_TYPES = (
    ShardingType.DATA_PARALLEL,
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
)


class VariableBatchError(ValueError):
    """A batch whose sizes vary per feature cannot be served by this collection.

    Attributes:
        rank: the rank whose batch it was (``None`` when checked on one rank alone).
    """

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class _Refusal(IntEnum):
    """Why a variable batch is refused; codes above every ``embshard_types`` ``Problem`` code,
    so they share the input status words with the input checks' problems."""

    UNSUPPORTED_TYPES = 101
    NO_INVERSE_INDICES = 102
    INVERSE_MISSING_FEATURE = 103
    INVERSE_OUT_OF_RANGE = 104


_CODES = frozenset(int(r) for r in _Refusal)


def check_variable_batch(
    features: KeyedJaggedTensor, keys: Sequence[str], shardings: Sequence[Any]
) -> None:
    """Raise unless a variable-batch ``features`` can be served (no collective, this rank only).

    Raises:
        VariableBatchError: (a ``ValueError``) naming the feature and how to fix it.
    """
    words = _refusal(features, keys, shardings)
    if words is not None:
        raise VariableBatchError(_message(words, keys, shardings), None)


def variable_batch_verdict(
    features: KeyedJaggedTensor,
    keys: Sequence[str],
    shardings: Sequence[Any],
    status: InputStatus,
) -> tuple[KeyedJaggedTensor, InputStatus]:
    """The batch to route and the verdict to send, with the variable-batch checks added.

    Every rank calls this with the input checks' ``status`` (a variable batch or not): the
    returned status builds, on every rank alike, the :class:`VariableBatchError` of any rank
    whose variable batch cannot be served, so it travels in the KJT all-to-all's first exchange
    like the input checks' verdict. A refused batch is replaced by an empty one with ``keys``.
    """
    combined = InputStatus(status.words, _error_builder(keys, shardings, status))
    if status.words[0] or not features.variable_stride_per_key():
        return features, combined
    words = _refusal(features, keys, shardings)
    if words is None:
        return features, combined
    return _empty_batch(features, keys), InputStatus(tuple(words), combined.error)


def _error_builder(
    keys: Sequence[str], shardings: Sequence[Any], status: InputStatus
) -> Callable[[int, list[int]], Exception]:
    names = list(keys)
    kinds = list(shardings)

    def error(rank: int, words: list[int]) -> Exception:
        if words[0] in _CODES:
            return VariableBatchError(
                f"the input on rank {rank}: {_message(words, names, kinds)}", rank
            )
        return status.error(rank, words)

    return error


def _empty_batch(features: KeyedJaggedTensor, keys: Sequence[str]) -> KeyedJaggedTensor:
    device = features.device()
    return KeyedJaggedTensor(
        list(keys),
        torch.empty(0, dtype=torch.int64, device=device),
        weights=None if features.weights_or_none() is None else torch.empty(0, device=device),
        lengths=torch.empty(0, dtype=torch.int32, device=device),
        stride=0,
        length_per_key=[0] * len(keys),
    )


def _refusal(
    features: KeyedJaggedTensor, keys: Sequence[str], shardings: Sequence[Any]
) -> list[int] | None:
    """The status words of the first reason ``features`` cannot be served, or ``None``."""
    if any(s.sharding_type not in VARIABLE_BATCH_SHARDING_TYPES for s in shardings):
        return _words(_Refusal.UNSUPPORTED_TYPES)
    strides = dict(zip(features.keys(), features.stride_per_key(), strict=True))
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        first = strides.get(keys[0], 0) if keys else 0
        other = next((i for i, k in enumerate(keys) if strides.get(k, first) != first), 0)
        return _words(_Refusal.NO_INVERSE_INDICES, other, strides.get(keys[other], 0), first)
    inverse_keys, table = list(inverse[0]), inverse[1]
    for i, key in enumerate(keys):
        if key not in inverse_keys:
            return _words(_Refusal.INVERSE_MISSING_FEATURE, i, len(inverse_keys))
        row = table[inverse_keys.index(key)]
        if row.numel():
            low, high = int(row.min()), int(row.max())
            if not 0 <= low <= high < strides[key]:
                return _words(_Refusal.INVERSE_OUT_OF_RANGE, i, strides[key], low, high)
    return None


def _words(code: _Refusal, *fields: int) -> list[int]:
    return [int(code), *fields, *[0] * (STATUS_WORDS - 1 - len(fields))]


def _message(words: Sequence[int], keys: Sequence[str], shardings: Sequence[Any]) -> str:
    """The refusal's text from its status words (the same on every rank)."""
    code, feature, a, b, c, _ = words
    allowed = [k.value for k in VARIABLE_BATCH_SHARDING_TYPES]
    if code == _Refusal.UNSUPPORTED_TYPES:
        kinds = {s.sharding_type.value for s in shardings}
        return (
            "the batch's sizes vary per feature, which sharding type(s) "
            f"{sorted(kinds - set(allowed))} of this collection do not support; use {allowed} "
            "for its tables, or give every feature the same batch size"
        )
    if code == _Refusal.NO_INVERSE_INDICES:
        sizes = f"feature {keys[0]!r}: {b}" + (
            f", feature {keys[feature]!r}: {a}" if feature else ""
        )
        return (
            f"the batch's sizes vary per feature ({sizes}) but it has no inverse_indices; a "
            "pooled collection returns one row per sample of the batch, so pass "
            "inverse_indices=(keys, tensor[len(keys), batch]) mapping each sample to its "
            "feature's bag (as TorchRec requires)"
        )
    if code == _Refusal.INVERSE_MISSING_FEATURE:
        return (
            f"the batch's inverse_indices have no row for feature {keys[feature]!r} (they cover "
            f"{a} keys); give them a row for every feature of the collection"
        )
    return (
        f"feature {keys[feature]!r}: inverse indices must lie in [0, {a}) (its batch size), got "
        f"values in [{b}, {c}]"
    )


def _local_batches(ctx: ShardingStepContext, features: Sequence[str]) -> list[int]:
    assert ctx.input_features is not None
    given = dict(zip(ctx.input_features.keys(), ctx.input_features.stride_per_key(), strict=True))
    return [given[f] for f in features]


class _AllToAllDist(nn.Module):
    """Table- and column-wise: a flat all-to-all, then column blocks side by side."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        blocks: list[list[Block]],
        codecs: QuantizedCommCodecs | None,
    ) -> None:
        super().__init__()
        self._blocks = blocks
        self._world = len(blocks)
        self._rank = dist.get_rank(pg)
        self._all_to_all = SequenceEmbeddingsAllToAll(pg, codecs=codecs)

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[dict[str, Tensor]]:
        flat = scale_grad(embeddings.reshape(-1), self._world)
        mine = self._blocks[self._rank]
        if mine:
            per_rank = ctx.batch_size_per_feature_per_rank
            assert per_rank is not None
            sends = [
                sum(b.width * per_rank[f][r] for f, b in enumerate(mine))
                for r in range(self._world)
            ]
        else:
            sends = [0] * self._world
        batches = [_local_batches(ctx, [b.feature for b in blocks]) for blocks in self._blocks]
        recvs = [
            sum(n * b.width for n, b in zip(ns, blocks, strict=True))
            for ns, blocks in zip(batches, self._blocks, strict=True)
        ]
        started = self._all_to_all(flat, sends, recvs)
        return _Blocks(started, self._blocks, batches, recvs)


class _Blocks(Awaitable[dict[str, Tensor]]):
    def __init__(
        self,
        started: Awaitable[Tensor],
        blocks: list[list[Block]],
        batches: list[list[int]],
        splits: list[int],
    ) -> None:
        super().__init__()
        self._started = started
        self._blocks = blocks
        self._batches = batches
        self._splits = splits

    def _wait_impl(self) -> dict[str, Tensor]:
        parts: dict[str, list[tuple[int, Tensor]]] = {}
        received = self._started.wait().split(self._splits)
        for part, blocks, ns in zip(received, self._blocks, self._batches, strict=True):
            pieces = part.split([n * b.width for n, b in zip(ns, blocks, strict=True)])
            for piece, b, n in zip(pieces, blocks, ns, strict=True):
                parts.setdefault(b.feature, []).append((b.column, piece.view(n, b.width)))
        return {
            f: torch.cat([t for _, t in sorted(blocks, key=lambda b: b[0])], dim=1)
            for f, blocks in parts.items()
        }


class _ReduceScatterDist(nn.Module):
    """Row-wise: a reduce-scatter of the flat partial sums (MEAN: then divided)."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        features: list[str],
        dims: list[int],
        mean: list[bool],
        codecs: QuantizedCommCodecs | None,
    ) -> None:
        super().__init__()
        self._features = features
        self._dims = dims
        self._mean = mean
        self._world = dist.get_world_size(pg)
        self._reduce_scatter = PooledEmbeddingsReduceScatter(pg, codecs=codecs)

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[dict[str, Tensor]]:
        per_rank = ctx.batch_size_per_feature_per_rank
        assert per_rank is not None
        sends = [
            sum(d * per_rank[f][r] for f, d in enumerate(self._dims)) for r in range(self._world)
        ]
        flat = scale_grad(embeddings.reshape(-1, 1), self._world)
        started = self._reduce_scatter(flat, sends)
        batches = _local_batches(ctx, self._features)
        assert ctx.input_features is not None
        given = ctx.input_features.to_dict()
        pairs = zip(self._features, self._mean, strict=True)
        lengths = [given[f].lengths() if m else None for f, m in pairs]
        return _Summed(started, self._features, self._dims, batches, lengths)


class _Summed(Awaitable[dict[str, Tensor]]):
    def __init__(
        self,
        started: Awaitable[Tensor],
        features: list[str],
        dims: list[int],
        batches: list[int],
        mean_lengths: list[Tensor | None],
    ) -> None:
        super().__init__()
        self._started = started
        self._features = features
        self._dims = dims
        self._batches = batches
        self._lengths = mean_lengths

    def _wait_impl(self) -> dict[str, Tensor]:
        flat = self._started.wait().reshape(-1)
        sizes = [n * d for n, d in zip(self._batches, self._dims, strict=True)]
        out = {}
        for f, piece, n, d, lengths in zip(
            self._features, flat.split(sizes), self._batches, self._dims, self._lengths, strict=True
        ):
            rows = piece.view(n, d)
            if lengths is not None:
                rows = rows / lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)
            out[f] = rows
        return out


class _LocalDist(nn.Module):
    """Data-parallel: the local blocks, nothing to send."""

    def __init__(self, features: list[str], dims: list[int], world_size: int) -> None:
        super().__init__()
        self._features = features
        self._dims = dims
        self._world = world_size

    def forward(self, embeddings: Tensor, ctx: ShardingStepContext) -> Awaitable[dict[str, Tensor]]:
        flat = scale_grad(embeddings.reshape(-1), self._world)
        batches = _local_batches(ctx, self._features)
        pieces = flat.split([n * d for n, d in zip(batches, self._dims, strict=True)])
        return NoWait(
            {
                f: piece.view(n, d)
                for f, piece, n, d in zip(self._features, pieces, batches, self._dims, strict=True)
            }
        )


def variable_batch_output_dists(
    shardings: Sequence[Any],
    tables: Mapping[str, BagTable],
    pg: dist.ProcessGroup | None,
    codecs: Mapping[str, QuantizedCommCodecs],
) -> list[nn.Module]:
    """One variable-batch output dist per strategy: ``(embeddings, ctx) -> {feature: rows}``.

    Raises:
        ValueError: a strategy is not of :data:`VARIABLE_BATCH_SHARDING_TYPES`.
    """
    pooling = {f: t.config.pooling for t in tables.values() for f in t.config.feature_names}
    world = dist.get_world_size(pg)
    out: list[nn.Module] = []
    for sharding in shardings:
        kind = sharding.sharding_type
        if kind in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            blocks = blocks_per_rank(sharding.features_per_rank(), sharding.tables_per_rank())
            codec = codecs.get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value)
            out.append(_AllToAllDist(pg, blocks, codec))
        elif kind is ShardingType.ROW_WISE:
            features = sharding.feature_names()
            mean = [pooling[f] is PoolingType.MEAN for f in features]
            codec = codecs.get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value)
            out.append(_ReduceScatterDist(pg, features, sharding.embedding_dims(), mean, codec))
        elif kind is ShardingType.DATA_PARALLEL:
            out.append(_LocalDist(sharding.feature_names(), sharding.embedding_dims(), world))
        else:
            raise ValueError(
                f"sharding type {kind.value!r} does not support batch sizes that vary per "
                f"feature; use one of {[k.value for k in VARIABLE_BATCH_SHARDING_TYPES]}"
            )
    return out


class VariableBatchKeyedTensorAwaitable(LazyGetItemMixin[str, Tensor], LazyAwaitable[KeyedTensor]):
    """Every feature's bags gathered into the batch's rows, features in the caller's order."""

    def __init__(
        self,
        pending: Sequence[Awaitable[dict[str, Tensor]]],
        keys: list[str],
        dims: list[int],
        features: KeyedJaggedTensor,
    ) -> None:
        super().__init__()
        self._pending = list(pending)
        self._keys = keys
        self._dims = dims
        self._features = features

    def _wait_impl(self) -> KeyedTensor:
        rows: dict[str, Tensor] = {}
        for awaitable in self._pending:
            rows.update(awaitable.wait())
        inverse_keys, inverse = self._features.inverse_indices()
        position = {k: i for i, k in enumerate(inverse_keys)}
        columns = [
            rows[f].index_select(0, inverse[position[f]].to(rows[f].device).long())
            for f in self._keys
        ]
        return KeyedTensor(self._keys, self._dims, torch.cat(columns, dim=1))
