"""Several calls of a table-batched kernel joined into one, with the gradients of their outputs.

:func:`concat_calls` lays the calls' bags out feature by feature (the first call's bags of a
feature, then the second's, ...), as a KeyedJaggedTensor concatenated along the batch is laid
out, and their output gradients in the matching order. One fused backward of the joined call is
therefore the optimizer step on the concatenated batch: what gradient accumulation replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from embshard_kernels.lookup import CallLayout, arrange_pooled, split_pooled

__all__ = ["KernelCall", "concat_calls"]


@dataclass(frozen=True)
class KernelCall:
    """One call of a table-batched kernel (its TBE arguments) and the gradient of its output.

    Attributes:
        indices: ids of every bag, feature-major.
        offsets: bag boundaries (one more than the bags).
        per_sample_weights: per-id weights, or ``None``.
        batch_size_per_feature_per_rank: per feature, its batch size on each rank, or ``None``
            for one uniform batch.
        grad_output: the gradient of the call's output, laid out as the output.
    """

    indices: Tensor
    offsets: Tensor
    per_sample_weights: Tensor | None
    batch_size_per_feature_per_rank: list[list[int]] | None
    grad_output: Tensor


def concat_calls(
    calls: Sequence[KernelCall], feature_dims: Sequence[int], *, sequence: bool
) -> KernelCall:
    """One call holding every bag of ``calls`` and the gradient of every output row.

    Uniform calls give a uniform call (pooled gradients stacked along the batch). Where any call
    has per-feature batch sizes, each call's ranks become ranks of the joined call, in call order
    (its flat pooled gradient is the calls' flat gradients one after the other).

    Args:
        calls: one or more calls of the same kernel.
        feature_dims: the kernel's width of each feature.
        sequence: the kernel returns one row per id (``[ids, dim]``) rather than pooled bags.

    Raises:
        ValueError: no call, or calls that disagree on having per-sample weights.
    """
    if not calls:
        raise ValueError("concat_calls needs at least one call")
    weighted = {c.per_sample_weights is not None for c in calls}
    if len(weighted) != 1:
        raise ValueError("concat_calls: some calls have per-sample weights and others do not")
    if len(calls) == 1:
        return calls[0]
    num_features = len(feature_dims)
    layouts = [
        CallLayout.of(c.offsets, num_features, c.batch_size_per_feature_per_rank) for c in calls
    ]
    ids: list[Tensor] = []
    lengths: list[Tensor] = []
    weights: list[Tensor] = []
    rows: list[Tensor] = []
    for f in range(num_features):
        for call, layout in zip(calls, layouts, strict=True):
            ids.append(layout.ids(call.indices, f))
            lengths.append(layout.bag_offsets(call.offsets, f).diff())
            if call.per_sample_weights is not None:
                weights.append(layout.ids(call.per_sample_weights, f))
            if sequence:
                rows.append(layout.ids(call.grad_output, f))
    offsets_dtype = calls[0].offsets.dtype
    all_lengths = torch.cat(lengths) if lengths else calls[0].offsets.new_zeros(0)
    offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)]).to(offsets_dtype)
    variable = any(c.batch_size_per_feature_per_rank is not None for c in calls)
    per_rank = _joined_batch_sizes(layouts, num_features) if variable else None
    if sequence:
        grad = torch.cat(rows) if rows else calls[0].grad_output
    elif not variable:
        grad = torch.cat([c.grad_output for c in calls])
    else:
        pairs = zip(calls, layouts, strict=True)
        grad = torch.cat([_flat_grad(call, layout, feature_dims) for call, layout in pairs])
    return KernelCall(
        indices=torch.cat(ids) if ids else calls[0].indices,
        offsets=offsets,
        per_sample_weights=torch.cat(weights) if weights else None,
        batch_size_per_feature_per_rank=per_rank,
        grad_output=grad,
    )


def _call_batch_sizes(layout: CallLayout, num_features: int) -> list[list[int]]:
    """Per feature, the call's batch size on each of its ranks (a uniform call: one rank)."""
    if layout.batch_per_rank is not None:
        return layout.batch_per_rank
    return [[layout.bag_bounds[f + 1] - layout.bag_bounds[f]] for f in range(num_features)]


def _joined_batch_sizes(layouts: Sequence[CallLayout], num_features: int) -> list[list[int]]:
    """Per feature, the batch size of every rank of every call, call by call."""
    sizes = [_call_batch_sizes(layout, num_features) for layout in layouts]
    return [[b for call_sizes in sizes for b in call_sizes[f]] for f in range(num_features)]


def _flat_grad(call: KernelCall, layout: CallLayout, feature_dims: Sequence[int]) -> Tensor:
    """The call's pooled gradient in the flat (rank-major, then feature-major) layout."""
    if layout.batch_per_rank is not None:
        return call.grad_output.reshape(-1)
    per_rank = _call_batch_sizes(layout, len(feature_dims))
    blocks = split_pooled(call.grad_output, list(feature_dims), None)
    return arrange_pooled(blocks, per_rank)
