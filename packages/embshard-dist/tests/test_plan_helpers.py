"""TorchRec-style plan helpers build the plans one would write by hand, and the sharder accepts
them."""

from __future__ import annotations

import pytest

import embshard_dist
from embshard_dist.sharded.embedding import EmbeddingCollectionSharder
from embshard_dist.sharded.embedding_bag import EmbeddingBagCollectionSharder
from embshard_dist.sharded.plan_helpers import (
    apply_to_all,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    get_default_sharders,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from embshard_dist.sharded.quant_embedding_bag import QuantEmbeddingBagCollectionSharder
from embshard_kernels.collections import EmbeddingBagCollection, EmbeddingCollection
from embshard_types.configs import EmbeddingBagConfig, EmbeddingConfig
from embshard_types.env import ShardingEnv
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.plan import EmbeddingModuleShardingPlan
from embshard_types.shard_spec import ShardSpec

WORLD, LOCAL = 4, 2
ROWS = {f"t{i}": 10 + i for i in range(7)}
DIM = 16


def ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=rows, embedding_dim=DIM, name=name)
            for name, rows in ROWS.items()
        ],
        device="meta",
    )


def spec(rank: int, offsets: tuple[int, int], sizes: tuple[int, int]) -> ShardSpec:
    return ShardSpec.on(rank, "cpu", offsets, sizes)


def hand_built() -> dict[str, ParameterSharding]:
    """The plan written out by hand: every shard, rank and kernel spelled out."""
    r = ROWS
    return {
        "t0": ParameterSharding("table_wise", "fused", (1,), (spec(1, (0, 0), (r["t0"], DIM)),)),
        "t1": ParameterSharding(
            "row_wise",
            "fused",
            (0, 1, 2, 3),
            (
                spec(0, (0, 0), (3, DIM)),
                spec(1, (3, 0), (3, DIM)),
                spec(2, (6, 0), (3, DIM)),
                spec(3, (9, 0), (2, DIM)),
            ),
        ),
        "t2": ParameterSharding(
            "column_wise",
            "dense",
            (0, 3),
            (spec(0, (0, 0), (r["t2"], 8)), spec(3, (0, 8), (r["t2"], 8))),
        ),
        "t3": ParameterSharding(
            "table_row_wise",
            "fused",
            (2, 3),
            (spec(2, (0, 0), (7, DIM)), spec(3, (7, 0), (6, DIM))),
        ),
        "t4": ParameterSharding(
            "table_column_wise",
            "fused",
            (0, 1),
            (spec(0, (0, 0), (r["t4"], 8)), spec(1, (0, 8), (r["t4"], 8))),
        ),
        "t5": ParameterSharding(
            "grid_shard",
            "fused",
            (0, 1, 2, 3),
            (
                spec(0, (0, 0), (8, 8)),
                spec(1, (8, 0), (7, 8)),
                spec(2, (0, 8), (8, 8)),
                spec(3, (8, 8), (7, 8)),
            ),
        ),
        "t6": ParameterSharding("data_parallel", "fused", (0, 1, 2, 3), None),
    }


def test_helpers_build_the_hand_written_plan_and_the_sharder_accepts_it() -> None:
    module = ebc()
    sharder = EmbeddingBagCollectionSharder(local_world_size=LOCAL)
    plan = construct_module_sharding_plan(
        module,
        {
            "t0": table_wise(rank=1),
            "t1": row_wise(),
            "t2": column_wise(ranks=[0, 3], compute_kernel="dense"),
            "t3": table_row_wise(host_index=1),
            "t4": table_column_wise(host_index=0),
            "t5": grid_shard(host_indexes=[0, 1]),
            "t6": data_parallel(),
        },
        sharder=sharder,
        local_size=LOCAL,
        world_size=WORLD,
        device_type="cpu",
    )
    assert isinstance(plan, EmbeddingModuleShardingPlan)
    assert dict(plan) == hand_built()
    sharder.check_plan(module, plan, ShardingEnv.from_local(WORLD, 0), "cpu")


def test_uneven_rows_sizes_and_apply_to_all() -> None:
    module = ebc()
    plan = construct_module_sharding_plan(
        module,
        {
            **apply_to_all(module, table_wise(rank=0)),
            "t1": row_wise(sizes_placement=([5, 0, 6, 0], "cpu")),
            "t2": column_wise(size_per_rank=[4, 12]),
        },
        world_size=WORLD,
        device_type="cpu",
    )
    assert plan["t0"] == ParameterSharding(
        "table_wise", "fused", (0,), (spec(0, (0, 0), (ROWS["t0"], DIM)),)
    )
    assert [s.sizes[0] for s in plan["t1"].shards or ()] == [5, 0, 6, 0]
    assert plan["t2"].ranks == (0, 1)
    assert [s.sizes[1] for s in plan["t2"].shards or ()] == [4, 12]
    EmbeddingBagCollectionSharder().check_plan(
        module, plan, ShardingEnv.from_local(WORLD, 0), "cpu"
    )


def test_sequence_collection_uses_its_default_sharder() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=9, embedding_dim=8, name="s")], device="meta"
    )
    plan = construct_module_sharding_plan(
        ec, {"s": row_wise()}, world_size=2, local_size=2, device_type="cpu"
    )
    assert plan["s"].ranks == (0, 1)
    EmbeddingCollectionSharder().check_plan(ec, plan, ShardingEnv.from_local(2, 0), "cpu")


@pytest.mark.parametrize(
    ("per_table", "message"),
    [
        ({"t0": table_wise(rank=0)}, r"missing \['t1'"),
        ({**{t: row_wise() for t in ROWS}, "nope": row_wise()}, r"unknown \['nope'\]"),
        ({**{t: row_wise() for t in ROWS}, "t0": table_wise(rank=4)}, "rank 4 is not a rank"),
        (
            {**{t: row_wise() for t in ROWS}, "t3": table_row_wise(host_index=2)},
            "table 't3': table_row_wise: host index 2 is not a node",
        ),
        (
            {**{t: row_wise() for t in ROWS}, "t2": column_wise(ranks=[0, 1, 2, 3, 0])},
            "table 't2'.*cannot be cut into 5 column-wise shards",
        ),
    ],
)
def test_bad_helpers_are_refused_naming_the_table(per_table: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        construct_module_sharding_plan(
            ebc(), per_table, local_size=LOCAL, world_size=WORLD, device_type="cpu"
        )


def test_world_size_needed_without_a_process_group() -> None:
    with pytest.raises(ValueError, match="pass world_size"):
        construct_module_sharding_plan(ebc(), apply_to_all(ebc(), row_wise()), device_type="cpu")
    with pytest.raises(ValueError, match="needs ranks"):
        column_wise()


def test_default_sharders_and_lazy_exports() -> None:
    kinds = [type(s) for s in get_default_sharders()]
    assert kinds == [
        EmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder,
        QuantEmbeddingBagCollectionSharder,
    ]
    assert embshard_dist.construct_module_sharding_plan is construct_module_sharding_plan
    assert embshard_dist.table_wise is table_wise and embshard_dist.grid_shard is grid_shard
