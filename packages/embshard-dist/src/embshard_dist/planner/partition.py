"""Choosing one option per table and placing it: the slowest rank as fast as memory allows.

:func:`partition` runs a greedy proposer (heaviest tables first), a local search, a beam search
within a budget and, for small problems, an exact branch-and-bound that proves optimality.

Guarantees: deterministic (ties broken by index); every partition fits every rank's usable
memory; when nothing fits, :class:`NoFit` says which table could not be placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from embshard_dist.planner.loads import LoadState, PartitionContext, Placed, place, score_after
from embshard_dist.planner.search import SearchResult, beam_search, exact_search

__all__ = ["NoFit", "Partition", "SearchMode", "greedy", "improve", "partition"]

SearchMode = Literal["auto", "greedy", "beam", "exact"]
"""``greedy``: greedy and local search; ``beam``: then beam search; ``exact``: then exact search
whatever the size; ``auto``: beam, then exact for at most ``EXACT_MAX_TABLES`` tables."""

BEAM_BUDGET = 60_000
"""Placements the beam search may try (its width is this over tables x options, 1 to 16)."""

EXACT_MAX_TABLES = 12
"""``auto`` runs the exact search for at most this many tables."""

EXACT_BUDGET = 40_000
"""Placements the exact search may try before it stops."""

_EPS = 1e-12


class NoFit(Exception):
    """No partition fits in memory.

    Args:
        table_index: the first table that could not be placed.
        state: the loads when it failed.
        placed: the tables placed before it (table index -> placed option).
    """

    def __init__(self, table_index: int, state: LoadState, placed: dict[int, Placed]) -> None:
        super().__init__(f"table {table_index} does not fit")
        self.table_index = table_index
        self.state = state
        self.placed = placed


@dataclass(frozen=True)
class Partition:
    """The chosen option and placement of every table.

    Args:
        method: which steps produced it (e.g. ``"beam(16)+local"``).
        optimal: the exact search finished: no partition of the enumerated options is faster.
    """

    choices: tuple[Placed, ...]
    max_s: float
    method: str
    optimal: bool = False


def greedy(ctx: PartitionContext, *, memory_first: bool = False) -> SearchResult:
    """The greedy proposer: each table, heaviest first, where it keeps the step-time bound lowest.

    Args:
        memory_first: rank candidates by the fullest rank's memory share first.

    Raises:
        NoFit: a table fits nowhere.
    """
    st = LoadState(ctx.n)
    placed: dict[int, Placed] = {}
    remaining = sum(ctx.min_total)
    for ti in ctx.order:
        remaining -= ctx.min_total[ti]
        best: tuple[tuple[float, ...], Placed] | None = None
        for oi, opt in enumerate(ctx.options[ti]):
            p = place(opt, st, ctx)
            if p is None:
                continue
            new_max, new_sum = score_after(st, p, ctx)
            if memory_first:
                fullest = max(
                    (m + d) / c if c > 0 else 0.0
                    for m, d, c in zip(st.mem, p.dm, ctx.cap, strict=True)
                )
                key: tuple[float, ...] = (fullest, new_max, new_sum, oi)
            else:
                key = (max(new_max, (new_sum + remaining) / ctx.n), new_sum, new_max, oi)
            if best is None or key < best[0]:
                best = (key, p)
        if best is None:
            raise NoFit(ti, st, placed)
        st.apply(best[1], ctx)
        placed[ti] = best[1]
    return SearchResult(tuple(placed[i] for i in range(len(ctx.options))), st)


def improve(ctx: PartitionContext, result: SearchResult, max_passes: int = 4) -> SearchResult:
    """Local search: re-place one table at a time while (slowest, sum of squares) drops.

    Returns a new partition; ``result`` is left unchanged.
    """
    st = result.state.copy()
    choices = list(result.choices)
    for _ in range(max_passes):
        changed = False
        for ti in ctx.order:
            current = choices[ti]
            before = st.objective()
            st.remove(current, ctx)
            best_obj, best_p = before, current
            for opt in ctx.options[ti]:
                p = place(opt, st, ctx)
                if p is None or (p.option is current.option and p.placement == current.placement):
                    continue
                st.apply(p, ctx)
                obj = st.objective()
                st.remove(p, ctx)
                if obj[0] < best_obj[0] - _EPS or (
                    obj[0] <= best_obj[0] + _EPS and obj[1] < best_obj[1] * (1 - 1e-9)
                ):
                    best_obj, best_p = obj, p
            st.apply(best_p, ctx)
            if best_p is not current:
                choices[ti] = best_p
                changed = True
        if not changed:
            break
    return SearchResult(tuple(choices), st)


def _better(a: SearchResult, b: SearchResult) -> bool:
    oa, ob = a.state.objective(), b.state.objective()
    return oa[0] < ob[0] - _EPS or (oa[0] <= ob[0] + _EPS and oa[1] < ob[1] * (1 - 1e-9))


def partition(
    ctx: PartitionContext,
    *,
    search: SearchMode = "auto",
    beam_budget: int = BEAM_BUDGET,
    exact_budget: int = EXACT_BUDGET,
) -> Partition:
    """Choose and place an option for every table.

    Args:
        beam_budget: placements the beam search may try.
        exact_budget: placements the exact search may try.

    Raises:
        NoFit: nothing fits (from the greedy passes, which both failed).
    """
    try:
        best = greedy(ctx)
    except NoFit as first:
        try:
            best = greedy(ctx, memory_first=True)
        except NoFit:
            # Refuse only when a wider search finds no fit either: greedy passes can corner themselves.
            rescued = _rescue(ctx, beam_budget, exact_budget)
            if rescued is None:
                raise first from None
            best = rescued
    best = improve(ctx, best)
    method = "greedy+local"
    if search in ("beam", "exact", "auto"):
        evaluations = max(1, sum(len(o) for o in ctx.options))
        width = max(1, min(16, beam_budget // evaluations))
        found = beam_search(ctx, width)
        if found is not None:
            found = improve(ctx, found)
            if _better(found, best):
                best, method = found, f"beam({width})+local"
    optimal = False
    if search == "exact" or (search == "auto" and len(ctx.options) <= EXACT_MAX_TABLES):
        exact = exact_search(ctx, best, exact_budget)
        if exact is not None:
            optimal = exact.complete
            if exact.state.max_s < best.state.max_s - _EPS:
                best, method = improve(ctx, exact), "exact"
            elif optimal:
                method += ", proven optimal"
    return Partition(best.choices, best.state.max_s, method, optimal)


def _rescue(ctx: PartitionContext, beam_budget: int, exact_budget: int) -> SearchResult | None:
    """A partition that fits when both greedy passes failed, or ``None`` when none is found."""
    evaluations = max(1, sum(len(o) for o in ctx.options))
    found = beam_search(ctx, max(1, min(64, beam_budget // evaluations)))
    if found is not None:
        return found
    return exact_search(ctx, None, exact_budget)
