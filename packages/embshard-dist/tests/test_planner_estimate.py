"""The cost model: storage and time per shard, per-rank estimates of whole plans, options."""

from __future__ import annotations

import itertools

import pytest

from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.cost_model import CostModel, load_tables
from embshard_dist.planner.costs import holder_cost, replica_cost, sharding_costs
from embshard_dist.planner.enumerate import (
    SHARDING_TYPE_ORDER,
    DefaultCapabilities,
    enumerate_options,
)
from embshard_dist.planner.estimate import estimate_plan
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_dist.strategies.layout import shard_specs
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import ShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType

ADAGRAD_RW = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)


def _loaded(table: PlannerTable, pooling: float = 2.0, batch: int = 10):  # type: ignore[no-untyped-def]
    return load_tables(
        [table], {table.key: ParameterConstraints(pooling_factors=(pooling,))}, batch
    )[0]


def test_table_wise_storage_counts_weights_state_and_buffers() -> None:
    model = CostModel(Topology(world_size=2), ADAGRAD_RW)
    lt = _loaded(PlannerTable("t", 1000, 16))
    cost = holder_cost(lt, ShardingType.TABLE_WISE, ComputeKernel.FUSED, 1000, 16, model)
    weights, state = 1000 * 16 * 4, 1000 * 4
    ids_in, global_bags = 2 * 10 * 2.0, 2 * 10
    buffers = ids_in * 8 + global_bags * 4 + 2 * global_bags * 16 * 4
    assert cost.storage == weights + state + buffers
    assert cost.host_storage == 0
    assert cost.compute_s > 0 and cost.comms_s > 0


def test_pointwise_state_costs_a_value_per_element() -> None:
    topo = Topology(world_size=1)
    lt = _loaded(PlannerTable("t", 1000, 16))
    adam = holder_cost(
        lt,
        ShardingType.TABLE_WISE,
        ComputeKernel.FUSED,
        1000,
        16,
        CostModel(topo, OptimizerSpec(OptimType.ADAM)),
    )
    sgd = holder_cost(
        lt,
        ShardingType.TABLE_WISE,
        ComputeKernel.FUSED,
        1000,
        16,
        CostModel(topo, OptimizerSpec(OptimType.SGD)),
    )
    assert adam.storage - sgd.storage == 2 * 1000 * 16 * 4


def test_one_rank_pays_no_comms() -> None:
    model = CostModel(Topology(world_size=1), ADAGRAD_RW)
    lt = _loaded(PlannerTable("t", 1000, 16))
    assert replica_cost(lt, ComputeKernel.FUSED, model).comms_s == 0
    assert holder_cost(lt, ShardingType.ROW_WISE, ComputeKernel.FUSED, 1000, 16, model).comms_s == 0


def test_cuda_uvm_kernels_keep_the_table_in_host_memory() -> None:
    model = CostModel(
        Topology(world_size=2, compute_device="cuda", host_memory_per_rank=1 << 34), ADAGRAD_RW
    )
    lt = _loaded(PlannerTable("t", 100_000, 64))
    hbm = holder_cost(lt, ShardingType.TABLE_WISE, ComputeKernel.FUSED, 100_000, 64, model)
    uvm = holder_cost(lt, ShardingType.TABLE_WISE, ComputeKernel.FUSED_UVM, 100_000, 64, model)
    cached = holder_cost(
        lt, ShardingType.TABLE_WISE, ComputeKernel.FUSED_UVM_CACHING, 100_000, 64, model
    )
    assert uvm.host_storage == hbm.storage - uvm.storage
    assert uvm.storage < cached.storage < hbm.storage
    assert cached.host_storage == uvm.host_storage


def _tw(rank: int, rows: int, dim: int) -> ParameterSharding:
    specs = shard_specs(ShardingType.TABLE_WISE, rows, dim, [rank])
    assert specs is not None
    return ParameterSharding(ShardingType.TABLE_WISE, ComputeKernel.FUSED, (rank,), tuple(specs))


def test_estimate_plan_of_a_hand_written_plan() -> None:
    tables = [PlannerTable("a", 10_000, 32), PlannerTable("b", 10_000, 32)]
    topo = Topology(world_size=2)
    lopsided = ShardingPlan({"": {"a": _tw(0, 10_000, 32), "b": _tw(0, 10_000, 32)}})
    balanced = ShardingPlan({"": {"a": _tw(0, 10_000, 32), "b": _tw(1, 10_000, 32)}})
    est_l = estimate_plan(lopsided, tables, topo)
    est_b = estimate_plan(balanced, tables, topo)
    assert est_l.critical_rank == 0 and est_l.imbalance > 1.2
    assert est_b.imbalance == pytest.approx(1.0)
    assert est_b.max_ms < est_l.max_ms
    per_rank = est_b.per_rank_ms()
    assert len(per_rank) == 2 and set(per_rank[0]) == {"compute_ms", "comms_ms", "total_ms"}
    assert per_rank[0]["total_ms"] == pytest.approx(
        per_rank[0]["compute_ms"] + per_rank[0]["comms_ms"]
    )
    with pytest.raises(ValueError, match="no sharding for table 'b'"):
        estimate_plan(ShardingPlan({"": {"a": _tw(0, 10_000, 32)}}), tables, topo)
    with pytest.raises(ValueError, match="rank 1 is outside the world of size 1"):
        estimate_plan(balanced, tables, Topology(world_size=1))


