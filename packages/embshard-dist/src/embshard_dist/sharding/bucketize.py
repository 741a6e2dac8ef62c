"""Bucketization: routing each id of a sparse batch to the row-wise shard that holds its row.

Given per feature the boundaries of its table's row blocks (``[0, b1, ..., rows]``, one block
per bucket / rank), every id ``v`` of that feature goes to the bucket ``r`` with
``b_r <= v < b_{r+1}`` and becomes the local id ``v - b_r``.

Layout of the result: bucket-major, then feature, then sample — ``lengths[(r * F + f) ... ]``
is the KJT layout of ``F`` features repeated once per bucket, ready for ``KJTAllToAll`` with
``splits = [F] * num_buckets``. A bag whose ids fall in several blocks is split into one
(possibly empty) bag per bucket; within each, ids keep their original order.

Guarantees: vectorised (no Python loop over ids or samples); exact; ``unbucketize_permute`` is
a permutation with ``bucketized[unbucketize_permute] == original`` position by position (for
sequence embeddings: the rows looked up in bucketized order, indexed by it, come back in the
original id order); ids outside ``[0, rows)`` raise ``ValueError`` naming the feature and
sample, before anything is computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


@dataclass(frozen=True)
class BucketizedIds:
    """Ids routed to row-wise buckets.

    Attributes:
        lengths: ``num_buckets * sum(stride_per_feature)`` bag sizes, bucket-major, then
            feature, then sample (input dtype).
        values: local ids (id minus the first row of its bucket), in the same order.
        weights: the ids' weights in the same order, or ``None``.
        unbucketize_permute: int64; entry ``i`` is the position in ``values`` of input id ``i``
            (``None`` when not asked for).
        num_buckets: number of buckets.
    """

    lengths: Tensor
    values: Tensor
    weights: Tensor | None
    unbucketize_permute: Tensor | None
    num_buckets: int


def _feature_label(feature_names: Sequence[str] | None, f: int) -> str:
    return f"feature {feature_names[f]!r}" if feature_names else f"feature #{f}"


def bucketize_ids(
    values: Tensor,
    lengths: Tensor,
    block_boundaries: Sequence[Sequence[int]],
    stride_per_feature: Sequence[int],
    *,
    weights: Tensor | None = None,
    feature_names: Sequence[str] | None = None,
    with_permute: bool = True,
) -> BucketizedIds:
    """Route ids to row-wise buckets (see the module docstring).

    Args:
        values: 1-D ids, feature-major then sample (KJT layout).
        lengths: 1-D bag sizes, ``sum(stride_per_feature)`` of them.
        block_boundaries: per feature, ``num_buckets + 1`` non-decreasing row boundaries
            starting at 0 and ending at the table's row count (``layout.row_wise_boundaries``).
        stride_per_feature: batch size of each feature.
        weights: optional per-id weights, carried along.
        feature_names: names for error messages.
        with_permute: compute ``unbucketize_permute`` (``False``: it is left ``None``).

    Raises:
        ValueError: shapes do not fit, boundaries are malformed, or an id is out of range.
    """
    num_features = len(block_boundaries)
    strides = [int(s) for s in stride_per_feature]
    _check_args(values, lengths, block_boundaries, strides, weights, feature_names)
    num_buckets = len(block_boundaries[0]) - 1 if num_features else 1
    device = values.device
    lengths64 = lengths.to(torch.int64)
    # Ids are feature-major: feature f owns one contiguous slice of them.
    ends = torch.cat([lengths64.new_zeros(1), torch.cumsum(lengths64, 0)])
    cut = torch.tensor(list(itertools.accumulate(strides)), dtype=torch.int64, device=device)
    id_ends = [0, *(int(x) for x in ends[cut].tolist())]
    ids = values.to(torch.int64)
    _check_ids(ids, id_ends, block_boundaries, lengths64, strides, feature_names)
    # Per feature (a contiguous slice of ids): its bucket and the id's offset in that bucket's
    # block. Two buckets (two ranks, or two per node): one comparison; more: searchsorted.
    bucket = torch.empty(
        values.numel(), dtype=torch.uint8 if num_buckets == 2 else torch.int32, device=device
    )
    local = torch.empty(values.numel(), dtype=torch.int64, device=device)
    for f, (a, b) in enumerate(itertools.pairwise(id_ends)):
        if a == b:
            continue
        edges = [int(x) for x in block_boundaries[f]]
        if num_buckets == 2:
            torch.ge(ids[a:b], edges[1], out=bucket[a:b].view(torch.bool))
            torch.sub(ids[a:b], bucket[a:b], alpha=edges[1], out=local[a:b])
            continue
        edge_tensor = torch.tensor(edges, device=device)
        torch.searchsorted(edge_tensor[1:-1], ids[a:b], right=True, out_int32=True, out=bucket[a:b])
        torch.sub(ids[a:b], edge_tensor.index_select(0, bucket[a:b]), out=local[a:b])

    # The input is already feature- then sample-ordered, so a stable sort by bucket alone gives
    # the bucket-major layout; small integer keys sort by radix.
    narrow = torch.uint8 if num_buckets <= 255 else torch.int32
    order = torch.sort(bucket.to(narrow), stable=True).indices
    unbucketize = None
    if with_permute:
        unbucketize = torch.empty_like(order)
        unbucketize[order] = torch.arange(order.numel(), device=device)
    new_lengths = _bucket_lengths(bucket, lengths64, num_buckets)
    return BucketizedIds(
        lengths=new_lengths.to(lengths.dtype),
        values=local.index_select(0, order).to(values.dtype),
        weights=None if weights is None else weights.index_select(0, order),
        unbucketize_permute=unbucketize,
        num_buckets=num_buckets,
    )


def _bucket_lengths(bucket: Tensor, lengths: Tensor, num_buckets: int) -> Tensor:
    """``[num_buckets * segments]`` (bucket-major): how many ids of each segment (bag) fall in
    each bucket, from running counts of each bucket read at the bags' ends."""
    ends = torch.cumsum(lengths, 0)
    if bucket.numel() == 0:
        return lengths.new_zeros(num_buckets * lengths.numel())
    if num_buckets == 2:
        running = torch.cumsum(bucket, 0, dtype=torch.int64)  # ids in bucket 1 so far
        at_end = torch.cat([running.new_zeros(1), running]).index_select(0, ends)
        ones = at_end.diff(prepend=at_end.new_zeros(1))
        return torch.cat([lengths - ones, ones])
    segment = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=bucket.numel()
    )
    return torch.bincount(
        bucket.to(torch.int64).mul_(lengths.numel()).add_(segment),
        minlength=num_buckets * lengths.numel(),
    )


