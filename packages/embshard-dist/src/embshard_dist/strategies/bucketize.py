"""Routes each id to the row-wise bucket holding its row: id ``v`` with ``b_r <= v < b_{r+1}``
goes to bucket ``r`` as local id ``v - b_r``, laid out bucket-major, then feature, then sample.

Ids keep their order within a bucket; ``bucketized[unbucketize_permute] == original``; ids
outside ``[0, rows)`` raise ``ValueError`` naming feature and sample before any work. Under
``torch.compile`` the same routing runs in whole-tensor ops that read no tensor data into Python
(no graph break), and the checks of lengths and ids become traced asserts (``RuntimeError``
naming no feature: the trace cannot say which one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from embshard_optim.sorting import stable_sort
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


@dataclass(frozen=True)
class BucketizedIds:
    """Ids routed to row-wise buckets; ``unbucketize_permute[i]`` is input id ``i``'s position."""

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
    """Route ids (KJT layout) to row-wise buckets (see the module docstring).

    Args:
        block_boundaries: per feature, ``num_buckets + 1`` row boundaries from 0 to its rows.

    Raises:
        ValueError: shapes do not fit, boundaries are malformed, or an id is out of range.
    """
    num_features = len(block_boundaries)
    strides = [int(s) for s in stride_per_feature]
    _check_args(values, lengths, block_boundaries, strides, weights, feature_names)
    num_buckets = len(block_boundaries[0]) - 1 if num_features else 1
    if torch.compiler.is_compiling():
        return _traced_bucketize(values, lengths, block_boundaries, strides, weights, with_permute)
    device = values.device
    lengths64 = lengths.to(torch.int64)
    ends = torch.cat([lengths64.new_zeros(1), torch.cumsum(lengths64, 0)])
    cut = torch.tensor(list(itertools.accumulate(strides)), dtype=torch.int64, device=device)
    id_ends = [0, *(int(x) for x in ends[cut].tolist())]
    ids = values.to(torch.int64)
    _check_ids(ids, id_ends, block_boundaries, lengths64, strides, feature_names)
    # Two buckets need one comparison; more need searchsorted.
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

    # The input is feature- then sample-ordered, so a stable sort by bucket gives the layout.
    narrow = torch.uint8 if num_buckets <= 255 else torch.int32
    order = stable_sort(bucket.to(narrow))[1]
    new_lengths = _bucket_lengths(bucket, lengths64, num_buckets)
    return _routed(order, local, new_lengths, lengths, values, weights, with_permute, num_buckets)


def _traced_bucketize(
    values: Tensor,
    lengths: Tensor,
    block_boundaries: Sequence[Sequence[int]],
    strides: list[int],
    weights: Tensor | None,
    with_permute: bool,
) -> BucketizedIds:
    """:func:`bucketize_ids` for a traced graph: the same result, from per-id table rows and
    bucket edges gathered by feature instead of per-feature slices cut at data-dependent ends."""
    device = values.device
    num_buckets = len(block_boundaries[0]) - 1 if block_boundaries else 1
    lengths64 = lengths.to(torch.int64)
    num_ids, num_bags = values.numel(), lengths.numel()
    edges = torch.tensor(
        [[int(x) for x in b] for b in block_boundaries] or [[0, 0]],
        dtype=torch.int64,
        device=device,
    )
    bag_feature = torch.repeat_interleave(
        torch.arange(len(strides), device=device),
        torch.tensor(strides, dtype=torch.int64, device=device),
        output_size=num_bags,
    )
    id_bag = torch.repeat_interleave(
        torch.arange(num_bags, device=device), lengths64, output_size=num_ids
    )
    id_edges = edges.index_select(0, bag_feature.index_select(0, id_bag))
    ids = values.to(torch.int64)
    torch._assert_async(
        ((ids >= 0) & (ids < id_edges[:, -1])).all(),
        "bucketize_ids: an id is outside its table's rows; hash or clamp ids before sharding",
    )
    # searchsorted(edges[1:-1], id, right=True) per id: how many inner edges are <= the id
    bucket = (ids.unsqueeze(1) >= id_edges[:, 1:-1]).sum(1)
    local = ids - id_edges.gather(1, bucket.unsqueeze(1)).squeeze(1)
    order = torch.sort(bucket, stable=True).indices
    counts = torch.zeros(num_buckets * num_bags, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket * num_bags + id_bag, torch.ones_like(bucket))
    return _routed(order, local, counts, lengths, values, weights, with_permute, num_buckets)


def _routed(
    order: Tensor,
    local: Tensor,
    new_lengths: Tensor,
    lengths: Tensor,
    values: Tensor,
    weights: Tensor | None,
    with_permute: bool,
    num_buckets: int,
) -> BucketizedIds:
    """The result of both paths: local ids and weights in bucket ``order``, the new lengths,
    and the permutation back (in the input's dtypes)."""
    unbucketize = None
    if with_permute:
        unbucketize = torch.empty_like(order)
        unbucketize[order] = torch.arange(order.numel(), device=order.device)
    return BucketizedIds(
        lengths=new_lengths.to(lengths.dtype),
        values=local.index_select(0, order).to(values.dtype),
        weights=None if weights is None else weights.index_select(0, order),
        unbucketize_permute=unbucketize,
        num_buckets=num_buckets,
    )


def _bucket_lengths(bucket: Tensor, lengths: Tensor, num_buckets: int) -> Tensor:
    """How many ids of each bag fall in each bucket, bucket-major."""
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
    if torch.compiler.is_compiling():
        torch._assert_async(
            (lengths >= 0).all() & (lengths.sum() == values.numel()),
            f"{where}: lengths must be non-negative and add up to the number of ids",
        )
        return
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

    Returns:
        The KJT with its keys repeated once per bucket (send with
        ``splits=[len(keys)] * num_buckets``) and the unbucketize permutation (or ``None``).
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