def test_cpu_options_include_every_sharding_type() -> None:
    topo = Topology(world_size=4, local_world_size=2)
    model = CostModel(topo, ADAGRAD_RW)
    loaded = [_loaded(PlannerTable("t", 4000, 64))]
    options = enumerate_options(loaded, [DefaultCapabilities()], model)[0]
    kinds = {o.sharding_type for o in options}
    assert kinds == set(SHARDING_TYPE_ORDER)
    labels = {o.label for o in options}
    assert {"column_wise x2 / fused", "column_wise x4 / fused", "grid_shard x2 / fused"} <= labels
    assert all(o.compute_kernel is not ComputeKernel.QUANT for o in options)


def test_every_option_builds_a_sharding_whose_estimate_matches_the_option() -> None:
    """The partitioner balances option costs; the estimate of the built plan must agree."""
    topo = Topology(world_size=4, local_world_size=2)
    model = CostModel(topo, ADAGRAD_RW)
    loaded = [_loaded(PlannerTable("t", 4001, 64))]
    for opt in enumerate_options(loaded, [DefaultCapabilities()], model)[0]:
        targets = [
            list(opt.allowed_nodes) if u.node else list(opt.allowed_ranks) for u in opt.units
        ]
        for placement in itertools.islice(itertools.product(*targets), 6):
            ps = opt.build(placement, model)
            ps.check_world(4)
            expected = [c.time_s for c in opt.base]
            storage = list(opt.base_storage)
            for unit, where in zip(opt.units, placement, strict=True):
                ranks = topo.node_ranks(where) if unit.node else [where]
                for i, r in enumerate(ranks):
                    expected[r] += unit.costs[i].time_s
                    storage[r] += unit.costs[i].storage
            got = sharding_costs(loaded[0], ps, model)
            assert [c.storage for c in got] == storage, opt.label
            assert [c.time_s for c in got] == pytest.approx(expected, rel=1e-12), opt.label
            if ps.shards is not None:
                covered = sum(s.sizes[0] * s.sizes[1] for s in ps.shards)
                assert covered == 4001 * 64, opt.label


def test_constraints_restrict_options_and_force_ranks() -> None:
    topo = Topology(world_size=4)
    model = CostModel(topo, ADAGRAD_RW)
    t = PlannerTable("t", 4000, 64)
    forced = load_tables([t], {"t": ParameterConstraints(ranks=(2,))}, 16)
    options = enumerate_options(forced, [DefaultCapabilities()], model)[0]
    kinds = {o.sharding_type for o in options}
    assert ShardingType.ROW_WISE not in kinds and ShardingType.DATA_PARALLEL not in kinds
    assert all(o.allowed_ranks == (2,) for o in options)
    narrow = load_tables(
        [t],
        {
            "t": ParameterConstraints(
                sharding_types=("column_wise",), min_partition=32, compute_kernels=("fused",)
            )
        },
        16,
    )
    labels = [o.label for o in enumerate_options(narrow, [DefaultCapabilities()], model)[0]]
    assert labels == ["column_wise x2 / fused"]


def test_a_table_without_options_is_named() -> None:
    model = CostModel(Topology(world_size=2), ADAGRAD_RW)
    loaded = load_tables(
        [PlannerTable("t", 10, 8)],
        {"t": ParameterConstraints(sharding_types=("row_wise",), ranks=(1,))},
        16,
    )
    with pytest.raises(ValueError, match="table 't' has no sharding option on cpu with 2 ranks"):
        enumerate_options(loaded, [DefaultCapabilities()], model)


def test_quantized_tables_are_priced_as_packed_rows_without_optimizer_state() -> None:
    model = CostModel(Topology(world_size=2), ADAGRAD_RW)
    fp32 = _loaded(PlannerTable("t", 1000, 16))
    int8 = _loaded(PlannerTable("t", 1000, 16, data_type="int8"))
    trained = holder_cost(fp32, ShardingType.TABLE_WISE, ComputeKernel.FUSED, 1000, 16, model)
    served = holder_cost(int8, ShardingType.TABLE_WISE, ComputeKernel.QUANT, 1000, 16, model)
    buffers = trained.storage - (1000 * 16 * 4 + 1000 * 4)
    # 16 int8 values and an fp16 scale and bias per row; no backward.
    assert served.storage == 1000 * (16 + 4) + buffers
    assert served.compute_s < trained.compute_s


def test_row_wise_quantized_comms_price_every_fetched_row() -> None:
    """Sharded quantized row-wise sends each id's stored row back (row fetching), so its
    output traffic grows with the ids and the row width, not with the pooled outputs."""
    topo = Topology(world_size=2)
    model = CostModel(topo, ADAGRAD_RW)

    def comms(dim: int, pooling: float) -> float:
        lt = _loaded(PlannerTable("t", 1000, dim, data_type="int8"), pooling=pooling)
        cost = holder_cost(lt, ShardingType.ROW_WISE, ComputeKernel.QUANT, 500, dim, model)
        return cost.comms_s

    ids_in = 2 * 10 * 4.0 * 500 / 1000  # global ids x the shard's share of the rows
    wider = comms(64, 4.0) - comms(16, 4.0)  # only the fetched rows' bytes differ
    assert wider == pytest.approx(ids_in * 48 / topo.intra_node_bw / 2, rel=1e-9)
    assert comms(16, 8.0) > comms(16, 4.0)
