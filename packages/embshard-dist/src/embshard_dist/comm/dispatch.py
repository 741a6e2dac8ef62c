"""Which algorithm each collective runs: the one place that chooses, from the backend or device
and the call's shape (one line of reason each; the measurements are in benchmarks/README.md).

Every rank must choose alike, so each choice reads only what all ranks of the group share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm._codec import is_active
from embshard_dist.comm.algorithms.all_gather import (
    AllGather,
    all_gather_as_all_to_all,
    all_gather_by_backend,
)
from embshard_dist.comm.algorithms.pooled_all_to_all import (
    PooledAllToAll,
    backward_keeping_own_rows,
    backward_through_backend,
    forward_keeping_own_rows,
    forward_through_backend,
)
from embshard_dist.comm.algorithms.reduce_scatter import (
    ReduceScatter,
    reduce_scatter_as_all_to_all,
    reduce_scatter_by_backend,
)
from embshard_dist.comm.algorithms.row_sums import (
    RowSum,
    sum_rows_by_index_add,
    sum_rows_by_sparse_product,
)
from embshard_types.comm_codec import QuantizedCommCodec

__all__ = ["all_gather", "backend_of", "pooled_all_to_all", "reduce_scatter", "row_sum"]


def backend_of(group: dist.ProcessGroup | None) -> str:
    """The group's backend, lower case (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``...)."""
    return str(dist.get_backend(group)).lower()


def all_gather(local: Tensor, world: int, rank: int) -> AllGather:
    """The all-gather of ``local`` on a rank of a ``world``-rank group (``rank < 0``: not in it)."""
    if local.device.type == "cpu" and world > 1 and rank >= 0:
        # gloo's all-gather moves large blocks several times slower than its all-to-all
        return all_gather_as_all_to_all
    # NCCL's own is fast; one rank has no peer; a non-member gets the backend's refusal
    return all_gather_by_backend


def reduce_scatter(
    backend: str, batches: Sequence[int], codec: QuantizedCommCodec[Any] | None
) -> ReduceScatter:
    """The reduce-scatter of row blocks of sizes ``batches`` with forward ``codec``."""
    if "gloo" in backend:
        # gloo's reduce-scatter moves the whole tensor to every rank
        return reduce_scatter_as_all_to_all
    if len(set(batches)) != 1:
        # reduce_scatter_single takes equal blocks only
        return reduce_scatter_as_all_to_all
    if is_active(codec):
        # coded bytes cannot be summed by the backend: decode, then sum
        return reduce_scatter_as_all_to_all
    return reduce_scatter_by_backend


def pooled_all_to_all(world: int, rank: int) -> PooledAllToAll:
    """The pooled all-to-all's exchanges on ``rank`` of ``world`` (on every backend)."""
    if world > 1 and rank in (0, world - 1):
        # the others' rows are one contiguous block: no self copy through the backend
        return PooledAllToAll(forward_keeping_own_rows, backward_keeping_own_rows)
    # a middle rank's peers lie on both sides of its own rows
    return PooledAllToAll(forward_through_backend, backward_through_backend)


def row_sum(rows: Tensor, grads: Tensor) -> RowSum:
    """The sum of repeated rows' gradients ``grads`` for ids ``rows`` (a local computation)."""
    if grads.device.type == "cpu" and grads.dtype == torch.float32 and rows.numel() > 0:
        # a CPU sparse-CSR product sums every row in one pass, no per-id scatter
        return sum_rows_by_sparse_product
    return sum_rows_by_index_add
