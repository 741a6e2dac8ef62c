"""Library-neutral sharding plans: for each sharding type (and a mixed plan), which rows and
columns of every table each rank holds.

The layouts follow TorchRec's conventions (row-wise: blocks of ``ceil(rows / n)`` rows in rank
order; column-wise: equal column blocks in rank order), so each side can translate a plan into
its own types and the harness can check, table by table, that the two libraries were handed
the same shards (``torchrec_side`` / ``embshard_side`` compare their plans with these).

Per kind, on ``world_size`` ranks in nodes of ``local_size`` ranks (default: one node):

* ``data_parallel``: every table replicated (no shards);
* ``table_wise``: table ``i`` whole on the least-loaded rank (by rows x dim, ties to the lower
  rank), so the ranks hold about the same bytes;
* ``row_wise``: row blocks over all ranks;
* ``table_row_wise``: row blocks over the ranks of one node, nodes taken in turn (on one node
  this is row-wise's layout, served by a different code path);
* ``column_wise``: ``world_size`` column blocks, block ``j`` on rank ``j``;
* ``grid_shard``: one column block per node, each cut row-wise over that node's ranks (both
  libraries put at most one column block of a table on a node: TorchRec's ``grid_shard`` helper
  takes one host index per block, embshard refuses two blocks on one node); on one node this is
  table-row-wise's layout, served by the grid code path;
* ``mixed``: W1: one table each table-wise, row-wise, column-wise and data-parallel. W2 and W4:
  the tiny tables (<= 2,000 rows) data-parallel, the ones with the most rows (W2's capped
  200,000, W4's 4,000,000) row-wise, the largest middle one column-wise, the other middle ones
  table-wise (balanced).

Column-wise and grid plans cut a dim into equal blocks of a multiple of 4 columns (what both
libraries' fused kernels take); a table that cannot be so cut raises ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.compare.workloads import Workload

SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "grid_shard",
)
PLAN_KINDS = (*SHARDING_TYPES, "mixed")


@dataclass(frozen=True)
class Shard:
    """One shard: ``rows x cols`` starting at ``(row_offset, col_offset)``, on ``rank``."""

    rank: int
    row_offset: int
    col_offset: int
    rows: int
    cols: int


@dataclass(frozen=True)
class TablePlan:
    """How one table is sharded (``shards`` is ``None`` for data-parallel)."""

    sharding_type: str
    ranks: tuple[int, ...]
    shards: tuple[Shard, ...] | None


Plan = dict[str, TablePlan]
"""Table name -> its sharding, in the workload's table order."""