def _check_args(
    values: Tensor,
    lengths: Tensor,
    block_boundaries: Sequence[Sequence[int]],
    strides: list[int],
    weights: Tensor | None,
    feature_names: Sequence[str] | None,
) -> None:
    where = "bucketize_ids"
    if values.dim() != 1 or lengths.dim() != 1:
        raise ValueError(f"{where}: values and lengths must be 1-D")
    if values.is_floating_point() or lengths.is_floating_point():
        raise ValueError(f"{where}: values and lengths must be integer tensors")
    if len(strides) != len(block_boundaries):
        raise ValueError(
            f"{where}: {len(block_boundaries)} features have boundaries but "
            f"{len(strides)} batch sizes were given"
        )
    if feature_names is not None and len(feature_names) != len(block_boundaries):
        raise ValueError(
            f"{where}: {len(feature_names)} names for {len(block_boundaries)} features"
        )
    if any(s < 0 for s in strides) or lengths.numel() != sum(strides):
        raise ValueError(
            f"{where}: {lengths.numel()} lengths do not match the batch sizes {strides}"
        )
    if weights is not None and weights.shape != values.shape:
        raise ValueError(
            f"{where}: {tuple(weights.shape)} weights for {tuple(values.shape)} ids; "
            "give one weight per id"
        )
    widths = {len(b) for b in block_boundaries}
    if len(widths) > 1:
        raise ValueError(
            f"{where}: features have different numbers of buckets "
            f"({[len(b) - 1 for b in block_boundaries]}); all must use the same world"
        )
    for f, b in enumerate(block_boundaries):
        bl = [int(x) for x in b]
        if len(bl) < 2 or bl[0] != 0 or any(y < x for x, y in itertools.pairwise(bl)):
            raise ValueError(
                f"{where}: {_feature_label(feature_names, f)} has boundaries {bl}; expected "
                "at least 2 non-decreasing entries starting at 0"
            )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{where}: lengths must be non-negative")
    if int(lengths.sum()) != values.numel():
        raise ValueError(
            f"{where}: lengths add up to {int(lengths.sum())} but there are {values.numel()} ids"
        )


