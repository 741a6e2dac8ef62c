"""Property: over random tables and topologies, plans never exceed any rank's memory, and
inputs that cannot fit are refused with a ``PlannerError`` that says why."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.cost_model import CostModel, load_tables, usable_memory
from embshard_dist.planner.enumerate import (
    SHARDING_TYPE_ORDER,
    DefaultCapabilities,
    enumerate_options,
)
from embshard_dist.planner.estimate import estimate_plan
from embshard_dist.planner.loads import LoadState, PartitionContext
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.search import _placements
from embshard_dist.planner.stats import PlannerError
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_types.plan import EmbeddingModuleShardingPlan


@st.composite
def _problems(
    draw: st.DrawFn,
) -> tuple[Topology, list[PlannerTable], dict[str, ParameterConstraints], str]:
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.integers(1, 3))
    memory = draw(st.sampled_from([1 << 18, 1 << 20, 4 << 20, 16 << 20, 256 << 20]))
    topo = Topology(
        world_size=nodes * per_node,
        local_world_size=per_node,
        memory_per_rank=memory,
        intra_node_bw=draw(st.sampled_from([1e8, 2e9, 5e10])),
        inter_node_bw=draw(st.sampled_from([5e7, 1e9])),
    )
    count = draw(st.integers(1, 7))
    tables, constraints = [], {}
    for i in range(count):
        name = f"t{i}"
        rows = draw(st.sampled_from([1, 7, 100, 3_000, 20_000, 150_000]))
        dim = draw(st.sampled_from([4, 6, 16, 64, 128]))
        tables.append(PlannerTable(name, rows, dim, path=draw(st.sampled_from(["", "m"]))))
        types = draw(
            st.one_of(
                st.none(),
                st.lists(st.sampled_from(SHARDING_TYPE_ORDER), min_size=1, max_size=3, unique=True),
            )
        )
        ranks = draw(
            st.one_of(
                st.none(),
                st.lists(st.integers(0, topo.world_size - 1), min_size=1, max_size=2, unique=True),
            )
        )
        constraints[name] = ParameterConstraints(
            sharding_types=tuple(types) if types else None,
            pooling_factors=(draw(st.sampled_from([0.5, 1.0, 10.0, 50.0])),),
            ranks=tuple(ranks) if ranks else None,
        )
    search = draw(st.sampled_from(["greedy", "beam", "auto"]))
    return topo, tables, constraints, search


def _fits_somewhere(
    topo: Topology,
    tables: list[PlannerTable],
    constraints: dict[str, ParameterConstraints],
    budget: int,
) -> bool | None:
    """Depth-first search for any partition that fits (None: budget exhausted)."""
    model = CostModel(topo)
    loaded = load_tables(tables, constraints, 64)
    try:
        options = enumerate_options(loaded, [DefaultCapabilities()] * len(tables), model)
    except ValueError:
        return False
    ctx = PartitionContext(options, model, usable_memory(topo.memory_per_rank, 0.1, 0))
    steps = [0]

    def rec(i: int, state: LoadState) -> bool | None:
        if i == len(options):
            return True
        inconclusive = False
        for opt in options[i]:
            for p in _placements(opt, state, ctx, symmetric=False):
                steps[0] += 1
                if steps[0] > budget:
                    return None
                state.apply(p, ctx)
                found = rec(i + 1, state)
                state.remove(p, ctx)
                if found:
                    return True
                inconclusive |= found is None
        return None if inconclusive else False

    return rec(0, LoadState(topo.world_size))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_plans_fit_in_memory_or_are_refused_cleanly(
    problem: tuple[Topology, list[PlannerTable], dict[str, ParameterConstraints], str],
) -> None:
    topo, tables, constraints, search = problem
    planner = EmbeddingShardingPlanner(topo, constraints=constraints, batch_size=64, search=search)  # type: ignore[arg-type]
    try:
        plan = planner.plan(tables, [DefaultCapabilities()])
    except PlannerError as e:
        message = str(e)
        event("refused: " + ("fits nowhere" if "fits nowhere" in message else "too big"))
        assert message.startswith("no sharding plan fits") or message.startswith(
            "no memory is left"
        )
        assert "To fix:" in message or "use ranks with more memory" in message
        if "fits nowhere" in message:
            # The heuristic gave up: no partition may exist that a full search finds.
            assert _fits_somewhere(topo, tables, constraints, budget=20_000) is not True
        elif "fit no rank" in message:
            assert any(f"'{t.key}' needs at least" in message for t in tables)
        return
    except ValueError as e:
        # Constraints that allow a table no option (e.g. row-wise on a subset of ranks).
        assert "has no sharding option" in str(e)
        event("no option")
        return
    event("planned")
    # An independent estimate of the returned plan: every rank within its usable memory.
    estimate = estimate_plan(plan, tables, topo, constraints=constraints, batch_size=64)
    for rank in estimate.ranks:
        assert rank.storage <= rank.usable, (rank, plan)
    planned = {
        (path, name)
        for path, mp in plan.items()
        if isinstance(mp, EmbeddingModuleShardingPlan)
        for name in mp
    }
    assert planned == {(t.path, t.name) for t in tables}
    for t in tables:
        ps = plan[t.path][t.name]  # type: ignore[index]
        c = constraints[t.name]
        if c.sharding_types:
            assert ps.sharding_type in c.sharding_types
        if c.ranks:
            assert set(ps.all_ranks()) <= set(c.ranks) or ps.sharding_type.value == "data_parallel"


def test_a_plan_that_cannot_fit_is_refused() -> None:
    topo = Topology(world_size=2, memory_per_rank=1 << 20)
    tables = [PlannerTable("t", 1_000_000, 64)]
    planner = EmbeddingShardingPlanner(topo)
    try:
        planner.plan(tables, [DefaultCapabilities()])
    except PlannerError as e:
        assert "'t' needs at least" in str(e)
    else:
        raise AssertionError("a 256 MB table was planned into 2 ranks of 1 MiB")
