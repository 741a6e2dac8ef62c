"""Layout checks of the node-aware sharding types (table-row-wise, table-column-wise, grid).

Run by :mod:`embshard_dist.sharded.plan_checks` before anything is built; each error names the
table, says what is wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_dist.strategies.layout import MIN_COLUMN_BLOCK
from embshard_dist.strategies.nodes import NodeTopology
from embshard_types.shard_spec import ShardSpec
from embshard_types.vocab import ShardingType

__all__ = ["NODE_AWARE", "check_node_layout"]

NODE_AWARE = frozenset(
    {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD}
)


def check_node_layout(
    kind: ShardingType,
    name: str,
    specs: Sequence[ShardSpec],
    size: tuple[int, int],
    topology: NodeTopology,
) -> None:
    """Raise ``ValueError`` unless ``specs`` (already tiling the table) are a valid ``kind`` layout."""
    lws = topology.local_world_size
    if kind is ShardingType.TABLE_ROW_WISE:
        if any(s.offsets[1] != 0 or s.sizes[1] != size[1] for s in specs):
            raise ValueError(
                f"table {name!r}: every table_row_wise block spans all {size[1]} columns; use "
                "grid sharding to split columns too"
            )
        _check_node_rows(name, specs, topology, "table_row_wise")
        return
    if kind is ShardingType.TABLE_COLUMN_WISE:
        if any(s.offsets[0] != 0 or s.sizes[0] != size[0] for s in specs):
            raise ValueError(
                f"table {name!r}: every table_column_wise block spans all {size[0]} rows; use "
                "grid sharding to split rows too"
            )
        nodes = sorted({topology.node_of(s.rank) for s in specs})
        if len(nodes) > 1:
            raise ValueError(
                f"table {name!r}: table_column_wise blocks must sit on one node ({lws} ranks "
                f"per node), got blocks on nodes {nodes}; use column_wise to spread them"
            )
        ranks = [s.rank for s in specs]
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if repeated:
            raise ValueError(
                f"table {name!r}: rank {repeated[0]} holds several column blocks of the table; "
                "give each block its own rank of the node (or merge the blocks)"
            )
        _check_widths(name, [s.sizes[1] for s in specs], "table_column_wise")
        return
    if kind is not ShardingType.GRID_SHARD:
        raise ValueError(f"table {name!r}: {kind.value} is not a node-aware sharding type")
    blocks: dict[int, list[ShardSpec]] = {}
    for spec in specs:
        blocks.setdefault(spec.offsets[1], []).append(spec)
    row_cuts = set()
    nodes = []
    for col in sorted(blocks):
        block = blocks[col]
        if len({s.sizes[1] for s in block}) > 1:
            raise ValueError(
                f"table {name!r}: the grid column block at column {col} has row blocks of "
                f"different widths {[s.sizes[1] for s in block]}"
            )
        nodes.append(_check_node_rows(name, block, topology, f"grid column block at {col}"))
        row_cuts.add(tuple(s.sizes[0] for s in sorted(block, key=lambda s: s.offsets[0])))
    if len(row_cuts) > 1:
        raise ValueError(
            f"table {name!r}: grid column blocks must be cut at the same rows, got row block "
            f"sizes {sorted(row_cuts)}; use the same row split for every column block"
        )
    if len(set(nodes)) < len(nodes):
        raise ValueError(
            f"table {name!r}: grid column blocks must be on distinct nodes, got nodes {nodes}; "
            "use fewer column blocks (at most one per node) or merge the blocks of a node"
        )
    _check_widths(name, [blocks[c][0].sizes[1] for c in sorted(blocks)], "grid")


def _check_node_rows(
    name: str, specs: Sequence[ShardSpec], topology: NodeTopology, what: str
) -> int:
    """Check one row block per rank of one node, in rank order; return the node."""
    ordered = sorted(specs, key=lambda s: s.offsets[0])
    ranks = [s.rank for s in ordered]
    node = topology.node_of(ranks[0])
    expected = topology.node_ranks(node)
    if ranks != expected:
        raise ValueError(
            f"table {name!r}: {what} needs one row block per rank of one node, block l on "
            f"local rank l ({topology.local_world_size} ranks per node: node {node} is ranks "
            f"{expected}), got row blocks on ranks {ranks}"
        )
    return node


def _check_widths(name: str, widths: list[int], what: str) -> None:
    if len(widths) > 1 and any(w % MIN_COLUMN_BLOCK for w in widths):
        raise ValueError(
            f"table {name!r}: {what} block widths {widths} must each be a multiple of "
            f"{MIN_COLUMN_BLOCK}; choose widths that are"
        )