def _check_ids(
    ids: Tensor,
    id_ends: list[int],
    block_boundaries: Sequence[Sequence[int]],
    lengths: Tensor,
    strides: list[int],
    feature_names: Sequence[str] | None,
) -> None:
    """Every id of feature ``f`` (slice ``id_ends[f]:id_ends[f + 1]``) lies in its table."""
    for f, (a, b) in enumerate(itertools.pairwise(id_ends)):
        if a == b:
            continue
        rows = int(block_boundaries[f][-1])
        low, high = (int(x) for x in torch.aminmax(ids[a:b]))
        if low >= 0 and high < rows:
            continue
        i = a + int(torch.nonzero((ids[a:b] < 0) | (ids[a:b] >= rows))[0])
        first = sum(strides[:f])
        bag_ends = torch.cumsum(lengths[first : first + strides[f]], 0) + a
        sample = int(torch.searchsorted(bag_ends, torch.tensor(i), right=True))
        raise ValueError(
            f"bucketize_ids: {_feature_label(feature_names, f)}, sample {sample}: id "
            f"{int(ids[i])} is outside its table's rows [0, {rows}); hash or clamp ids "
            "before sharding"
        )


def bucketize_kjt(
    kjt: KeyedJaggedTensor,
    block_boundaries: Sequence[Sequence[int]],
    *,
    with_permute: bool = True,
) -> tuple[KeyedJaggedTensor, Tensor | None]:
    """Route a KJT's ids to row-wise buckets.

    Args:
        kjt: the batch; its keys are the features.
        block_boundaries: per key of ``kjt``, its table's row boundaries (``num_buckets + 1``).
        with_permute: compute the unbucketize permutation (``False``: ``None`` is returned in
            its place; pooled lookups do not need it).

    Returns:
        ``(bucketized, unbucketize_permute)``: a KJT with the keys repeated once per bucket
        (bucket-major; send it with ``KJTAllToAll(splits=[len(keys)] * num_buckets)``) and the
        permutation described in the module docstring.
    """
    keys = kjt.keys()
    if len(block_boundaries) != len(keys):
        raise ValueError(
            f"bucketize_kjt: {len(block_boundaries)} boundary lists for the KJT's "
            f"{len(keys)} keys {keys}"
        )
    out = bucketize_ids(
        kjt.values(),
        kjt.lengths(),
        block_boundaries,
        kjt.stride_per_key(),
        weights=kjt.weights_or_none(),
        feature_names=keys,
        with_permute=with_permute,
    )
    n = out.num_buckets
    variable = kjt.variable_stride_per_key()
    return (
        KeyedJaggedTensor(
            keys=keys * n,
            values=out.values,
            weights=out.weights,
            lengths=out.lengths,
            stride=None if variable else kjt.stride(),
            stride_per_key_per_rank=kjt.stride_per_key_per_rank() * n if variable else None,
            allow_duplicate_keys=n > 1,
        ),
        out.unbucketize_permute,
    )
