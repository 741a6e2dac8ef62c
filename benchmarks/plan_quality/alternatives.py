"""Hand-made plans beside the planners' own: what else a planner could have picked.

The plan-quality target asks for a plan well ahead of TorchRec's planner's; these plans check
whether such a plan exists for a workload, by timing the mixtures a planner would consider
(all as library-neutral plans of ``benchmarks.compare.plans``, translated like the single
sharding types):

* ``dp-small+tw``: data-parallel for every table of at most :data:`SMALL_ROWS` rows (no input or
  output all-to-all for them; their gradients are exchanged instead), table-wise for the rest;
* ``rw-large+tw`` / ``cw-large+tw``: row-wise / column-wise over all ranks for every table of at
  least :data:`LARGE_ROWS` rows (their lookups and updates split across ranks), table-wise for
  the rest;
* ``dp-small+rw-large+tw``: both at once.

Table-wise tables are placed by count (every table of a workload reads the same number of ids
per bag), largest first, on the rank with the fewest tables, then the fewest rows, so each plan
is balanced the way the planners balance it.

Guarantees: the same workload and world size give the same plans; a mixture that would not mix
(one of its rules matches no table, or no table is left table-wise) is left out rather than
repeating a single-type plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.compare import plans
from benchmarks.compare.plans import Plan, TablePlan
from benchmarks.compare.workloads import Table, Workload
from benchmarks.plan_quality.plans import from_neutral

SMALL_ROWS = 1_000
"""Tables this small cost less to exchange whole than to send per sample (W2: 10 of 26)."""
LARGE_ROWS = 100_000
"""Tables this large are the ones whose lookups miss the caches (W2: 8 of 26)."""

Rule = Callable[[Table, int], TablePlan | None]


def _data_parallel(table: Table, world: int) -> TablePlan | None:
    return plans.data_parallel() if table.rows <= SMALL_ROWS else None


def _row_wise(table: Table, world: int) -> TablePlan | None:
    if table.rows < LARGE_ROWS:
        return None
    return plans.row_wise("row_wise", table.rows, table.dim, list(range(world)))


def _column_wise(table: Table, world: int) -> TablePlan | None:
    if table.rows < LARGE_ROWS or table.dim % (4 * world):  # blocks of a multiple of 4
        return None
    return plans.column_wise(table.name, table.rows, table.dim, list(range(world)))


MIXTURES: dict[str, tuple[Rule, ...]] = {
    "dp-small+tw": (_data_parallel,),
    "rw-large+tw": (_row_wise,),
    "cw-large+tw": (_column_wise,),
    "dp-small+rw-large+tw": (_data_parallel, _row_wise),
}


def _mixture(workload: Workload, world: int, rules: tuple[Rule, ...]) -> Plan | None:
    plan: dict[str, TablePlan] = {}
    used: set[int] = set()
    for table in workload.tables:
        for k, rule in enumerate(rules):
            chosen = rule(table, world)
            if chosen is not None:
                plan[table.name] = chosen
                used.add(k)
                break
    if len(used) < len(rules) or len(plan) == len(workload.tables):
        return None
    count, rows = [0] * world, [0] * world
    for table in sorted(workload.tables, key=lambda t: (-t.rows, t.name)):
        if table.name in plan:
            continue
        r = min(range(world), key=lambda k: (count[k], rows[k], k))
        count[r] += 1
        rows[r] += table.rows
        plan[table.name] = plans.table_wise(table.rows, table.dim, r)
    return {t.name: plan[t.name] for t in workload.tables}


def alternative_plans(workload: Workload, world: int) -> dict[str, Any]:
    """Label -> embshard ``ShardingPlan`` of every mixture that mixes something on ``workload``."""
    out: dict[str, Any] = {}
    for label, rules in MIXTURES.items():
        plan = _mixture(workload, world, rules)
        if plan is not None:
            out[label] = from_neutral(plan, world)
    return out
