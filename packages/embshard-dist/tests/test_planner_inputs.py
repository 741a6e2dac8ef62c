"""The planner's inputs: topologies (JSON round trip, validation), constraints, table specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embshard_dist.planner.constraints import (
    ParameterConstraints,
    check_constraints,
    constraints_for,
    table_workload,
)
from embshard_dist.planner.spec import load_table_spec, parse_table_spec
from embshard_dist.planner.tables import PlannerTable, find_tables
from embshard_dist.planner.topology import (
    SPARSE_UPDATE,
    KernelThroughput,
    Topology,
    default_topology,
)
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.vocab import ComputeKernel, ShardingType

# ---- topology ------------------------------------------------------------------------------


def test_topology_json_round_trip(tmp_path: Path) -> None:
    topo = Topology(
        world_size=4,
        local_world_size=2,
        memory_per_rank=1 << 30,
        reduce_scatter_bw=3e9,
        kernels={
            "fused": KernelThroughput(1e9, 5e8),
            ComputeKernel.DENSE: KernelThroughput(2e9, 1e9),
            SPARSE_UPDATE: {"fwd_bytes_per_s": 1e9, "bwd_bytes_per_s": 2e8},
        },
        source="test",
    )
    path = tmp_path / "topo.json"
    topo.save(path)
    assert Topology.load(path) == topo
    assert Topology.from_dict(json.loads(path.read_text())) == topo
    again = Topology.load(path, world_size=8, local_world_size=4)
    assert (again.world_size, again.num_nodes, again.memory_bw) == (8, 2, topo.memory_bw)


def test_topology_derived_values() -> None:
    topo = Topology(world_size=6, local_world_size=3)
    assert topo.num_nodes == 2
    assert topo.node_ranks(1) == [3, 4, 5]
    # A kernel that was not measured falls back to the fused kernel's throughput.
    assert topo.throughput(ComputeKernel.KEY_VALUE) == topo.throughput(ComputeKernel.FUSED)
    assert topo.within_node_reduce_bw == topo.intra_node_bw


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive int"),
        (
            {"world_size": 4, "local_world_size": 3},
            "local_world_size must be a positive int dividing",
        ),
        ({"world_size": 2, "compute_device": "tpu"}, "compute_device must be 'cpu' or 'cuda'"),
        ({"world_size": 2, "memory_bw": -1.0}, "memory_bw must be a positive finite number"),
        ({"world_size": 2, "memory_per_rank": 0}, "memory_per_rank must be positive"),
        (
            {"world_size": 2, "kernels": {"dense": KernelThroughput(1, 1)}},
            "needs an entry for 'fused'",
        ),
        ({"world_size": 2, "kernels": {"warp": KernelThroughput(1, 1)}}, "unknown ComputeKernel"),
    ],
)
def test_topology_refuses_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_topology_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json.*not valid JSON"):
        Topology.load(bad)
    newer = tmp_path / "newer.json"
    data = Topology(world_size=2).to_dict()
    data["version"] = 99
    newer.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"newer.json.*upgrade embshard-dist"):
        Topology.load(newer)
    unknown = tmp_path / "unknown.json"
    data["version"] = 1
    data["speed_of_light"] = 3e8
    unknown.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown field.*speed_of_light"):
        Topology.load(unknown)


def test_default_topology_shares_host_memory_between_local_ranks() -> None:
    one = default_topology(1)
    four = default_topology(4)
    assert four.memory_per_rank == pytest.approx(one.memory_per_rank / 4, rel=1e-6)
    assert four.source.startswith("defaults")
    assert default_topology(2, compute_device="cuda").host_memory_per_rank > 0


# ---- tables and constraints ----------------------------------------------------------------


def test_find_tables_from_configs_and_pairs() -> None:
    a = EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=8, feature_names=("fa", "fb"))
    b = EmbeddingBagConfig(name="b", num_embeddings=20, embedding_dim=4)
    found = find_tables([a, ("sparse.ebc", b)])
    assert [(t.key, t.rows, t.dim, t.features) for t in found] == [
        ("a", 10, 8, ("fa", "fb")),
        ("sparse.ebc.b", 20, 4, ("b",)),
    ]
    with pytest.raises(ValueError, match="table 'a' is given twice"):
        find_tables([a, a])
    with pytest.raises(TypeError, match="table entry 0"):
        find_tables(["a"])  # type: ignore[list-item]


def test_constraints_validate_and_look_up() -> None:
    c = ParameterConstraints(
        sharding_types=("row_wise",), compute_kernels=("fused",), ranks=(2, 0, 2)
    )
    assert c.sharding_types == (ShardingType.ROW_WISE,)
    assert c.compute_kernels == (ComputeKernel.FUSED,)
    assert c.ranks == (0, 2)
    t = PlannerTable("t", 10, 8, path="m")
    assert constraints_for(t, {"m.t": c, "t": ParameterConstraints()}) is c
    with pytest.raises(ValueError, match="min_partition must be a positive multiple of 4"):
        ParameterConstraints(min_partition=6)
    with pytest.raises(ValueError, match="pooling_factors values must be >= 0"):
        ParameterConstraints(pooling_factors=(-1.0,))
    with pytest.raises(ValueError, match="unknown ShardingType 'diagonal'"):
        ParameterConstraints(sharding_types=("diagonal",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharding_types is empty"):
        ParameterConstraints(sharding_types=())


def test_check_constraints_names_the_problem() -> None:
    tables = [PlannerTable("t", 10, 8, features=("f1", "f2"))]
    with pytest.raises(ValueError, match="constraints name table 'nope'"):
        check_constraints(tables, {"nope": ParameterConstraints()}, 2)
    with pytest.raises(ValueError, match="allow ranks \\[5\\], but the world has 2 ranks"):
        check_constraints(tables, {"t": ParameterConstraints(ranks=(5,))}, 2)
    with pytest.raises(ValueError, match="pooling_factors has 3 values but the table has 2"):
        check_constraints(tables, {"t": ParameterConstraints(pooling_factors=(1, 2, 3))}, 2)


def test_table_workload_sums_features() -> None:
    t = PlannerTable("t", 100, 8, features=("f1", "f2"), is_weighted=True)
    c = ParameterConstraints(
        pooling_factors=(2.0, 10.0), batch_sizes=(100, 50), num_poolings=(1, 2)
    )
    w = table_workload(t, c, batch_size=512)
    assert (w.bags, w.ids, w.weighted) == (200.0, 100 * 2 + 50 * 2 * 10, True)
    default = table_workload(t, ParameterConstraints(), batch_size=512)
    assert (default.bags, default.ids) == (1024.0, 1024.0)


# ---- spec files ----------------------------------------------------------------------------


def test_parse_table_spec() -> None:
    spec = parse_table_spec(
        {
            "module": "ebc",
            "batch_size": 128,
            "optimizer": "adagrad",
            "tables": [
                {"name": "t0", "rows": 1000, "dim": 16, "pooling_factor": 4},
                {
                    "name": "t1",
                    "rows": 50,
                    "dim": 8,
                    "sharding_types": ["data_parallel"],
                    "module": "other",
                },
                {"name": "t2", "rows": 50, "dim": 8},
            ],
        }
    )
    assert [t.key for t in spec.tables] == ["ebc.t0", "other.t1", "ebc.t2"]
    assert spec.batch_size == 128
    assert spec.optimizer.optim_type.value == "adagrad"
    assert spec.constraints["ebc.t0"].pooling_factors == (4.0,)
    assert spec.constraints["other.t1"].sharding_types == (ShardingType.DATA_PARALLEL,)
    assert "ebc.t2" not in spec.constraints


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tables": []}, "'tables' must be a non-empty list"),
        ({"tables": [{"name": "t", "rows": 1}]}, "table 't': missing key 'dim'"),
        (
            {"tables": [{"name": "t", "rows": 1, "dim": 4, "colour": 1}]},
            "table 't': unknown key.*colour",
        ),
        (
            {"tables": [{"name": "t", "rows": 0, "dim": 4}]},
            "table 't'.*rows must be a positive int",
        ),
        (
            {"tables": [{"name": "t", "rows": 1, "dim": 4, "min_partition": 3}]},
            "table 't'.*min_partition",
        ),
        ({"tables": [], "seed": 1}, "unknown top-level key.*seed"),
    ],
)
def test_parse_table_spec_errors(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_table_spec(data)


def test_load_table_spec_yaml_without_pyyaml(tmp_path: Path) -> None:
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]  # noqa: F401
    except ImportError:
        path = tmp_path / "spec.yaml"
        path.write_text("tables: []\n")
        with pytest.raises(ValueError, match=r"PyYAML is not installed.*write the spec as JSON"):
            load_table_spec(path)
    else:
        path = tmp_path / "spec.yaml"
        path.write_text("tables:\n  - {name: t, rows: 10, dim: 4}\n")
        assert [t.name for t in load_table_spec(path).tables] == ["t"]
