"""One pooled fused call made of every replica's call, for data-parallel tables.

A replicated table's update can be computed from every rank's call (ids, bag offsets, per-id
weights and the output's gradient) instead of every rank's summed rows: where bags pool several
ids the call is the smaller message. :func:`join_calls` lays the ranks' calls out as the call of
the global batch (feature by feature, each feature's bags rank by rank), so every rank applies
the same update, the unsharded module's on that batch. A ``CallGather`` hook (the collectives
live with the sharding) gathers the calls, or declines where the summed rows are smaller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class PooledCall(NamedTuple):
    """One pooled call with one batch size for every feature, and its output's gradient
    (``[batch, sum of dims]``)."""

    indices: Tensor
    offsets: Tensor
    per_sample_weights: Tensor | None
    grad_output: Tensor


class RunIds(NamedTuple):
    """What a run of the call reads (see ``fast_pooled.TableRun``): its ids in this call, its
    rows and its width."""

    ids: int
    rows: int
    width: int


CallGather = Callable[[PooledCall | None, int, Sequence[RunIds]], PooledCall | None]
"""``(this rank's call, its features, its runs) -> every rank's call joined`` (see
:func:`join_calls`), or ``None`` where the hook has the summed rows exchanged instead (always
where some rank offered ``None``: a call it cannot join). Every rank gets the same answer, so
every rank must call it, in the same order."""


def join_calls(calls: Sequence[PooledCall], num_features: int) -> PooledCall:
    """The call of the global batch: per feature, each call's bags in the order given.

    Per-sample weights are kept if any call has them (a call without gets ones); indices and
    offsets take the first call's dtypes.

    Raises:
        ValueError: a call's bags do not split evenly over ``num_features``, or its gradient
            does not have one row per sample.
    """
    if not calls:
        raise ValueError("join_calls needs at least one call")
    index_dtype, offset_dtype = calls[0].indices.dtype, calls[0].offsets.dtype
    weighted = any(c.per_sample_weights is not None for c in calls)
    lengths: list[Tensor] = []
    ids: list[list[Tensor]] = []
    weights: list[list[Tensor]] = []
    for k, call in enumerate(calls):
        bags = call.offsets.numel() - 1
        if bags % num_features:
            raise ValueError(
                f"call {k}: {bags} bags cannot be split evenly over {num_features} features"
            )
        batch = bags // num_features
        if call.grad_output.dim() != 2 or call.grad_output.shape[0] != batch:
            raise ValueError(
                f"call {k}: expected a [{batch}, dims] gradient, got {tuple(call.grad_output.shape)}"
            )
        lengths.append(call.offsets.diff().view(num_features, batch))
        bounds = (
            call.offsets[::batch].tolist() if batch else [0] * (num_features + 1)
        )  # each feature's first id, then the last
        ids.append([call.indices[bounds[f] : bounds[f + 1]] for f in range(num_features)])
        if weighted:
            w = call.per_sample_weights
            if w is None:
                w = torch.ones(call.indices.numel(), device=call.indices.device)
            weights.append([w[bounds[f] : bounds[f + 1]] for f in range(num_features)])
    joined_lengths = torch.cat(lengths, dim=1).reshape(-1).to(offset_dtype)
    offsets = joined_lengths.new_zeros(joined_lengths.numel() + 1)
    torch.cumsum(joined_lengths, 0, out=offsets[1:])
    order = [(k, f) for f in range(num_features) for k in range(len(calls))]
    indices = torch.cat([ids[k][f].to(index_dtype) for k, f in order])
    joined_weights = torch.cat([weights[k][f] for k, f in order]) if weighted else None
    grad = torch.cat([c.grad_output.to(calls[0].grad_output.dtype) for c in calls])
    return PooledCall(indices, offsets, joined_weights, grad)
