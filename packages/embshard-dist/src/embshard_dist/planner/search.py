"""Searches that improve on the greedy partition: a beam search and an exact branch-and-bound.

Both rank partial partitions by a lower bound of the final step time (the slowest rank so far,
or the mean once the remaining tables' cheapest options are added).

Guarantees: deterministic (fixed orders, ties broken by index, budgets counted in steps rather
than seconds); only partitions that fit every rank's memory, with the units of an option on
distinct ranks (or nodes), are returned.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from embshard_dist.planner.enumerate import ShardingOption
from embshard_dist.planner.loads import LoadState, PartitionContext, Placed, place, score_after

__all__ = ["SearchResult", "beam_search", "exact_search"]

_EPS = 1e-12


@dataclass(frozen=True)
class SearchResult:
    """A complete partition found by a search.

    Args:
        choices: the placed option of each table, in table order.
        complete: for the exact search, whether it explored everything (the result is optimal).
    """

    choices: tuple[Placed, ...]
    state: LoadState
    complete: bool = False


def _unwind(chain: Any, count: int) -> tuple[Placed, ...]:
    out: list[Placed | None] = [None] * count
    while chain is not None:
        chain, index, placed = chain
        out[index] = placed
    assert all(p is not None for p in out)
    return tuple(p for p in out if p is not None)


def beam_search(ctx: PartitionContext, width: int) -> SearchResult | None:
    """Beam search of ``width`` partial partitions (``None`` if every beam runs out of memory)."""
    n = ctx.n
    beams: list[tuple[LoadState, Any]] = [(LoadState(n), None)]
    remaining = sum(ctx.min_total)
    for ti in ctx.order:
        remaining -= ctx.min_total[ti]
        candidates = []
        for bi, (st, _) in enumerate(beams):
            for oi, opt in enumerate(ctx.options[ti]):
                p = place(opt, st, ctx)
                if p is None:
                    continue
                new_max, new_sum = score_after(st, p, ctx)
                bound = max(new_max, (new_sum + remaining) / n)
                candidates.append(((bound, new_sum, new_max, bi, oi), bi, p))
        if not candidates:
            return None
        candidates.sort(key=lambda c: c[0])
        kept: list[tuple[LoadState, Any]] = []
        seen: set[tuple[Any, ...]] = set()
        for _, bi, p in candidates:
            st = beams[bi][0].copy()
            st.apply(p, ctx)
            signature = (tuple(round(t, 12) for t in st.time), tuple(st.mem), tuple(st.counts))
            if signature in seen:
                continue
            seen.add(signature)
            kept.append((st, (beams[bi][1], ti, p)))
            if len(kept) == width:
                break
        beams = kept
    best_state, best_chain = min(beams, key=lambda b: b[0].objective())
    return SearchResult(_unwind(best_chain, len(ctx.options)), best_state)


def _placements(
    opt: ShardingOption, st: LoadState, ctx: PartitionContext, symmetric: bool
) -> Iterator[Placed]:
    """Every memory-feasible placement of ``opt``'s units on distinct ranks (or nodes), one per
    class of identical ranks."""
    n = ctx.n
    dt = list(opt.base_time)
    dm = list(opt.base_storage)
    dh = list(opt.base_host)
    if opt.has_base and any(
        st.mem[r] + dm[r] > ctx.cap[r] or st.host[r] + dh[r] > ctx.host_cap[r] for r in range(n)
    ):
        return
    chosen: list[int] = []

    def rec(u: int) -> Iterator[Placed]:
        if u == len(opt.units):
            yield Placed(opt, tuple(chosen), tuple(dt), tuple(dm), tuple(dh))
            return
        unit = opt.units[u]
        if unit.node:
            targets = [(node, list(enumerate(ctx.nodes[node]))) for node in opt.allowed_nodes]
        else:
            targets = [(r, [(0, r)]) for r in opt.allowed_ranks]
        seen: set[tuple[Any, ...]] = set()
        for target, members in targets:
            if target in chosen:
                continue
            if not unit.node and symmetric:
                r = members[0][1]
                key = (st.time[r] + dt[r], st.mem[r] + dm[r], st.host[r] + dh[r])
                if key in seen:
                    continue
                seen.add(key)
            if any(
                st.mem[r] + dm[r] + unit.storage[i] > ctx.cap[r]
                or st.host[r] + dh[r] + unit.host[i] > ctx.host_cap[r]
                for i, r in members
            ):
                continue
            for i, r in members:
                dt[r] += unit.time_s[i]
                dm[r] += unit.storage[i]
                dh[r] += unit.host[i]
            chosen.append(target)
            yield from rec(u + 1)
            chosen.pop()
            for i, r in members:
                dt[r] -= unit.time_s[i]
                dm[r] -= unit.storage[i]
                dh[r] -= unit.host[i]

    yield from rec(0)


def exact_search(
    ctx: PartitionContext, incumbent: SearchResult | None, node_budget: int
) -> SearchResult | None:
    """Branch-and-bound for the partition with the smallest slowest-rank time.

    Args:
        incumbent: the best partition known (its step time prunes the search).
        node_budget: placements to try at most; past it the search stops (not ``complete``).

    Returns:
        The best partition found, ``incumbent`` when none beats it, or ``None`` when there is
        neither; ``complete`` proves it optimal.
    """
    n = len(ctx.order)
    suffix = [0.0] * (n + 1)
    for depth in range(n - 1, -1, -1):
        suffix[depth] = suffix[depth + 1] + ctx.min_total[ctx.order[depth]]
    symmetric = len(ctx.nodes) == 1 and all(
        len(o.allowed_ranks) == ctx.n for opts in ctx.options for o in opts
    )
    best: list[Any] = [None, incumbent.state.max_s if incumbent is not None else float("inf")]
    spent = [0]
    stopped = [False]
    st = LoadState(ctx.n)
    chosen: list[Placed | None] = [None] * len(ctx.options)

    def dfs(depth: int) -> None:
        if depth == n:
            if st.max_s < best[1] - _EPS:
                best[0] = (tuple(p for p in chosen if p is not None), st.copy())
                best[1] = st.max_s
            return
        ti = ctx.order[depth]
        candidates: list[tuple[float, float, int, int, Placed]] = []
        for oi, opt in enumerate(ctx.options[ti]):
            for p in _placements(opt, st, ctx, symmetric):
                spent[0] += 1
                if spent[0] > node_budget:
                    stopped[0] = True
                    return
                new_max, new_sum = score_after(st, p, ctx)
                bound = max(new_max, (new_sum + suffix[depth + 1]) / ctx.n)
                if bound < best[1] - _EPS:
                    candidates.append((bound, new_max, oi, len(candidates), p))
        candidates.sort(key=lambda c: c[:4])
        for bound, _, _, _, p in candidates:
            if stopped[0]:
                return
            if bound >= best[1] - _EPS:
                continue
            st.apply(p, ctx)
            chosen[ti] = p
            dfs(depth + 1)
            chosen[ti] = None
            st.remove(p, ctx)

    dfs(0)
    complete = not stopped[0]
    if best[0] is None:
        if incumbent is None:
            return None
        return SearchResult(incumbent.choices, incumbent.state, complete=complete)
    choices, state = best[0]
    return SearchResult(choices, state, complete=complete)
