"""What the planner prints with a plan, and what it says when no plan fits.

:func:`format_stats` renders a ``PlanEstimate`` per rank, per table, with the imbalance and the
critical path; :func:`no_fit_error` builds the :class:`PlannerError` naming what does not fit
and which constraint to relax.

Guarantees: pure, deterministic formatting (no I/O, no logging).
"""

from __future__ import annotations

from collections.abc import Sequence

from embshard_dist.planner.enumerate import ShardingOption
from embshard_dist.planner.estimate import PlanEstimate
from embshard_dist.planner.loads import LoadState
from embshard_types.text_table import tabulate
from embshard_types.vocab import ShardingType

__all__ = ["PlannerError", "format_bytes", "format_stats", "no_fit_error"]


class PlannerError(ValueError):
    """No sharding plan satisfies the memory limits and constraints (the message says why)."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _ranks(ranks: Sequence[int] | None) -> str:
    if not ranks:
        return "-"
    distinct = sorted(set(ranks))
    if len(distinct) > 2 and distinct == list(range(distinct[0], distinct[-1] + 1)):
        return f"{distinct[0]}-{distinct[-1]}"
    return ",".join(map(str, ranks))


def format_stats(estimate: PlanEstimate, *, title: str = "", top: int = 5) -> str:
    """The stats table of a plan.

    Args:
        title: a first line (e.g. how the plan was found).
        top: how many tables the critical path lists.
    """
    topo = estimate.topology
    lines = [title] if title else []
    lines.append(
        f"{len(estimate.tables)} tables on {topo.world_size} ranks ({topo.compute_device}, "
        f"{topo.num_nodes} node(s) of {topo.ranks_per_node}); topology: {topo.source}"
    )
    cuda = topo.compute_device == "cuda"
    headers = ["rank", "memory used / usable (capacity)", "compute ms", "comms ms", "total ms"]
    if cuda:
        headers.insert(2, "host memory used / capacity")
    rows = []
    for r in estimate.ranks:
        row: list[object] = [
            r.rank,
            f"{format_bytes(r.storage)} / {format_bytes(r.usable)} ({format_bytes(r.capacity)})",
            f"{r.compute_ms:.2f}",
            f"{r.comms_ms:.2f}",
            f"{r.total_ms:.2f}",
        ]
        if cuda:
            row.insert(2, f"{format_bytes(r.host_storage)} / {format_bytes(r.host_capacity)}")
        rows.append(row)
    lines += ["", tabulate(rows, headers, title="per rank:")]
    table_rows = [
        [
            t.key,
            t.sharding.sharding_type.value,
            t.sharding.compute_kernel.value,
            _ranks(t.sharding.ranks),
            len(t.sharding.shards) if t.sharding.shards else topo.world_size,
            format_bytes(t.storage),
            f"{t.max_ms:.2f}",
        ]
        for t in estimate.tables
    ]
    table_headers = [
        "table", "sharding type", "kernel", "ranks", "shards", "memory", "ms (busiest rank)"
    ]  # fmt: skip
    lines += ["", tabulate(table_rows, table_headers, title="per table:", empty="no tables")]
    mem_note = f"memory largest/mean {estimate.storage_imbalance:.3f}"
    lines += ["", f"imbalance: time slowest/mean {estimate.imbalance:.3f}, {mem_note}"]
    lines.append(_critical_path(estimate, top))
    return "\n".join(lines)


def _critical_path(estimate: PlanEstimate, top: int) -> str:
    crit = estimate.critical_rank
    r = estimate.ranks[crit]
    latency = estimate.overhead.time_s * 1e3
    heavy = sorted(
        (
            (t.per_rank[crit].time_s * 1e3, t.key, t.sharding.sharding_type.value)
            for t in estimate.tables
            if crit in t.per_rank
        ),
        key=lambda x: (-x[0], x[1]),
    )[:top]
    listed = ", ".join(f"{key} {ms:.2f} ms ({kind})" for ms, key, kind in heavy) or "none"
    return (
        f"critical path: rank {crit}, {r.total_ms:.2f} ms = compute {r.compute_ms:.2f} + comms "
        f"{r.comms_ms - latency:.2f} + collective latency {latency:.2f}; its heaviest tables: "
        f"{listed}"
    )


_SPREADING = (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_ROW_WISE)


def _total_storage(opt: ShardingOption) -> int:
    return sum(opt.base_storage) + sum(sum(u.storage) for u in opt.units)


def no_fit_error(
    options: Sequence[Sequence[ShardingOption]],
    table_index: int,
    state: LoadState,
    usable: int,
    capacity: int,
    reserve_fraction: float,
    dense_bytes: int,
) -> PlannerError:
    """The error for a partition that failed at ``table_index``.

    Args:
        usable: device bytes per rank for tables.
        capacity: device bytes per rank.
        dense_bytes: bytes of the dense parameters on every rank.
    """
    n = len(state.mem)
    budget = (
        f"each of the {n} ranks has {format_bytes(usable)} for tables ({format_bytes(capacity)} "
        f"capacity less a {reserve_fraction:.0%} reserve"
        + (f" and {format_bytes(4 * dense_bytes)} for the dense part)" if dense_bytes else ")")
    )
    too_big = []
    for opts in options:
        least = min(opts, key=lambda o: (o.min_storage_per_rank(), o.label))
        if least.min_storage_per_rank() > usable:
            too_big.append((opts[0].table.table.key, least, opts))
    hints = [
        "use more ranks or ranks with more memory (Topology.memory_per_rank)",
        "lower the planner's reserve_fraction",
        "lower the batch size or pooling factors (the input and output buffers grow with them)",
    ]
    if too_big:
        parts = []
        for key, least, opts in too_big:
            allowed = sorted({o.sharding_type.value for o in opts})
            missing = [k.value for k in _SPREADING if k.value not in allowed]
            parts.append(
                f"{key!r} needs at least {format_bytes(least.min_storage_per_rank())} on one rank "
                f"(its smallest option: {least.label}; allowed: {', '.join(allowed)})"
                + (
                    f"; allow {' or '.join(missing)} in its ParameterConstraints.sharding_types"
                    if missing
                    else ""
                )
            )
        return PlannerError(
            f"no sharding plan fits: {len(too_big)} table(s) fit no rank whichever allowed option "
            f"is used: {'; '.join(parts)}. {budget}. To fix: {'; or '.join(hints)}"
        )
    least_total = sum(min(_total_storage(o) for o in opts) for opts in options)
    if least_total > usable * n:
        return PlannerError(
            f"no sharding plan fits: the tables need at least {format_bytes(least_total)} in all "
            f"(each in its smallest option) but the {n} ranks have {format_bytes(usable * n)} "
            f"for tables; {budget}. To fix: {'; or '.join(hints)}"
        )
    key = options[table_index][0].table.table.key
    need = min(o.min_storage_per_rank() for o in options[table_index])
    free = ", ".join(f"rank {r}: {format_bytes(usable - m)}" for r, m in enumerate(state.mem))
    return PlannerError(
        f"no sharding plan fits: after placing {sum(state.counts.values())} table(s), table "
        f"{key!r} (needs at least {format_bytes(need)} on a rank) fits nowhere; memory left "
        f"for tables: {free}. {budget}. To fix: allow more sharding types for {key!r} and the "
        f"largest tables (row_wise and column_wise spread a table over ranks), or "
        f"{'; or '.join(hints)}"
    )
