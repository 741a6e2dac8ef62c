"""Table-batched lookups in plain torch, laid out exactly as FBGEMM's TBE lays them out.

Ids and bags are feature-major; pooled output is ``[batch, sum of dims]``, or flat (rank-major,
then feature-major) with per-feature batch sizes; sequence output is ``[ids, dim]``. Differentiable
w.r.t. weights and per-sample weights; one torch call per feature, never a loop over ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from embshard_kernels import hugepages
from embshard_types.vocab import PoolingType


@dataclass(frozen=True)
class CallLayout:
    """Where each feature's bags and ids sit in one call's ``offsets`` / ``indices``.

    Attributes:
        bag_bounds: per feature, its first bag; then the total (``num_features + 1`` entries).
        id_bounds: per feature, its first id; then the total.
        batch_per_rank: per feature, its batch size on each rank (``None``: one uniform batch).
    """

    bag_bounds: list[int]
    id_bounds: list[int]
    batch_per_rank: list[list[int]] | None

    @staticmethod
    def of(
        offsets: Tensor, num_features: int, batch_size_per_feature_per_rank: list[list[int]] | None
    ) -> CallLayout:
        """Read the layout of one call (one small device read of ``num_features + 1`` offsets)."""
        num_bags = offsets.numel() - 1
        if batch_size_per_feature_per_rank is None:
            if num_features == 0 or num_bags % num_features:
                raise ValueError(
                    f"{num_bags} bags cannot be split evenly over {num_features} features"
                )
            per_feature = [num_bags // num_features] * num_features
        else:
            per_feature = [sum(b) for b in batch_size_per_feature_per_rank]
            if len(per_feature) != num_features or sum(per_feature) != num_bags:
                raise ValueError(
                    f"batch sizes per feature {batch_size_per_feature_per_rank} do not describe "
                    f"{num_bags} bags of {num_features} features"
                )
        bag_bounds = [0]
        for b in per_feature:
            bag_bounds.append(bag_bounds[-1] + b)
        id_bounds = offsets[torch.tensor(bag_bounds, device=offsets.device)].tolist()
        return CallLayout(bag_bounds, id_bounds, batch_size_per_feature_per_rank)

    def bag_offsets(self, offsets: Tensor, f: int) -> Tensor:
        """Feature ``f``'s bag offsets, rebased to its first id (``batch + 1`` entries)."""
        lo, hi = self.bag_bounds[f], self.bag_bounds[f + 1]
        return offsets[lo : hi + 1] - self.id_bounds[f]

    def ids(self, tensor: Tensor, f: int) -> Tensor:
        """Feature ``f``'s part of a per-id tensor (ids or weights)."""
        return tensor[self.id_bounds[f] : self.id_bounds[f + 1]]


def pooled_lookup(
    tables: list[Tensor],
    feature_table_map: list[int],
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooling: PoolingType,
    batch_size_per_feature_per_rank: list[list[int]] | None = None,
    layout: CallLayout | None = None,
) -> Tensor:
    """Pool the bags of every feature from its table.

    Args:
        feature_table_map: per feature, the index of its table.
        per_sample_weights: per-id weights (SUM only), or ``None``.
        layout: the call's layout, if already read.

    Returns:
        ``[batch, sum of dims]``, or the flat variable-batch layout (see the module docstring).
    """
    layout = layout or CallLayout.of(
        offsets, len(feature_table_map), batch_size_per_feature_per_rank
    )
    pooled = []
    for f, t in enumerate(feature_table_map):
        bag_offsets = layout.bag_offsets(offsets, f)
        ids = layout.ids(indices, f)
        weights = None if per_sample_weights is None else layout.ids(per_sample_weights, f)
        mode = "mean" if pooling is PoolingType.MEAN and weights is None else "sum"
        out = F.embedding_bag(
            ids,
            tables[t],
            bag_offsets,
            mode=mode,
            per_sample_weights=weights,
            include_last_offset=True,
        )
        if pooling is PoolingType.MEAN and weights is not None:
            out = out / bag_offsets.diff().clamp(min=1).unsqueeze(1).to(out.dtype)
        pooled.append(out)
    return arrange_pooled(pooled, layout.batch_per_rank)


def arrange_pooled(pooled: list[Tensor], batch_per_rank: list[list[int]] | None) -> Tensor:
    """Per-feature ``[batch_f, dim_f]`` blocks in FBGEMM's output layout."""
    if batch_per_rank is None:
        return torch.cat(pooled, dim=1)
    blocks = []
    starts = [0] * len(pooled)
    for r in range(len(batch_per_rank[0]) if batch_per_rank else 0):
        for f, block in enumerate(pooled):
            size = batch_per_rank[f][r]
            blocks.append(block[starts[f] : starts[f] + size].reshape(-1))
            starts[f] += size
    return torch.cat(blocks) if blocks else pooled[0].new_zeros(0)


def split_pooled(
    output: Tensor, dims: list[int], batch_per_rank: list[list[int]] | None
) -> list[Tensor]:
    """Inverse of :func:`arrange_pooled`: per feature, its ``[batch_f, dim_f]`` block."""
    if batch_per_rank is None:
        return list(output.split(dims, dim=1))
    pieces: list[list[Tensor]] = [[] for _ in dims]
    start = 0
    for r in range(len(batch_per_rank[0]) if batch_per_rank else 0):
        for f, dim in enumerate(dims):
            size = batch_per_rank[f][r] * dim
            pieces[f].append(output[start : start + size].view(-1, dim))
            start += size
    return [torch.cat(p) for p in pieces]


def sequence_lookup(
    tables: list[Tensor],
    feature_table_map: list[int],
    indices: Tensor,
    offsets: Tensor,
    layout: CallLayout | None = None,
) -> Tensor:
    """One row per id, ``[ids, dim]`` (every table must have the same width).

    Without autograd the rows are gathered straight into one output, on huge pages when it is
    large (a fresh output of tens of MB otherwise faults every 4 KiB page; see ``hugepages``).
    """
    layout = layout or CallLayout.of(offsets, len(feature_table_map), None)
    if not feature_table_map:
        return indices.new_zeros((0, 0), dtype=torch.float32)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
        rows = [
            F.embedding(layout.ids(indices, f), tables[t]) for f, t in enumerate(feature_table_map)
        ]
        return torch.cat(rows) if len(rows) > 1 else rows[0]
    first = tables[feature_table_map[0]]
    count = layout.id_bounds[len(feature_table_map)] - layout.id_bounds[0]
    out = hugepages.empty((count, first.shape[1]), first.dtype, first.device)
    at = 0
    for f, t in enumerate(feature_table_map):
        ids = layout.ids(indices, f)
        torch.index_select(tables[t], 0, ids, out=out[at : at + ids.numel()])
        at += ids.numel()
    return out
