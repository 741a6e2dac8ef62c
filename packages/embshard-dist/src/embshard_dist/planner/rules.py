"""The sharders' plan rules the planner must meet, stated once for enumeration and messages.

The sharders' plan check (:mod:`embshard_dist.sharded.plan_checks`) refuses a fused kernel on a
shard whose width is not a multiple of 4, column blocks that are not multiples of 4, two column
blocks of one table on one rank (grid: on one node), and row-wise or data-parallel tables not on
every rank. :func:`kernel_refusal` and :func:`type_refusal` say why an option would be refused,
so the planner never enumerates it and can tell the user what to change.

Guarantees: pure functions; ``None`` means the sharders accept the option as far as it depends
on the table's shape and the ranks it may use (placement rules are kept by the partitioner).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_dist.strategies.layout import MIN_COLUMN_BLOCK
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = ["COLUMN_TYPES", "FUSED_KERNELS", "kernel_refusal", "type_refusal"]

FUSED_KERNELS = frozenset(
    {ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING}
)
"""Kernels whose shards must be a multiple of ``MIN_COLUMN_BLOCK`` columns wide."""

COLUMN_TYPES = frozenset(
    {ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD}
)
"""Sharding types that cut a table into column blocks."""

_EVERY_RANK = frozenset({ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL})
_WHOLE_NODE = frozenset(
    {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD}
)


def kernel_refusal(kernel: ComputeKernel, dim: int) -> str | None:
    """Why a table ``dim`` wide cannot run on ``kernel`` (``None``: it can)."""
    if kernel in FUSED_KERNELS and dim % MIN_COLUMN_BLOCK:
        return (
            f"the {kernel.value} kernel needs shards whose width is a multiple of "
            f"{MIN_COLUMN_BLOCK}, and the table's dim is {dim} (such a table trains on "
            "compute kernel 'dense' only, which data_parallel does not run)"
        )
    return None


def type_refusal(
    kind: ShardingType,
    dim: int,
    allowed_ranks: Sequence[int],
    world_size: int,
    whole_nodes: Sequence[int],
) -> str | None:
    """Why a table ``dim`` wide, allowed ``allowed_ranks``, cannot be sharded ``kind``.

    Args:
        whole_nodes: the nodes all of whose ranks are allowed.
    """
    if kind in COLUMN_TYPES and dim % MIN_COLUMN_BLOCK:
        return (
            f"{kind.value} cannot cut dim {dim} into column blocks, each of whose widths must "
            f"be a multiple of {MIN_COLUMN_BLOCK}"
        )
    if kind in _EVERY_RANK and len(set(allowed_ranks)) < world_size:
        return f"{kind.value} needs every rank allowed, and ranks {list(allowed_ranks)} are"
    if kind in _WHOLE_NODE and not whole_nodes:
        return f"{kind.value} needs every rank of a node allowed"
    return None
