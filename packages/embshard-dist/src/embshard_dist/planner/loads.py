"""Per-rank load bookkeeping for the partitioner: placing one option's pieces on ranks.

:func:`place` puts an option's fixed cost on every rank, then each unit where it ends soonest
among the allowed ranks (or nodes) with memory left that hold no other unit of the option.

Guarantees: deterministic (ties go to the lowest rank or node); a placement never puts a rank
over its usable memory, nor two units of one option (two column blocks of a table) on one rank
or node, which the sharders refuse; ``apply`` then ``remove`` restores memory exactly.
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
    """An option with its units placed, and the seconds, device and host bytes it adds per rank."""

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
        # Longest-processing-time order: heaviest tables (their cheapest option) first, then by name.
        self.order = sorted(
            range(len(self.options)),
            key=lambda i: (-self.min_total[i], self.options[i][0].table.table.key),
        )


class LoadState:
    """Each rank's load so far, over ``n`` ranks."""

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
        """Latency every rank gets from placing an option of ``kind`` now (with any mixing copy)."""
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
            self.ov -= self.new_overhead(kind, ctx)

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
                if r in placement:
                    continue
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
            if node in placement:
                continue
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