def row_blocks(rows: int, n: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of ``n`` row-wise blocks of ``ceil(rows / n)`` rows (last ones short)."""
    block = -(-rows // n)
    return [(min(r * block, rows), max(0, min(block, rows - r * block))) for r in range(n)]


def col_blocks(dim: int, n: int, table: str) -> list[tuple[int, int]]:
    """``(offset, width)`` of ``n`` equal column blocks."""
    if dim % n or (dim // n) % 4:
        raise ValueError(
            f"table {table!r}: dim {dim} cannot be cut into {n} column blocks of a multiple of 4"
        )
    w = dim // n
    return [(j * w, w) for j in range(n)]


def table_wise(rows: int, dim: int, rank: int) -> TablePlan:
    """The whole table on ``rank``."""
    return TablePlan("table_wise", (rank,), (Shard(rank, 0, 0, rows, dim),))


def row_wise(kind: str, rows: int, dim: int, ranks: list[int]) -> TablePlan:
    """``kind`` (a row-wise type): one block of :func:`row_blocks` per rank of ``ranks``."""
    shards = tuple(
        Shard(r, off, 0, n, dim)
        for r, (off, n) in zip(ranks, row_blocks(rows, len(ranks)), strict=True)
    )
    return TablePlan(kind, tuple(ranks), shards)


def column_wise(name: str, rows: int, dim: int, ranks: list[int]) -> TablePlan:
    """One block of :func:`col_blocks` per rank of ``ranks``."""
    blocks = col_blocks(dim, len(ranks), name)
    shards = tuple(Shard(r, 0, off, rows, w) for r, (off, w) in zip(ranks, blocks, strict=True))
    return TablePlan("column_wise", tuple(ranks), shards)


def _grid(name: str, rows: int, dim: int, nodes: list[list[int]]) -> TablePlan:
    shards = []
    for (off, w), node in zip(col_blocks(dim, len(nodes), name), nodes, strict=True):
        for r, (roff, n) in zip(node, row_blocks(rows, len(node)), strict=True):
            shards.append(Shard(r, roff, off, n, w))
    return TablePlan("grid_shard", tuple(s.rank for s in shards), tuple(shards))


def nodes_of(world_size: int, local_size: int) -> list[list[int]]:
    """The ranks of each node (``local_size`` consecutive ranks)."""
    if local_size <= 0 or world_size % local_size:
        raise ValueError(
            f"{world_size} ranks cannot be split into nodes of {local_size} ranks; pass a "
            "local size that divides the world size"
        )
    return [list(range(n, n + local_size)) for n in range(0, world_size, local_size)]


def data_parallel() -> TablePlan:
    """Replicated on every rank."""
    return TablePlan("data_parallel", (), None)


class _Balancer:
    """Places whole tables on the rank holding the fewest bytes so far."""

    def __init__(self, world: int) -> None:
        self.load = [0] * world

    def pick(self, size: int) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[rank] += size
        return rank


def make_plan(
    kind: str, workload: Workload, world_size: int, local_size: int | None = None
) -> Plan:
    """The plan of ``kind`` (one of :data:`PLAN_KINDS`) for ``workload`` on ``world_size`` ranks.

    Args:
        kind: the sharding type, or ``"mixed"``.
        workload: the tables.
        world_size: the number of ranks.
        local_size: ranks per node (default: all ranks on one node).

    Raises:
        ValueError: an unknown kind, or a table that cannot be cut so (named).
    """
    if kind not in PLAN_KINDS:
        raise ValueError(f"unknown plan kind {kind!r}; expected one of {', '.join(PLAN_KINDS)}")
    ranks = list(range(world_size))
    nodes = nodes_of(world_size, local_size or world_size)
    balancer = _Balancer(world_size)
    plan: Plan = {}
    for i, t in enumerate(workload.tables):
        if kind == "data_parallel":
            plan[t.name] = data_parallel()
        elif kind == "table_wise":
            plan[t.name] = table_wise(t.rows, t.dim, balancer.pick(t.rows * t.dim))
        elif kind == "row_wise":
            plan[t.name] = row_wise(kind, t.rows, t.dim, ranks)
        elif kind == "table_row_wise":
            plan[t.name] = row_wise(kind, t.rows, t.dim, nodes[i % len(nodes)])
        elif kind == "column_wise":
            plan[t.name] = column_wise(t.name, t.rows, t.dim, ranks)
        elif kind == "grid_shard":
            plan[t.name] = _grid(t.name, t.rows, t.dim, nodes)
        else:
            plan[t.name] = _mixed(workload, i, ranks, balancer)
    return plan


def _mixed(workload: Workload, i: int, ranks: list[int], balancer: _Balancer) -> TablePlan:
    t = workload.tables[i]
    if len({(u.rows, u.dim) for u in workload.tables}) == 1:  # W1: one table of each kind
        choice = ("table_wise", "row_wise", "column_wise", "data_parallel")[i % 4]
    else:
        middle = [
            u for u in workload.tables if 2_000 < u.rows < max(v.rows for v in workload.tables)
        ]
        if t.rows <= 2_000:
            choice = "data_parallel"
        elif not any(u is t for u in middle):
            choice = "row_wise"
        elif t is max(middle, key=lambda u: u.rows):
            choice = "column_wise"
        else:
            choice = "table_wise"
    if choice == "table_wise":
        return table_wise(t.rows, t.dim, balancer.pick(t.rows * t.dim))
    if choice == "row_wise":
        return row_wise("row_wise", t.rows, t.dim, ranks)
    if choice == "column_wise":
        return column_wise(t.name, t.rows, t.dim, ranks)
    return data_parallel()


def describe(plan: Plan) -> dict[str, int]:
    """Sharding type -> number of tables (for the report)."""
    out: dict[str, int] = {}
    for tp in plan.values():
        out[tp.sharding_type] = out.get(tp.sharding_type, 0) + 1
    return out
