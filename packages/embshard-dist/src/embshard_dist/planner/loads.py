"""Per-rank load bookkeeping for the partitioner: placing one option's pieces on ranks.

:class:`LoadState` holds each rank's estimated time and memory so far and which sharding types
are in use (each type in use adds its collectives' latency to every rank, and using more than
one type the copy that puts their outputs side by side: ``costs.mixing_cost``). :func:`place` puts
one option on the state: its fixed per-rank cost, then each unit on the allowed rank (or node)
where it ends soonest, among those with memory left; it returns ``None`` when no placement fits.

Guarantees: deterministic (ties go to the lowest rank or node); a placement returned never puts
any rank over its usable memory (device, and host on CUDA); ``apply`` then ``remove`` of the
same placement restores the state exactly for memory (integers) and up to float rounding for
time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from embshard_dist.planner.cost_model import CostModel
from embshard_dist.planner.costs import collective_overhead, mixing_cost
from embshard_dist.planner.enumerate import ShardingOption
from embshard_types.vocab import ShardingType

__all__ = ["LoadState", "PartitionContext", "Placed", "place", "score_after"]


@dataclass(frozen=True)
class Placed:
    """An option with its units placed, and what it adds to each rank.

    Args:
        option: the option.
        placement: the rank or node of each unit.
        dt: seconds added per rank.
        dm: device bytes added per rank.
        dh: host bytes added per rank.
    """

    option: ShardingOption
    placement: tuple[int, ...]
    dt: tuple[float, ...]
    dm: tuple[int, ...]
    dh: tuple[int, ...]

    @property
    def total_s(self) -> float:
        """Seconds added over all ranks."""
        return sum(self.dt)


class PartitionContext:
    """What the partitioner needs besides the state: options, capacities, nodes, latencies.

    Args:
        options: the options of each table.
        model: the cost model.
        usable: device bytes each rank may give to tables.
        host_usable: host bytes each rank may give to UVM tables (CUDA).
    """

    def __init__(
        self,
        options: Sequence[Sequence[ShardingOption]],
        model: CostModel,
        usable: int,
        host_usable: int | None = None,
    ) -> None:
        topo = model.topology
        self.options = [list(o) for o in options]
        self.model = model
        self.n = topo.world_size
        self.nodes = [topo.node_ranks(i) for i in range(topo.num_nodes)]
        self.cap = [usable] * self.n
        self.host_cap = [sys.maxsize if host_usable is None else host_usable] * self.n
        self.overhead = {k: collective_overhead(k, model).time_s for k in ShardingType}
        self.mixing = mixing_cost([opts[0].table for opts in self.options if opts], model).time_s
        self.min_total = [min(o.total_s for o in opts) for opts in self.options]
        # Heaviest tables first (their cheapest option), then by name: longest-processing-time.
        self.order = sorted(
            range(len(self.options)),
            key=lambda i: (-self.min_total[i], self.options[i][0].table.table.key),
        )


class LoadState:
    """Each rank's load so far.

    Args:
        n: number of ranks.
    """

    __slots__ = ("counts", "host", "mem", "n", "ov", "time")

    def __init__(self, n: int) -> None:
        self.n = n
        self.time = [0.0] * n
        self.mem = [0] * n
        self.host = [0] * n
        self.counts: dict[ShardingType, int] = {}
        self.ov = 0.0

    def copy(self) -> LoadState:
        """An independent copy."""
        other = LoadState.__new__(LoadState)
        other.n = self.n
        other.time = list(self.time)
        other.mem = list(self.mem)
        other.host = list(self.host)
        other.counts = dict(self.counts)
        other.ov = self.ov
        return other

    def new_overhead(self, kind: ShardingType, ctx: PartitionContext) -> float:
        """Latency added to every rank if an option of ``kind`` is placed now (its type's, and
        the mixing copy when it is the second type in use)."""
        if self.counts.get(kind, 0):
            return 0.0
        return ctx.overhead[kind] + (ctx.mixing if len(self.counts) == 1 else 0.0)

    def apply(self, p: Placed, ctx: PartitionContext) -> None:
        """Add a placed option."""
        for r in range(self.n):
            self.time[r] += p.dt[r]
            self.mem[r] += p.dm[r]
            self.host[r] += p.dh[r]
        kind = p.option.sharding_type
        self.ov += self.new_overhead(kind, ctx)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def remove(self, p: Placed, ctx: PartitionContext) -> None:
        """Take a placed option back out."""
        for r in range(self.n):
            self.time[r] -= p.dt[r]
            self.mem[r] -= p.dm[r]
            self.host[r] -= p.dh[r]
        kind = p.option.sharding_type
        self.counts[kind] -= 1
        if not self.counts[kind]:
            del self.counts[kind]
            self.ov -= self.new_overhead(kind, ctx)  # what placing it again would add back

    @property
    def max_s(self) -> float:
        """The slowest rank's time (with the latency of the types in use)."""
        return max(self.time) + self.ov

    @property
    def sum_s(self) -> float:
        """Time summed over ranks (with latencies)."""
        return sum(self.time) + self.n * self.ov

    def objective(self) -> tuple[float, float]:
        """``(slowest rank, sum of squared rank times)``: lower is better."""
        return self.max_s, sum((t + self.ov) ** 2 for t in self.time)


