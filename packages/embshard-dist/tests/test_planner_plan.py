"""EmbeddingShardingPlanner on models and table lists: plans, JSON, stats, errors, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from embshard_dist.cli import main
from embshard_dist.planner.constraints import ParameterConstraints
from embshard_dist.planner.enumerate import DefaultCapabilities
from embshard_dist.planner.estimate import estimate_plan
from embshard_dist.planner.planner import EmbeddingShardingPlanner
from embshard_dist.planner.stats import PlannerError
from embshard_dist.planner.tables import PlannerTable
from embshard_dist.planner.topology import Topology
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.plan import EmbeddingModuleShardingPlan, ShardingPlan
from embshard_types.vocab import ComputeKernel, ShardingType


class _Model(nn.Module):
    def __init__(self, rows: tuple[int, ...] = (1000, 20_000, 300_000)) -> None:
        super().__init__()
        self.dense = nn.Linear(64, 64, device="meta")
        self.sparse = nn.Module()
        self.sparse.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=32)
                for i, r in enumerate(rows)
            ],
            device="meta",
        )


def _constraints() -> dict[str, ParameterConstraints]:
    return {
        "t0": ParameterConstraints(pooling_factors=(2.0,)),
        "t2": ParameterConstraints(pooling_factors=(30.0,)),
    }


def test_plan_of_a_model_covers_its_tables_and_round_trips() -> None:
    model = _Model()
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2), constraints=_constraints(), batch_size=128
    )
    plan = planner.plan(model)
    assert list(plan) == ["sparse.ebc"]
    module_plan = plan["sparse.ebc"]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    assert list(module_plan) == ["t0", "t1", "t2"]
    # The default sharder is embshard's EmbeddingBagCollectionSharder: its types only.
    offered = {
        ShardingType.DATA_PARALLEL,
        ShardingType.TABLE_WISE,
        ShardingType.ROW_WISE,
        ShardingType.COLUMN_WISE,
    }
    assert {ps.sharding_type for ps in module_plan.values()} <= offered
    assert ShardingPlan.from_json(plan.to_json()) == plan
    assert ShardingPlan.from_dict(json.loads(plan.to_json(indent=None))) == plan
    # The planner's estimate is the estimate of the plan it returns.
    result = planner.last_result
    assert result is not None
    again = estimate_plan(
        plan,
        model,
        planner.topology,
        constraints=_constraints(),
        batch_size=128,
        dense_bytes=64 * 65 * 4,
    )
    assert again.max_ms == pytest.approx(result.estimate.max_ms, rel=1e-9)
    assert [r.storage for r in again.ranks] == [r.storage for r in result.estimate.ranks]


def test_dense_parameters_are_reserved_on_every_rank() -> None:
    model = _Model()
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2, memory_per_rank=1 << 30), reserve_fraction=0.0
    )
    planner.plan(model)
    assert planner.last_result is not None
    dense = 64 * 65 * 4
    assert all(r.usable == (1 << 30) - 4 * dense for r in planner.last_result.estimate.ranks)


def test_sharder_module_type_selects_modules() -> None:
    class OtherSharder(DefaultCapabilities):
        module_type = nn.Linear

    class EbcSharder(DefaultCapabilities):
        module_type = EmbeddingBagCollection

        def sharding_types(self, compute_device_type: str) -> list[ShardingType]:
            return [ShardingType.ROW_WISE]

    planner = EmbeddingShardingPlanner(Topology(world_size=2))
    module_plan = planner.plan(_Model(), [OtherSharder(), EbcSharder()])["sparse.ebc"]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    assert {ps.sharding_type for ps in module_plan.values()} == {ShardingType.ROW_WISE}
    with pytest.raises(ValueError, match="none of the sharders given serves"):
        planner.plan(_Model(), [OtherSharder()])


def test_stats_table_content() -> None:
    planner = EmbeddingShardingPlanner(
        Topology(world_size=3), constraints=_constraints(), batch_size=64
    )
    result = planner.propose(_Model(), [DefaultCapabilities()])
    text = result.stats()
    assert text.startswith("embshard plan: estimated step")
    assert "3 tables on 3 ranks (cpu, 1 node(s) of 3)" in text
    assert "per rank:" in text and "memory used / usable (capacity)" in text
    for r in range(3):
        assert f"\n   {r} |" in text  # numbers right-aligned
    assert "per table:" in text
    for t in ("sparse.ebc.t0", "sparse.ebc.t1", "sparse.ebc.t2"):
        assert t in text
    assert "imbalance: time slowest/mean" in text
    crit = result.estimate.critical_rank
    assert f"critical path: rank {crit}" in text
    assert "compute" in text and "comms" in text and "collective latency" in text


def test_forced_placement_and_kernels_are_honoured() -> None:
    tables = [PlannerTable(f"t{i}", 10_000, 16) for i in range(4)]
    cons = {
        "t0": ParameterConstraints(ranks=(3,), sharding_types=("table_wise",)),
        "t1": ParameterConstraints(sharding_types=("column_wise",), compute_kernels=("dense",)),
    }
    plan = EmbeddingShardingPlanner(Topology(world_size=4), constraints=cons).plan(
        tables, [DefaultCapabilities()]
    )
    module_plan = plan[""]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    assert module_plan["t0"].ranks == (3,)
    assert module_plan["t1"].sharding_type is ShardingType.COLUMN_WISE
    assert module_plan["t1"].compute_kernel is ComputeKernel.DENSE


def test_too_big_table_is_refused_with_what_to_relax() -> None:
    tables = [PlannerTable("huge", 10_000_000, 128), PlannerTable("small", 100, 8)]
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2, memory_per_rank=1 << 30),
        constraints={"huge": ParameterConstraints(sharding_types=("table_wise",))},
    )
    with pytest.raises(PlannerError) as info:
        planner.plan(tables, [DefaultCapabilities()])
    message = str(info.value)
    assert "'huge' needs at least" in message
    assert "allowed: table_wise" in message
    assert "allow row_wise or column_wise or table_row_wise" in message
    assert "each of the 2 ranks has 921.6 MiB for tables" in message
    assert isinstance(info.value, ValueError)


def test_tables_that_do_not_fit_together_are_refused() -> None:
    tables = [PlannerTable(f"t{i}", 1_000_000, 64) for i in range(8)]
    planner = EmbeddingShardingPlanner(Topology(world_size=2, memory_per_rank=1 << 30))
    with pytest.raises(
        PlannerError, match=r"the tables need at least .* in all .* the 2 ranks have"
    ):
        planner.plan(tables, [DefaultCapabilities()])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="reserve_fraction must be in"):
        EmbeddingShardingPlanner(Topology(world_size=1), reserve_fraction=1.0)
    with pytest.raises(ValueError, match="world_size 4 differs from the topology's 2"):
        EmbeddingShardingPlanner(Topology(world_size=2), world_size=4)
    planner = EmbeddingShardingPlanner(
        Topology(world_size=2), constraints={"nope": ParameterConstraints()}
    )
    with pytest.raises(ValueError, match="constraints name table 'nope'"):
        planner.plan([PlannerTable("t", 10, 8)])
    with pytest.raises(ValueError, match="found no embedding collection in Linear"):
        planner.plan(nn.Linear(2, 2))


# ---- the command -------------------------------------------------------------------------


def test_plan_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "module": "sparse.ebc",
        "batch_size": 256,
        "tables": [
            {"name": "big", "rows": 200_000, "dim": 64, "pooling_factor": 20},
            {
                "name": "mid",
                "rows": 20_000,
                "dim": 32,
                "pooling_factors": [5, 1],
                "features": ["a", "b"],
            },
            {"name": "tiny", "rows": 100, "dim": 8, "sharding_types": ["data_parallel"]},
        ],
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    topo_path = tmp_path / "topo.json"
    Topology(world_size=2, memory_per_rank=1 << 32, source="test machine").save(topo_path)
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--tables",
            str(spec_path),
            "--topology",
            str(topo_path),
            "--out",
            str(out),
            "--world-size",
            "4",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "4 tables" not in printed and "3 tables on 4 ranks" in printed
    assert "topology: test machine" in printed and f"plan written to {out}" in printed
    plan = ShardingPlan.from_json(out.read_text())
    module_plan = plan["sparse.ebc"]
    assert isinstance(module_plan, EmbeddingModuleShardingPlan)
    assert sorted(module_plan) == ["big", "mid", "tiny"]
    assert module_plan["tiny"].sharding_type is ShardingType.DATA_PARALLEL
    for ps in module_plan.values():
        ps.check_world(4)


def test_plan_command_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"tables": [{"name": "t", "rows": 10}]}))
    code = main(["plan", "--tables", str(spec_path), "--out", str(tmp_path / "p.json")])
    assert code == 2
    assert "table 't': missing key 'dim'" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_calibrate_command_without_comms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "topo.json"
    assert main(["calibrate", "--out", str(out), "--world-size", "4", "--no-comms"]) == 0
    assert f"topology written to {out}" in capsys.readouterr().out
    topo = Topology.load(out)
    assert topo.world_size == 4
    assert (
        topo.source.startswith("calibrated on")
        and "comms and sharding overheads: defaults (not measured)" in topo.source
    )
    for kernel in ("fused", "dense", "sparse_update"):
        assert topo.kernels[kernel].fwd_bytes_per_s > 0 and topo.kernels[kernel].bwd_bytes_per_s > 0
    assert topo.memory_bw > 1e8
