"""The planner fed by the run and by a calibration: traffic, calibrated costs, runtime topology.

Single process: distinct rows under uniform and Zipf ids, the topology's calibrated fields
(update throughput, sharding overheads) and how the cost model uses them, fitting overheads
from timed steps, the topology of a run (from a file, the env and the memory), sequence tables,
and the kernels the planner offers by default.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from embshard_dist.planner.auto import runtime_topology
from embshard_dist.planner.calibration.ranks import MEDIUM, TINY, fit_overheads
from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.cost_model import CostModel, load_tables
from embshard_dist.planner.costs import sharding_costs
from embshard_dist.planner.enumerate import DefaultCapabilities, enumerate_options
from embshard_dist.planner.estimate import estimate_plan
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.tables import PlannerTable, find_tables
from embshard_dist.planner.topology import (
    KernelThroughput,
    ShardingOverhead,
    Topology,
    default_topology,
)
from embshard_dist.planner.traffic import distinct_rows
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_optim.specs import OptimizerSpec, OptimType
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.vocab import ComputeKernel, ShardingType

ADAGRAD_RW = OptimizerSpec(OptimType.ROWWISE_ADAGRAD)

# ---- traffic -------------------------------------------------------------------------------


def test_uniform_ids_touch_the_expected_rows() -> None:
    assert distinct_rows(1000, 500) == pytest.approx(1000 * (1 - math.exp(-0.5)))
    assert distinct_rows(0, 10) == 0.0 and distinct_rows(10, 0) == 0.0


@pytest.mark.parametrize("rows", [50, 3_000, 20_000, 200_000])
def test_zipf_ids_touch_what_a_sample_touches(rows: int) -> None:
    s, draws = 1.05, 10_000
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-s)
    exact = float((-torch.expm1(-draws * probs / probs.sum())).sum())
    assert distinct_rows(rows, draws, s) == pytest.approx(exact, rel=0.01)
    # hot rows: far fewer distinct rows than uniform ids of the same count
    assert distinct_rows(rows, draws, s) <= distinct_rows(rows, draws) + 1e-9


def test_distinct_rows_grow_with_draws_and_stay_bounded() -> None:
    counts = [distinct_rows(100_000, n, 1.2) for n in (10, 100, 1_000, 10_000, 1e6)]
    assert counts == sorted(counts)
    assert all(c <= 100_000 for c in counts) and counts[0] <= 10


# ---- topology: calibrated fields -----------------------------------------------------------


def test_calibrated_fields_round_trip(tmp_path: Path) -> None:
    topo = Topology(
        world_size=2,
        kernels={"fused": KernelThroughput(4e9, 5e9, 2e9)},
        sharding_overheads={
            "table_wise": ShardingOverhead(0.004, 0.0002, 1.1),
            ShardingType.DATA_PARALLEL: {"step_s": 0.003},
        },
    )
    path = tmp_path / "topo.json"
    topo.save(path)
    again = Topology.load(path)
    assert again == topo
    assert again.overhead("data_parallel") == ShardingOverhead(0.003, 0.0, 1.0)
    assert again.overhead(ShardingType.ROW_WISE) is None
    assert again.throughput("fused").update_bytes_per_s == 2e9


def test_a_version_1_file_still_reads(tmp_path: Path) -> None:
    data = Topology(world_size=2).to_dict()
    data["version"] = 1
    del data["sharding_overheads"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Topology.load(tmp_path / "old.json")
    assert old.sharding_overheads == {} and old.throughput("fused").update_bytes_per_s is None


@pytest.mark.parametrize(
    ("overheads", "message"),
    [
        ({"sideways": ShardingOverhead(1.0)}, "unknown ShardingType 'sideways'"),
        ({"row_wise": {"step_s": -1.0}}, "ShardingOverhead.step_s must be"),
        ({"row_wise": {"step_s": 1.0, "compute_scale": 0}}, "compute_scale positive"),
        ({"row_wise": {"per_table_s": 1.0}}, "lacks field 'step_s'"),
        ({"row_wise": {"step_s": 1.0, "warp": 2}}, r"unknown field\(s\) \['warp'\]"),
    ],
)
def test_bad_sharding_overheads_are_refused(overheads: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        Topology(world_size=2, sharding_overheads=overheads)


# ---- costs with calibrated figures ---------------------------------------------------------


def _table_wise_costs(topo: Topology, zipf: float | None = None) -> float:
    table = PlannerTable("t", 100_000, 64)
    lt = load_tables([table], {"t": ParameterConstraints((ShardingType.TABLE_WISE,), pooling_factors=(20.0,), zipf_exponent=zipf)}, 512)[0]  # fmt: skip
    model = CostModel(topo, ADAGRAD_RW)
    options = enumerate_options([lt], [DefaultCapabilities()], model)[0]
    ps = options[0].build([0], model)
    return sharding_costs(lt, ps, model)[0].time_s


def test_the_update_costs_per_touched_row() -> None:
    fast = KernelThroughput(5e9, 5e9, 1e12)
    slow = KernelThroughput(5e9, 5e9, 1e8)
    with_fast = _table_wise_costs(Topology(world_size=2, kernels={"fused": fast}))
    with_slow = _table_wise_costs(Topology(world_size=2, kernels={"fused": slow}))
    assert with_slow > with_fast * 2
    # hot ids touch fewer rows, so the update costs less
    hot = _table_wise_costs(Topology(world_size=2, kernels={"fused": slow}), zipf=1.2)
    assert with_fast < hot < with_slow


def test_calibrated_overheads_enter_the_estimate() -> None:
    tables = [PlannerTable(f"t{i}", 1000, 16) for i in range(3)]
    base = Topology(world_size=2)
    planner = EmbeddingShardingPlanner(base, constraints={t.name: ParameterConstraints((ShardingType.TABLE_WISE,)) for t in tables})  # fmt: skip
    plan = planner.plan(tables)
    plain = estimate_plan(plan, tables, base)
    measured = replace(base, sharding_overheads={"table_wise": ShardingOverhead(0.010, 0.002, 3.0)})
    calibrated = estimate_plan(plan, tables, measured)
    assert calibrated.overhead.time_s == pytest.approx(0.010)
    for a, b in zip(plain.ranks, calibrated.ranks, strict=True):
        extra_comms = (b.comms_ms - a.comms_ms) / 1e3
        overhead_before = plain.overhead.time_s
        assert extra_comms == pytest.approx(0.010 - overhead_before + 3 * 0.002, rel=1e-6)
    assert calibrated.max_ms > plain.max_ms


def _medium_seconds(topo: Topology, kind: str) -> float:
    case = MEDIUM
    tables = [PlannerTable(c.name, c.num_embeddings, c.embedding_dim, "ebc", tuple(c.feature_names)) for c in case.configs()]  # fmt: skip
    constraints = {t.name: ParameterConstraints(pooling_factors=(case.ids_per_bag,)) for t in tables}  # fmt: skip
    plan = case.plan(ShardingType.parse(kind), topo.world_size)
    est = estimate_plan(plan, tables, topo, constraints=constraints, batch_size=case.batch, optimizer=ADAGRAD_RW)  # fmt: skip
    return est.max_ms / 1e3


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_fitted_overheads_recover_the_figures_that_made_the_steps(kind: str) -> None:
    base = default_topology(2)
    small, large = TINY
    truth = ShardingOverhead(0.004, 0.0003, 1.3)
    made = replace(base, sharding_overheads={**base.sharding_overheads, kind: truth})
    steps = [
        truth.step_s + small.tables * truth.per_table_s,
        truth.step_s + large.tables * truth.per_table_s,
        _medium_seconds(made, kind),
    ]
    fitted = fit_overheads(base, {kind: steps})[kind]
    assert fitted.per_table_s == pytest.approx(truth.per_table_s)
    assert fitted.step_s == pytest.approx(truth.step_s)
    assert fitted.compute_scale == pytest.approx(1.3, rel=1e-6)


def test_fitted_scales_stay_in_bounds() -> None:
    fitted = fit_overheads(default_topology(2), {"table_wise": [0.004, 0.003, 100.0]})
    assert fitted["table_wise"].per_table_s == 0.0
    assert fitted["table_wise"].compute_scale == 8.0
    fitted = fit_overheads(default_topology(2), {"table_wise": [0.004, 0.004, 0.0]})
    assert fitted["table_wise"].compute_scale == 0.25


# ---- the run's topology --------------------------------------------------------------------


def test_runtime_topology_keeps_a_files_speeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    calibrated = replace(
        default_topology(2),
        memory_bw=1.25e9,
        sharding_overheads={"row_wise": ShardingOverhead(0.5)},
        source="file",
    )
    calibrated.save(tmp_path / "t.json")
    topo = runtime_topology(4, "cpu", topology=tmp_path / "t.json")
    assert (topo.world_size, topo.ranks_per_node, topo.num_nodes) == (4, 2, 2)
    assert topo.memory_bw == 1.25e9 and topo.overhead("row_wise") == ShardingOverhead(0.5)
    assert topo.source == "file" and topo.memory_per_rank > 0
    fresh = runtime_topology(4, "cpu")
    assert fresh.ranks_per_node == 2 and fresh.source.startswith("defaults")
    assert runtime_topology(2, "cpu", topology=calibrated) is calibrated


def test_runtime_topology_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is for 2 ranks but the job shards over 3"):
        runtime_topology(3, "cpu", topology=default_topology(2))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        runtime_topology(2, "cpu", topology=tmp_path / "bad.json")
    cuda = default_topology(2, compute_device="cuda", memory_per_rank=1 << 30)
    cuda.save(tmp_path / "cuda.json")
    with pytest.raises(ValueError, match="calibrated for cuda but this job runs on cpu"):
        runtime_topology(2, "cpu", topology=tmp_path / "cuda.json")
    with pytest.raises(TypeError, match="must be a Topology or the path"):
        runtime_topology(2, "cpu", topology=42)  # type: ignore[arg-type]


# ---- what the planner sees -----------------------------------------------------------------


def test_sequence_tables_are_found_and_output_a_row_per_id() -> None:
    model = nn.Module()
    model.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="a", num_embeddings=100, embedding_dim=8)], device="meta")  # fmt: skip
    model.ec = EmbeddingCollection([EmbeddingConfig(name="b", num_embeddings=100, embedding_dim=8)], device="meta")  # fmt: skip
    a, b = find_tables(model)
    assert (a.key, a.sequence, b.key, b.sequence) == ("ebc.a", False, "ec.b", True)
    loaded = load_tables([a, b], {"a": ParameterConstraints(pooling_factors=(5.0,)), "b": ParameterConstraints(pooling_factors=(5.0,))}, 10)  # fmt: skip
    assert loaded[0].workload.output_rows == 10 and loaded[1].workload.output_rows == 50
    plan = EmbeddingShardingPlanner(default_topology(2)).plan(model)
    assert set(plan) == {"ebc", "ec"}


def test_dense_kernel_only_when_asked() -> None:
    table = PlannerTable("t", 1000, 16)
    model = CostModel(default_topology(2), ADAGRAD_RW)
    lt = load_tables([table], None, 16)
    kernels = {o.compute_kernel for o in enumerate_options(lt, [DefaultCapabilities()], model)[0]}
    assert ComputeKernel.DENSE not in kernels
    asked = load_tables([table], {"t": ParameterConstraints(compute_kernels=("dense",))}, 16)
    kernels = {o.compute_kernel for o in enumerate_options(asked, [DefaultCapabilities()], model)[0]}  # fmt: skip
    assert kernels == {ComputeKernel.DENSE}