def place(opt: ShardingOption, st: LoadState, ctx: PartitionContext) -> Placed | None:
    """Place ``opt`` on ``st`` greedily, or ``None`` when memory runs out everywhere."""
    n = ctx.n
    cap, hcap = ctx.cap, ctx.host_cap
    dt = list(opt.base_time)
    dm = list(opt.base_storage)
    dh = list(opt.base_host)
    if opt.has_base:
        for r in range(n):
            if st.mem[r] + dm[r] > cap[r] or st.host[r] + dh[r] > hcap[r]:
                return None
    placement: list[int] = []
    for unit in opt.units:
        if not unit.node:
            ut, um, uh = unit.time_s[0], unit.storage[0], unit.host[0]
            best_key: tuple[float, float, int] | None = None
            for r in opt.allowed_ranks:
                m = st.mem[r] + dm[r] + um
                if m > cap[r] or st.host[r] + dh[r] + uh > hcap[r]:
                    continue
                key = (st.time[r] + dt[r] + ut, m / cap[r] if cap[r] > 0 else 0.0, r)
                if best_key is None or key < best_key:
                    best_key = key
            if best_key is None:
                return None
            r = best_key[2]
            dt[r] += ut
            dm[r] += um
            dh[r] += uh
            placement.append(r)
            continue
        best_node: tuple[float, float, int] | None = None
        for node in opt.allowed_nodes:
            ranks = ctx.nodes[node]
            worst, total, fits = 0.0, 0.0, True
            for i, r in enumerate(ranks):
                if (
                    st.mem[r] + dm[r] + unit.storage[i] > cap[r]
                    or st.host[r] + dh[r] + unit.host[i] > hcap[r]
                ):
                    fits = False
                    break
                t = st.time[r] + dt[r] + unit.time_s[i]
                worst = max(worst, t)
                total += t
            if fits and (best_node is None or (worst, total, node) < best_node):
                best_node = (worst, total, node)
        if best_node is None:
            return None
        node = best_node[2]
        for i, r in enumerate(ctx.nodes[node]):
            dt[r] += unit.time_s[i]
            dm[r] += unit.storage[i]
            dh[r] += unit.host[i]
        placement.append(node)
    return Placed(opt, tuple(placement), tuple(dt), tuple(dm), tuple(dh))


def score_after(st: LoadState, p: Placed, ctx: PartitionContext) -> tuple[float, float]:
    """``(slowest rank, time summed over ranks)`` once ``p`` is added to ``st``."""
    ov = st.ov + st.new_overhead(p.option.sharding_type, ctx)
    new_max = max(t + d for t, d in zip(st.time, p.dt, strict=True)) + ov
    new_sum = sum(st.time) + p.total_s + ctx.n * ov
    return new_max, new_sum
